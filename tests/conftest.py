"""Shared fixtures: tiny random checkpoints in Moonshot's hub format, built once per session
with fixed seeds by the real checkpoint writer and read back by the real loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdaserve.checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q_lora_rank null, one expert group; bf16 on disk like real checkpoints."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q_lora_rank set, 4 expert groups (top-2 groups), fp32, sharded with an index."""
    return make_checkpoint(tmp_path_factory.mktemp("small"), "small", seed=1, dtype="float32",
                           num_shards=3)
