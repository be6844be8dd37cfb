"""Sizing the engine's pools: how many KDA state slots (working, decode-track, prefix-cache
snapshots) and how many KV blocks fit the memory budget."""

from __future__ import annotations

import logging
import os

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import ModelConfig
from kdaserve.engine_config import EngineConfig

logger = logging.getLogger("kdaserve")

DEFAULT_MAX_KV_TOKENS = 131072


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_snapshot_slots(c: EngineConfig) -> int:
    """State slots the prefix cache keeps snapshots in."""
    if c.disable_prefix_cache:
        return 0
    # a snapshot per running request's fork point and prompt end, and some history
    return max(2 * c.max_num_seqs, 16) if c.num_snapshot_slots is None \
        else c.num_snapshot_slots


def make_pools(c: EngineConfig, mc: ModelConfig, model: torch.nn.Module, dtype: torch.dtype,
               device: torch.device, draft: tuple[int, int] = (0, 0)
               ) -> tuple[BlockPool, StatePool]:
    """The KV block pool and the KDA state pool, sized from the memory budget left after the
    model, a drafter's weights and the state slots (or from max_total_tokens). draft: what a
    drafter takes (bytes per KV block, bytes besides: speculative.build.draft_memory)."""
    draft_per_block, draft_bytes = draft
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + draft_bytes
    working = c.num_state_slots or c.max_num_seqs
    # with the prefix cache: a decode-track slot per running request + the snapshots
    num_slots = working if c.disable_prefix_cache else 2 * working + num_snapshot_slots(c)
    slot_bytes = StatePool.bytes_per_slot(mc, dtype, c.tp_size)
    block_bytes = BlockPool.bytes_per_block(mc, c.block_size, dtype)
    # every tensor-parallel rank on this machine holds its model share, its heads' states
    # and a whole KV pool (MLA's latent is replicated): the budget is split between them
    here = c.tp_size // c.nnodes
    budget = (int(c.mem_fraction * physical_memory()) // here - model_bytes
              - (num_slots + 1) * slot_bytes - block_bytes)  # + each pool's scratch row
    if budget <= 0:
        raise ValueError(
            f"{num_slots} state slots ({slot_bytes / 2**20:.1f} MiB each) and the model "
            f"({model_bytes / 2**30:.2f} GiB{' with its drafter' if draft_bytes else ''}) "
            f"exceed mem_fraction={c.mem_fraction}; lower max_num_seqs / num_state_slots")
    if c.max_total_tokens is not None:
        num_blocks = -(-c.max_total_tokens // c.block_size)
    else:  # a block is its latents and the drafter's pages beside them
        fit = budget // max(block_bytes + draft_per_block, 1)
        num_blocks = min(fit, DEFAULT_MAX_KV_TOKENS // c.block_size)
    blocks = BlockPool(mc, num_blocks, c.block_size, dtype, device)
    states = StatePool(mc, num_slots, dtype, device, c.tp_size)
    # The slot pool, not KV, usually bounds concurrency: a KDA state is worth thousands of
    # tokens of MLA latents.
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB); KDA state pool: %d slots "
        "(%.2f MiB each, %.1f MiB); one slot = %d tokens of KV; max running requests %d; "
        "prefix cache %s",
        num_blocks, c.block_size, num_blocks * c.block_size,
        num_blocks * block_bytes / 2**20, num_slots, slot_bytes / 2**20,
        num_slots * slot_bytes / 2**20, slot_bytes * c.block_size // max(block_bytes, 1),
        min(working, c.max_num_seqs),
        "off" if c.disable_prefix_cache else
        f"on ({num_snapshot_slots(c)} snapshot slots, snapshots every "
        f"{c.snapshot_interval} tokens)")
    return blocks, states
