"""What a sampled token does to its request (stop checks, detokenization, logprobs) and the
updates a step returns (`RequestOutput`s of the requests it touched): a mixin of
`LLMEngine`, apart so its step reads alone."""

from __future__ import annotations

import logging
from typing import Any

import torch

from kdaserve.engine.grammar import note_reasoning
from kdaserve.request import CompletionOutput, Request, RequestOutput

logger = logging.getLogger("kdaserve")


class RequestUpdates:
    # set by LLMEngine
    groups: dict[str, list[Request]]
    detok: dict[int, Any]
    counters: dict[str, int]
    scheduler: Any
    stop_ids: Any
    stream_outputs: bool
    _scored: set[str]
    _serial: set[str]

    def append_token(self, req: Request, token: int, logprob: float | None,
                top: dict[int, float] | None) -> None:
        req.output_ids.append(token)
        note_reasoning(req)
        grammar_done = False
        if req.matcher is not None:
            try:
                req.matcher.accept(token)
            except ValueError:  # a bug, but one request's: it ends, the batch goes on
                logger.exception("request %s: grammar rejected token %d", req.rid, token)
                self.scheduler.finish(req, "abort")
                return
            grammar_done = req.matcher.is_terminated
        self.counters["generation_tokens"] += 1
        if req.params.logprobs is not None and logprob is not None and top is not None:
            req.logprobs.append(top)
            req.cumulative_logprob += logprob
        p = req.params
        detok = self.detok.get(id(req))
        stop_str = detok.add(token) if detok is not None else None
        if (token in p.stop_token_ids) or (not p.ignore_eos and token in self.stop_ids):
            self.scheduler.finish(req, "stop")
            req.stop_reason = token
        elif stop_str is not None:
            self.scheduler.finish(req, "stop")
            req.stop_reason = stop_str
        elif grammar_done:  # the grammar allows nothing more: complete
            self.scheduler.finish(req, "stop")
        elif len(req.output_ids) >= p.max_tokens:
            self.scheduler.finish(req, "length")
        if req.is_finished and detok is not None:
            detok.flush()

    def _group_id(self, req: Request) -> str:
        return req.rid if req.params.n == 1 else req.rid.rsplit("-", 1)[0]

    def _group_output(self, rid: str) -> RequestOutput:
        children = self.groups[rid]
        outs = []
        for i, r in enumerate(children):
            detok = self.detok.get(id(r))
            outs.append(CompletionOutput(
                index=i, token_ids=list(r.known_output_ids),
                text=detok.visible_text(r.is_finished) if detok is not None else None,
                finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
                cumulative_logprob=r.cumulative_logprob if r.params.logprobs is not None
                else None, spec_num_drafted=r.num_drafted, spec_num_accepted=r.num_accepted,
                spec_num_verifies=r.num_verifies,
                routed_experts=torch.cat(r.routed_experts) if r.is_finished
                and r.params.return_routed_experts and r.routed_experts else None,
                hidden_states=torch.cat(r.hidden_states) if r.is_finished
                and r.params.return_hidden_states and r.hidden_states else None))
        first = children[0]
        finished = all(r.is_finished for r in children)
        # prompt logprobs go out once (the first update) and with the final one, not with
        # every token: they can be as long as the prompt
        send = first.prompt_logprobs is not None and (finished or rid not in self._scored)
        if send:
            self._scored.add(rid)
        return RequestOutput(rid, first.prompt_ids, outs, finished=finished,
                             prompt_logprobs=list(first.prompt_logprobs or []) if send else None,
                             num_cached_tokens=first.num_cached_prompt)

    def _forget(self, rid: str) -> None:
        self._scored.discard(rid)
        self._serial.discard(rid)
        for r in self.groups.pop(rid):
            self.detok.pop(id(r), None)
            r.matcher = None

    def _updates(self, touched: dict[str, None]) -> list[RequestOutput]:
        outputs = []
        for rid in touched:
            group = self.groups[rid]
            first = group[0]
            if first.prompt_logits_row is not None and not first.is_finished:
                continue  # a sibling decodes before child 0 has scored the prompt: wait
            if not self.stream_outputs and not (first.is_finished if len(group) == 1 else
                                                all(r.is_finished for r in group)):
                continue  # each update copies every token so far: a caller may not want them
            out = self._group_output(rid)
            outputs.append(out)
            if out.finished:
                self.counters["num_finished"] += 1
                self._forget(rid)
        return outputs
