"""`LLM`: offline generation over a batch of prompts.

Prefill runs all prompts packed in one forward; decode then runs every unfinished sequence one
token per step against the caches (KDA state slots, paged MLA latents): nothing is recomputed.
The continuous-batching engine replaces this loop in the engine-core issue.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.checkpoint import PRESETS, default_model_path
from kdaserve.config import ModelConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import resolve_kernels
from kdaserve.models.loader import build_model
from kdaserve.request import RequestOutput, SamplingParams
from kdaserve.tokenizer import Tokenizer


def resolve_model_path(model: str | Path) -> Path:
    """A checkpoint folder, or a preset name for the built-in random-weight checkpoints."""
    path = Path(model)
    if path.is_dir():
        return path
    if str(model) in PRESETS:
        return default_model_path(str(model))
    raise ValueError(f"model {str(model)!r} is neither a checkpoint folder nor a preset "
                     f"({', '.join(sorted(PRESETS))})")


class LLM:
    def __init__(self, model: str | Path, device: str = "cpu", dtype: str | None = None,
                 load_format: str = "auto", skip_tokenizer_init: bool = False,
                 kernel_backend: str | None = None, block_size: int = 16, seed: int = 0) -> None:
        self.path = resolve_model_path(model)
        self.config = ModelConfig.from_pretrained(self.path)
        self.device = torch.device(device)
        # bf16 matmul is ~200x slower than fp32 on common CPUs: fp32 there, bf16 on accelerators
        self.dtype = getattr(torch, dtype) if dtype else (
            torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.kernels = resolve_kernels(self.device, kernel_backend)
        self.model = build_model(self.config, self.kernels, self.dtype, self.device, self.path,
                                 load_format, seed)
        self.tokenizer = None if skip_tokenizer_init else Tokenizer.from_pretrained(self.path)
        self.block_size = block_size

    # ---- helpers ----
    def _encode(self, prompts: list[str] | None,
                prompt_token_ids: list[list[int]] | None) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, but the LLM was created with "
                                 "skip_tokenizer_init=True; pass prompt_token_ids")
            return [self.tokenizer.encode(p) for p in prompts]
        assert prompt_token_ids is not None
        for ids in prompt_token_ids:
            if not ids:
                raise ValueError("empty prompt")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} outside vocabulary of "
                                 f"{self.config.vocab_size}")
        return [list(ids) for ids in prompt_token_ids]

    def _pools(self, num_seqs: int, max_len: int) -> tuple[StatePool, BlockPool]:
        per_seq = -(-max_len // self.block_size)
        return (StatePool(self.config, num_seqs, self.dtype, self.device),
                BlockPool(self.config, num_seqs * per_seq, self.block_size, self.dtype,
                          self.device))

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of one full-sequence forward (for tests and the verifier)."""
        states, blocks = self._pools(1, len(token_ids))
        slot = states.allocate()
        table = blocks.allocate(blocks.blocks_needed(len(token_ids)))
        batch = ForwardBatch.build([token_ids], [0], [slot], [table], self.block_size,
                                   all_logits=True, device=self.device)
        return self.model(batch, states, blocks)

    # ---- generation ----
    @torch.inference_mode()
    def generate(self, prompts: list[str] | str | None = None,
                 sampling_params: SamplingParams | None = None,
                 prompt_token_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        """Blocking generation for a batch (vLLM's argument order: prompts, sampling_params)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        prompt_ids = self._encode(prompts, prompt_token_ids)
        B = len(prompt_ids)
        states, blocks = self._pools(B, max(map(len, prompt_ids)) + params.max_tokens)
        slots = [states.allocate() for _ in range(B)]
        tables = [blocks.allocate(blocks.blocks_needed(len(p) + params.max_tokens))
                  for p in prompt_ids]
        gens = [torch.Generator().manual_seed(params.seed + i) if params.seed is not None
                else None for i in range(B)]
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.config.eos_token_ids)
            if self.tokenizer is not None:
                stop_ids |= set(self.tokenizer.eos_token_ids)
        outputs: list[list[int]] = [[] for _ in range(B)]
        reasons: list[str | None] = [None] * B
        active = list(range(B))
        new_tokens = prompt_ids
        num_cached = [0] * B
        while active:
            batch = ForwardBatch.build(new_tokens, num_cached, [slots[i] for i in active],
                                       [tables[i] for i in active], self.block_size,
                                       device=self.device)
            logits = self.model(batch, states, blocks)
            next_ids = sample(logits, params, [gens[i] for i in active])
            still, new_tokens, num_cached = [], [], []
            for row, i in enumerate(active):
                tok = next_ids[row]
                outputs[i].append(tok)
                if tok in stop_ids:
                    reasons[i] = "stop"
                elif len(outputs[i]) >= params.max_tokens:
                    reasons[i] = "length"
                else:
                    still.append(i)
                    new_tokens.append([tok])
                    num_cached.append(len(prompt_ids[i]) + len(outputs[i]) - 1)
            active = still
        for s in slots:
            states.free(s)
        for t in tables:
            blocks.free(t)
        return [RequestOutput(p, o, self.tokenizer.decode(o) if self.tokenizer else None,
                              r or "length")
                for p, o, r in zip(prompt_ids, outputs, reasons, strict=True)]


def sample(logits: torch.Tensor, params: SamplingParams,
           generators: list[torch.Generator | None]) -> list[int]:
    """Greedy when temperature is 0, else temperature / top-k / top-p sampling per row."""
    if params.temperature == 0:
        return logits.argmax(-1).tolist()
    logits = logits / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # drop tokens once the mass before them already reaches top_p (keeps at least one)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return [int(torch.multinomial(probs[r], 1, generator=g)) for r, g in enumerate(generators)]
