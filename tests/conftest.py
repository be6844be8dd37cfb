"""Shared fixtures: tiny random checkpoints in Moonshot's hub format, built once per session
with fixed seeds by the real checkpoint writer and read back by the real loader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kdaserve.checkpoint import make_checkpoint
from kdaserve.datasets import GSM8K_ENV

TIERS = ("unit", "kernels", "model", "server")
SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def pytest_configure(config: pytest.Config) -> None:
    """What `make` does for a bare `pytest` run: GSM8K from the shared data beside the
    checkout, where it is there (the training tests read its train split)."""
    if GSM8K_ENV not in os.environ and (SHARED_GSM8K / "test.jsonl").is_file():
        os.environ[GSM8K_ENV] = str(SHARED_GSM8K)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its tier, its folder under tests/ (make test-<tier>)."""
    here = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(here).parts
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q_lora_rank null, one expert group; bf16 on disk like real checkpoints."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def k3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Kimi K3's released layout in miniature (make-checkpoint --preset k3-tiny), fp32,
    sharded in two with an index."""
    return make_checkpoint(tmp_path_factory.mktemp("k3"), "k3-tiny", seed=3, dtype="float32",
                           num_shards=2)


@pytest.fixture(scope="session")
def k3_mxfp4_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-small with its routed experts as K3 ships them (MXFP4), fp32 otherwise: a
    tensor-parallel rank's share of the intermediate size (64 / 2) is one scale group."""
    return make_checkpoint(tmp_path_factory.mktemp("k3-mxfp4"), "k3-small", seed=2,
                           dtype="float32", expert_format="mxfp4")


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q_lora_rank set, 4 expert groups (top-2 groups), fp32, sharded with an index."""
    return make_checkpoint(tmp_path_factory.mktemp("small"), "small", seed=1, dtype="float32",
                           num_shards=3)


@pytest.fixture(scope="session")
def gsm8k_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real GSM8K test set where $KDASERVE_GSM8K_DIR names it (`make` sets it to
    ../shared/data/gsm8k when that exists), else a small file in the same format (a clean
    CI clone may not have ../shared)."""
    folder = os.environ.get(GSM8K_ENV)
    if folder and (Path(folder) / "test.jsonl").is_file():
        return Path(folder) / "test.jsonl"
    import json

    path = tmp_path_factory.mktemp("gsm8k") / "test.jsonl"
    rows = [{"question": f"Tom has {i + 3} apples and buys {2 * i + 5} more at the market on "
                         f"day {i}. He gives {i} of them to his sister. How many are left?",
             "answer": f"He has {i + 3} + {2 * i + 5} = <<{i + 3}+{2 * i + 5}={3 * i + 8}>>"
                       f"{3 * i + 8} apples.\nAfter giving {i} away he has {3 * i + 8} - {i} = "
                       f"{2 * i + 8}.\n#### {2 * i + 8}"} for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
