"""The engine's `Speculator` for an `EngineConfig`: the configured drafter, loaded against the
target, and the adaptive policy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.radix_cache import RadixCache
from kdaserve.cache.state_pool import StatePool
from kdaserve.checkpoint import resolve_model_path
from kdaserve.config import ModelConfig
from kdaserve.engine_config import DEFAULT_DRAFTS, EngineConfig
from kdaserve.kernels import Kernels
from kdaserve.models.kimi_linear import KimiLinearForCausalLM
from kdaserve.models.loader import checkpoint_bytes
from kdaserve.speculative import draft_model
from kdaserve.speculative.adaptive import AdaptiveSpeculation
from kdaserve.speculative.block import BlockDrafter
from kdaserve.speculative.context_drafter import ContextDrafter, memory_plan
from kdaserve.speculative.context_net import BY_ARCHITECTURE
from kdaserve.speculative.draft_model import DraftModelDrafter
from kdaserve.speculative.drafter import Drafter
from kdaserve.speculative.dspark import DSparkDrafter
from kdaserve.speculative.ngram import NgramDrafter
from kdaserve.speculative.schedule import StepCost
from kdaserve.speculative.token_map import load_token_map
from kdaserve.speculative.verify import Speculator

logger = logging.getLogger("kdaserve")


def build_speculator(c: EngineConfig, draft_path: Path | None, model: KimiLinearForCausalLM,
                     kernels: Kernels, dtype: torch.dtype, device: torch.device,
                     states: StatePool, blocks: BlockPool, cache: RadixCache | None,
                     max_running: int, graphs: bool = False) -> Speculator:
    """draft_path: speculative_draft_model resolved to a folder (None for n-gram). graphs:
    the engine replays its steps from CUDA graphs, and a published drafter's drafting pass
    is replayed from its own."""
    target = model.config
    k = c.speculative_num_draft_tokens or DEFAULT_DRAFTS
    drafter: Drafter
    published = draft_path is not None and published_format(draft_path)
    if c.speculative_algorithm == "dflash" and published != "DFlashDraftModel":
        raise ValueError(f"speculative_algorithm='dflash' needs a DFlash drafter; "
                         f"{draft_path} is {published or 'not one of K3s published drafters'}")
    if c.speculative_algorithm != "dspark" and c.speculative_dspark_block_size is not None:
        raise ValueError("speculative_dspark_block_size applies to DSpark drafters")
    if c.speculative_algorithm == "ngram":
        drafter = NgramDrafter(k, c.speculative_ngram_max, c.speculative_ngram_min)
    elif published and c.speculative_algorithm in ("dspark", "dflash"):
        assert draft_path is not None
        drafter = ContextDrafter.load(draft_path, model, dtype, device, blocks)
        logger.info("drafter context pages: %d blocks x %d tokens, %.1f MiB",
                    blocks.num_blocks, blocks.block_size, drafter.pages.nbytes / 2**20)
        drafter.configure(c.speculative_num_draft_tokens, c.speculative_dspark_block_size)
        if graphs:
            drafter.use_graphs()
    else:
        assert draft_path is not None  # EngineConfig checks
        if c.speculative_dspark_block_size is not None:
            raise ValueError("speculative_dspark_block_size applies to K3's published DSpark "
                             "drafters (ours has its block in its config.json)")
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
    if published and c.speculative_token_map is not None:
        raise ValueError("speculative_token_map applies to our block and DSpark drafters")
    return Speculator(drafter, states, cache, AdaptiveSpeculation(
        c.speculative_min_acceptance_rate, c.speculative_disable_by_batch_size), StepCost())


def draft_model_path(c: EngineConfig) -> Path | None:
    """speculative_draft_model resolved to a folder (a preset name written once, as a target
    is); None for n-gram drafting."""
    draft = c.speculative_draft_model
    return Path(resolve_model_path(draft)) if draft else None


def draft_memory(c: EngineConfig, draft_path: Path | None, target: ModelConfig,
                 dtype: torch.dtype) -> tuple[int, int]:
    """What the memory plan sets aside for the configured drafter: (bytes per KV block, bytes
    besides). A published drafter's context pages and a draft model's own latents grow with
    the KV pool; their weights, a draft model's state slots, and our block and DSpark
    drafters' weights are besides (n-gram drafting takes nothing)."""
    if draft_path is None:
        return 0, 0
    if c.speculative_algorithm in ("dspark", "dflash") and published_format(draft_path):
        return memory_plan(draft_path, target, dtype, c.block_size)
    if c.speculative_algorithm == "draft":
        running = min(c.max_num_seqs, c.num_state_slots or c.max_num_seqs)  # the scheduler's
        return draft_model.memory_plan(draft_path, dtype, c.block_size,
                                       c.speculative_num_draft_tokens or DEFAULT_DRAFTS, running)
    return 0, checkpoint_bytes(draft_path, dtype)  # block, DSpark: their weights


def published_format(path: Path) -> str | None:
    """The architecture of one of K3's published drafters at path, else None."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    arch = (json.loads(f.read_text()).get("architectures") or [None])[0]
    return arch if arch in BY_ARCHITECTURE else None
