"""Shared fixtures: tiny random checkpoints in Moonshot's hub format, built once per session
with fixed seeds by the real checkpoint writer and read back by the real loader."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kdaserve.checkpoint import make_checkpoint
from kdaserve.datasets import GSM8K_ENV
from kdaserve.tokenizer import Tokenizer

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
def vl_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """K3 with a tiny random vision tower in the released format (--preset k3-tiny-vl)."""
    return make_checkpoint(tmp_path_factory.mktemp("vl") / "k3-tiny-vl", "k3-tiny-vl",
                           seed=0, dtype="float32")


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


# ---- Moonshot's K3 chat encoder, the reference of tests/unit/test_k3_render.py and
# tests/server/test_images.py ----
def load_encoding_k3() -> Any:
    """mlx-vlm's port of Moonshot's `encoding_k3.py`, loaded by its path (it imports only the
    standard library)."""
    found = importlib.util.find_spec("mlx_vlm")
    assert found is not None and found.submodule_search_locations
    path = Path(found.submodule_search_locations[0]) / "models" / "kimi_k3" / "encoding_k3.py"
    spec = importlib.util.spec_from_file_location("encoding_k3_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def reference_ids(tok: Tokenizer, segments: list[Any]) -> list[int]:
    """The ids of Moonshot's segments: specials allowed where a segment allows them, every
    other segment alone as ordinary text."""
    ids: list[int] = []
    for s in segments:
        ids.extend(tok.encode(s.text) if s.allow_special else tok.encode_ordinary(s.text))
    return ids
