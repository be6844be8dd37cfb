"""The engine's `Speculator` for an `EngineConfig`: the configured drafter, loaded against the
target, and the adaptive policy."""

from __future__ import annotations

from pathlib import Path

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.radix_cache import RadixCache
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import EngineConfig, ModelConfig
from kdaserve.kernels import Kernels
from kdaserve.speculative.adaptive import AdaptiveSpeculation
from kdaserve.speculative.block import BlockDrafter
from kdaserve.speculative.draft_model import DraftModelDrafter
from kdaserve.speculative.drafter import Drafter
from kdaserve.speculative.dspark import DSparkDrafter
from kdaserve.speculative.ngram import NgramDrafter
from kdaserve.speculative.schedule import StepCost
from kdaserve.speculative.token_map import load_token_map
from kdaserve.speculative.verify import Speculator


def build_speculator(c: EngineConfig, draft_path: Path | None, target: ModelConfig,
                     kernels: Kernels, dtype: torch.dtype, device: torch.device,
                     states: StatePool, blocks: BlockPool, cache: RadixCache | None,
                     max_running: int) -> Speculator:
    """draft_path: speculative_draft_model resolved to a folder (None for n-gram)."""
    k = c.speculative_num_draft_tokens
    drafter: Drafter
    if c.speculative_algorithm == "ngram":
        drafter = NgramDrafter(k, c.speculative_ngram_max, c.speculative_ngram_min)
    else:
        assert draft_path is not None  # EngineConfig checks
        if c.speculative_algorithm in ("block", "dspark"):
            drafter = BlockDrafter.load(draft_path, target, k, dtype, device) \
                if c.speculative_algorithm == "block" else \
                DSparkDrafter.load(draft_path, target, k, dtype, device, kernels)
            if c.speculative_token_map is not None:
                drafter.restrict_vocab(load_token_map(c.speculative_token_map,
                                                      target.vocab_size))
        else:
            drafter = DraftModelDrafter.load(
                draft_path, target, kernels, dtype, device, k, max_running,
                blocks.num_blocks * blocks.block_size, c.block_size, c.max_num_batched_tokens)
    return Speculator(drafter, states, cache, AdaptiveSpeculation(
        c.speculative_min_acceptance_rate, c.speculative_disable_by_batch_size), StepCost())
