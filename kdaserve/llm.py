"""`LLM`: blocking offline generation over a batch of prompts, driven by `LLMEngine`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from PIL import Image

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.checkpoint import resolve_model_path
from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.engine_config import EngineConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.request import RequestOptions, RequestOutput, SamplingParams

__all__ = ["LLM", "resolve_model_path"]

logger = logging.getLogger("kdaserve")
T = TypeVar("T")


def per_prompt(name: str, given: T | list[T] | None, default: Callable[[], T],
               n: int) -> list[T]:
    """One value for each of n prompts: a list of them, or one (or the default) for all."""
    if isinstance(given, list):
        if len(given) != n:
            raise ValueError(f"{name} list must match the number of prompts")
        return given
    return [given if given is not None else default()] * n


class LLM:
    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        """`model`: a checkpoint folder or a preset name; keyword arguments are
        `EngineConfig` fields (device, dtype, load_format, skip_tokenizer_init, block_size,
        max_num_seqs, max_num_batched_tokens, max_total_tokens, num_state_slots, ...)."""
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), **engine_kwargs))

    # conveniences used by tests, the CLI and benchmarks
    @property
    def config(self):  # noqa: ANN201 - ModelConfig
        return self.engine.model_config

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer | None
        return self.engine.tokenizer

    @property
    def path(self):  # noqa: ANN201
        return self.engine.path

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def get_metrics(self) -> dict[str, int]:
        return self.engine.get_metrics()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def generate(self, prompts: list[str] | str | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None,
                 options: RequestOptions | list[RequestOptions] | None = None,
                 image_data: list[list[Image.Image]] | None = None,
                 ) -> list[RequestOutput]:
        """Blocking generation (vLLM's argument order: prompts, sampling_params). All prompts
        are validated before any is queued, so a bad one leaves the engine untouched.
        `options`: what the requests ask beyond sampling (hidden states, routed experts), one
        for all or one per prompt. `image_data` (SGLang's name): per prompt its images, one
        for each `<|media_pad|>` in it (a K3 checkpoint with its vision tower)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        inputs: list[str | list[int]] = list(prompts if prompts is not None
                                             else prompt_token_ids)  # type: ignore[arg-type]
        params = per_prompt("sampling_params", sampling_params, SamplingParams, len(inputs))
        opts = per_prompt("options", options, RequestOptions, len(inputs))
        images = per_prompt("image_data", image_data, list, len(inputs)) \
            if image_data is not None else [[] for _ in inputs]
        # each prompt with its images' prompts: all checked before any is queued
        expanded = [self.engine.images.expand(self.engine.encode(x), ims)
                    for x, ims in zip(inputs, images, strict=True)]
        for (ids, _), p in zip(expanded, params, strict=True):
            if len(ids) + p.max_tokens > self.engine.scheduler.max_request_tokens():
                raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {p.max_tokens} "
                                 "exceeds the KV cache capacity "
                                 f"({self.engine.scheduler.max_request_tokens()} tokens)")
        rids = [self.engine.add_request(ids, p, options=o, images=ims)
                for (ids, ims), p, o in zip(expanded, params, opts, strict=True)]
        finished: dict[str, RequestOutput] = {}
        self.engine.out.stream = False  # only the final outputs are kept here
        try:
            while self.engine.has_unfinished() or self.engine.out.failures:
                for out in self.engine.step():
                    if out.finished:
                        finished[out.rid] = out
                for rid, why in self.engine.take_failures():  # ends as "abort"; the rest go on
                    logger.error("request %s failed: %s", rid, why)
        finally:
            self.engine.out.stream = True
        for out in self.engine.step():  # the aborts of the last failures
            finished[out.rid] = out
        return [finished[r] for r in rids]

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of one plain full-sequence forward, on private caches
        (the oracle the engine paths are compared against)."""
        return self.engine.model.compute_logits(self.prefill_hidden(token_ids))

    def prefill_hidden(self, token_ids: list[int]) -> torch.Tensor:
        """`prefill_logits`' final-normed hidden states [T, D] (what the LM head sees)."""
        return self.prefill_taps(token_ids, ())[0]

    @torch.inference_mode()
    def prefill_taps(self, token_ids: list[int], taps: tuple[int, ...],
                     stream: str = "partial") -> tuple[torch.Tensor, torch.Tensor | None]:
        """`prefill_hidden`, and the residual streams after layers `taps` [T, len(taps) * D]
        (what a DSpark drafter reads; None without taps); K3's `stream` as
        `ForwardBatch.tap_stream`."""
        e = self.engine
        if e.config.tp_size > 1:  # the other ranks would have to run this forward too
            raise ValueError("prefill_logits is a single-process oracle (tp_size 1)")
        bs = e.config.block_size
        states = StatePool(e.model_config, 1, e.dtype, e.device)
        blocks = BlockPool(e.model_config, -(-len(token_ids) // bs), bs, e.dtype, e.device)
        batch = ForwardBatch.build([list(token_ids)], [0], [states.allocate()],
                                   [blocks.allocate(blocks.num_blocks)], bs, all_logits=True,
                                   device=e.device)
        batch.taps, batch.tap_stream = taps, stream
        return e.model.forward_hidden(batch, states, blocks), batch.tapped
