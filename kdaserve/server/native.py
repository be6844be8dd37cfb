"""SGLang's native endpoints: /generate (what bench_sglang.py, SGLang's frontend language and RL
trainers call), /get_server_info, /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

import kdaserve
from kdaserve.client.request_client import EngineError
from kdaserve.multimodal import ImageInputs
from kdaserve.request import CompletionOutput, RequestOutput
from kdaserve.server.chat import chat_handler
from kdaserve.server.protocol import (
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    check_sequences,
)
from kdaserve.server.serving import (
    ServerState,
    admit,
    all_finals,
    check_length,
    check_model,
    first_then_rest,
    off_loop,
    sse,
    stream_error,
    timed,
    token_str,
)


def _entry(state: ServerState, req: GenerateRequest, lp: float | None, t: int) -> list[Any]:
    return [lp, t, token_str(state.tokenizer, t) if req.return_text_in_logprobs else None]


def _positions(state: ServerState, req: GenerateRequest, ids: list[int],
               lps: list[dict[int, float] | None], prefix: str) -> dict[str, Any]:
    """SGLang's logprob lists for one run of positions (input or output)."""
    top = req.top_logprobs_num
    tokens, tops, by_id = [], [], []
    for t, lp in zip(ids, lps, strict=True):
        if lp is None:
            tokens.append(_entry(state, req, None, t))
            tops.append(None)
            by_id.append(None)
            continue
        tokens.append(_entry(state, req, lp[t], t))
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        tops.append([_entry(state, req, v, k) for k, v in best])
        by_id.append([_entry(state, req, lp[k], k) for k in req.token_ids_logprob or []])
    out = {f"{prefix}_token_logprobs": tokens, f"{prefix}_top_logprobs": tops}
    if req.token_ids_logprob:
        out[f"{prefix}_token_ids_logprobs"] = by_id
    return out


def _meta(state: ServerState, req: GenerateRequest, rid: str, out: RequestOutput,
          o: CompletionOutput) -> dict[str, Any]:
    reason: dict[str, Any] | None = None
    if o.finish_reason == "length":
        reason = {"type": "length", "length": len(o.token_ids)}
    elif o.finish_reason == "stop":
        reason = {"type": "stop", "matched": o.stop_reason}
    elif o.finish_reason == "abort":
        reason = {"type": "abort", "message": "aborted"}
    prompt = out.prompt_token_ids
    meta: dict[str, Any] = {"id": rid, "finish_reason": reason, "prompt_tokens": len(prompt),
                            "completion_tokens": len(o.token_ids),
                            "cached_tokens": min(out.num_cached_tokens, len(prompt)),
                            "weight_version": state.weight_version}
    if req.return_logprob:
        if out.prompt_logprobs is not None:
            start = len(prompt) - len(out.prompt_logprobs)
            meta.update(_positions(state, req, prompt[start:], out.prompt_logprobs, "input"))
        elif req.bootstrap_room is not None:  # the PD router prepends the prefill server's
            meta.update({"input_token_logprobs": [], "input_top_logprobs": []})
        meta.update(_positions(state, req, o.token_ids, list(o.logprobs or []), "output"))
    if o.routed_experts is not None:
        meta["routed_experts"] = base64.b64encode(o.routed_experts.numpy().tobytes()).decode()
    if o.hidden_states is not None:
        rows = o.hidden_states.tolist()
        n = len(prompt)
        meta["hidden_states"] = [rows[:n], *rows[n:]]
    if o.spec_num_verifies:
        meta["spec_verify_ct"] = o.spec_num_verifies
        meta["spec_accept_length"] = o.spec_acceptance_length
    return meta


def _result(state: ServerState, req: GenerateRequest, rid: str, out: RequestOutput,
            o: CompletionOutput) -> dict[str, Any]:
    body: dict[str, Any] = {"output_ids": o.token_ids,
                            "meta_info": _meta(state, req, rid, out, o)}
    if state.tokenizer is not None:
        body = {"text": o.text or "", **body}
    return body


def _image_sources(data: str | list[Any], single: bool, prompts: int,
                   ) -> list[list[tuple[str, str]]]:
    """SGLang's image_data as (where, URL) per prompt: for one prompt an image or a list of
    them, for several a list with one entry (an image, a list or null) per prompt."""
    if single:
        if isinstance(data, str):
            return [[("image_data", data)]]
        if not all(isinstance(x, str) for x in data):
            raise ValueError("image_data for one prompt is an image or a list of images")
        return [[(f"image_data[{j}]", x) for j, x in enumerate(data)]]
    if not isinstance(data, list) or len(data) != prompts:
        raise ValueError(f"image_data for {prompts} prompts must be a list with one entry "
                         "(an image, a list of images or null) per prompt")
    out = []
    for i, x in enumerate(data):
        items = [] if x is None else [x] if isinstance(x, str) else x
        out.append([(f"image_data[{i}]" if isinstance(x, str) else f"image_data[{i}][{j}]", u)
                    for j, u in enumerate(items)])
    return out


async def generate(state: ServerState, req: GenerateRequest) -> Response:
    if (req.text is None) == (req.input_ids is None):
        raise ValueError("exactly one of text or input_ids is required")
    single = isinstance(req.text, str) or (
        req.input_ids is not None and all(isinstance(x, int) for x in req.input_ids))
    if req.text is not None:
        tok = state.need_tokenizer("text")
        texts = [req.text] if isinstance(req.text, str) else req.text
        prompts = await asyncio.to_thread(lambda: [tok.encode(t) for t in texts])
    else:
        prompts = [req.input_ids] if single else list(req.input_ids)  # type: ignore[list-item]
    sp = req.sampling_params
    check_sequences(len(prompts), sp.n or 1)
    images: list[ImageInputs | None] = [None] * len(prompts)
    if req.image_data is not None:
        sources = _image_sources(req.image_data, single, len(prompts))
        media = state.media
        if media is None:
            raise ValueError("this server takes no images (it runs without a tokenizer)")
        room = state.max_request_tokens
        prepared = await off_loop(state, True, lambda: [
            media.prepare(p, s, bare_base64=True, room=room)
            for p, s in zip(prompts, sources, strict=True)])
        prompts, images = [ids for ids, _ in prepared], [im for _, im in prepared]
    if state.tokenizer is None and (sp.stop or sp.regex or sp.json_schema or sp.ebnf):
        raise ValueError("stop strings and grammars need a tokenizer, but the server runs "
                         "with --skip-tokenizer-init")
    logprobs = req.top_logprobs_num if req.return_logprob else None
    # max_new_tokens 0 (SGLang's prefix-cache warm-up and its select scoring): prefill only,
    # the one sampled token is dropped
    prefill_only = sp.max_new_tokens == 0
    extra: dict[str, Any] = {"token_ids_logprob": list(req.token_ids_logprob or [])}
    options = req.options(return_routed_experts=req.return_routed_experts,
                          return_hidden_states=req.return_hidden_states,
                          routed_experts_start=req.routed_experts_start_len)
    if options.bootstrap is not None and len(prompts) > 1:
        raise ValueError("a disaggregated request (bootstrap_room) takes one prompt")
    results = []
    for p in prompts:
        if len(p) == 0:
            raise ValueError("empty prompt")
        if req.return_logprob:
            start = len(p) - 1 if req.logprob_start_len == -1 else req.logprob_start_len
            if start > len(p):
                raise ValueError(f"logprob_start_len ({start}) is past the prompt's "
                                 f"{len(p)} tokens")
            extra = {**extra, "prompt_logprobs": req.top_logprobs_num,
                     "logprob_start_len": start}
        params = state.sampling.params(sp.sampling_fields(), logprobs=logprobs, **extra)
        check_length(state.max_request_tokens, p, params.max_tokens)
        results.append(params)
    admit(state, len(prompts) * results[0].n)
    base = req.rid or uuid.uuid4().hex
    rids = [base if single else f"{base}-{i}" for i in range(len(prompts))]
    if req.stream:
        if not single:
            raise ValueError("streaming /generate takes one prompt")
        if prefill_only:
            raise ValueError("max_new_tokens 0 (prefill only) cannot stream")
        _, rest = await first_then_rest(timed(state, prompts[0], results[0], rids[0],
                                              options, images[0]))

        async def body() -> AsyncIterator[str]:
            try:
                async for out in rest:
                    for o in out.outputs:
                        yield sse({**_result(state, req, rids[0], out, o), "index": o.index})
                yield "data: [DONE]\n\n"
            except EngineError as e:
                yield stream_error(e)
            finally:
                await rest.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(body(), media_type="text/event-stream")
    finals = await all_finals([timed(state, p, sp_, r, options, im) for p, sp_, r, im
                               in zip(prompts, results, rids, images, strict=True)])
    if prefill_only:
        for f in finals:
            for o in f.outputs:
                o.token_ids, o.text = [], ""
                o.logprobs = [] if o.logprobs is not None else None
                o.finish_reason, o.stop_reason = "length", None
    out = [_result(state, req, f.rid, f, o) for f in finals for o in f.outputs]
    return JSONResponse(out[0] if single and results[0].n == 1 else out)


async def server_info(state: ServerState) -> dict[str, Any]:
    """SGLang's /get_server_info: the server's arguments and the scheduler's live state
    (sglang.bench_serving reads internal_states[0].avg_spec_accept_length)."""
    m = await state.client.get_metrics()

    def internal(m: dict[str, Any]) -> dict[str, Any]:
        return {"avg_spec_accept_length": m.get("spec_mean_acceptance_length", 0.0),
                **{k: v for k, v in m.items() if isinstance(v, int | float)}}

    states = [internal(r) for r in m["replicas"]] if "replicas" in m else [internal(m)]
    return {**state.server_args, "model_path": state.model_path,
            "served_model_name": state.model_name, "max_total_num_tokens":
            m.get("total_blocks", 0) * state.server_args.get("block_size", 0),
            "context_length": state.max_request_tokens, "internal_states": states,
            "version": kdaserve.__version__}


def tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    tok = state.need_tokenizer("/tokenize")
    check_model(state, req.model)
    if req.messages is not None:
        chat = chat_handler(state)
        # as chat requests are: special-token spellings in the messages stay text
        ids, _ = chat.render([m.model_dump(exclude_none=True) for m in req.messages],
                             state.media, add_generation_prompt=req.add_generation_prompt)
    else:
        assert req.prompt is not None
        # a raw prompt keeps SGLang's and vLLM's meaning: special spellings are specials.
        # Kimi's tokenizers add no special tokens of their own (the template writes them),
        # so add_special_tokens changes nothing here
        ids = tok.encode(req.prompt)
    # which text could spell control tokens: a raw prompt all of it, chat messages only
    # the template's own (content is encoded as ordinary text)
    out: dict[str, Any] = {"tokens": ids, "count": len(ids),
                           "max_model_len": state.max_request_tokens,
                           "special_tokens_from": "prompt" if req.messages is None
                           else "template"}
    if req.return_token_strs:
        out["token_strs"] = [tok.decode([t]) for t in ids]
    return out


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    tok = state.need_tokenizer("/detokenize")
    check_model(state, req.model)
    bad = [t for t in req.tokens if t >= tok.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the tokenizer's {tok.vocab_size} ids")
    text = tok.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
    return {"text": text, "prompt": text}  # SGLang's key and vLLM's

