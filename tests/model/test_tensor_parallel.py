"""Tensor parallelism of the model itself: two ranks (processes joined by gloo), each with
its slice of every per-head and intermediate tensor read from the checkpoint and its heads'
KDA states, give the single-process logits through prefill and decode steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import ModelConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import resolve_kernels
from kdaserve.layers.parallel import Shard, TensorParallel, tensor_of
from kdaserve.models.loader import build_model
from tests.ports import free_port

PROMPTS = [[5, 17, 300, 41, 9, 77, 1000], [2, 3], list(range(60, 100))]
DECODES = 3


def run_model(ckpt: Path, tp: TensorParallel) -> list[torch.Tensor]:
    """Logits of a prefill of PROMPTS, then DECODES greedy decode steps, on fresh pools."""
    mc = ModelConfig.from_pretrained(ckpt)
    device = torch.device("cpu")
    kernels = resolve_kernels(device, features=mc.kernel_features)
    model = build_model(mc, kernels, torch.float32, device, ckpt, tp=tp)
    bs = 16
    states = StatePool(mc, len(PROMPTS), torch.float32, tp_size=tp.size)
    blocks = BlockPool(mc, 64, bs, torch.float32)
    slots = [states.allocate() for _ in PROMPTS]
    tables = [blocks.allocate(8) for _ in PROMPTS]
    seqs = [list(p) for p in PROMPTS]
    out = []
    with torch.inference_mode():
        batch = ForwardBatch.build(seqs, [0] * len(seqs), slots, tables, bs, device=device)
        for _ in range(DECODES + 1):
            logits = model(batch, states, blocks)
            out.append(logits)
            nxt = logits.argmax(-1).tolist()
            starts = [len(s) for s in seqs]
            for s, t in zip(seqs, nxt, strict=True):
                s.append(t)
            batch = ForwardBatch.build([[s[-1]] for s in seqs], starts, slots, tables, bs,
                                       device=device)
    return out


def _rank_main(rank: int, size: int, port: int, ckpt: str, result: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        tp = TensorParallel(rank, size, dist.group.WORLD)
        logits = run_model(Path(ckpt), tp)
        if rank == 0:
            torch.save(logits, result)
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=["tiny", "k3", "k3_mxfp4"])
def ckpt(request: pytest.FixtureRequest) -> Path:
    """Kimi Linear, and K3 (its KDA heads with the stored-longer A_log, the LatentMoE's
    latent sums reduced before their norm, AttnRes), with float and MXFP4 experts."""
    return request.getfixturevalue(f"{request.param}_ckpt")


def test_two_ranks_equal_one(ckpt: Path, tmp_path: Path) -> None:
    want = run_model(ckpt, TensorParallel())
    result = tmp_path / "tp.pt"
    mp.start_processes(_rank_main, args=(2, free_port(), str(ckpt), str(result)),
                       nprocs=2, join=True, start_method="spawn")
    got = torch.load(result)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_shards_are_slices_of_the_checkpoint(ckpt: Path) -> None:
    """Each rank's loaded tensors are its slices of the single-process model's, and together
    the ranks hold every value once (per-head and intermediate tensors) or all of it
    (replicated tensors)."""
    mc = ModelConfig.from_pretrained(ckpt)
    device = torch.device("cpu")
    k = resolve_kernels(device, features=mc.kernel_features)
    full = build_model(mc, k, torch.float32, device, ckpt).checkpoint_tensors()
    ranks = [build_model(mc, k, torch.float32, device, ckpt,
                         tp=TensorParallel(r, 2)).checkpoint_tensors() for r in range(2)]
    sharded = 0
    for name, whole in full.items():
        dest = tensor_of(whole)  # K3's A_log: a Prefix of its stored vector on one rank too
        parts = [r[name] for r in ranks]
        if isinstance(parts[0], Shard):
            sharded += 1
            joined = torch.cat([p.dest for p in parts], dim=parts[0].dim)  # type: ignore
            assert torch.equal(joined, dest), name
        else:
            assert all(torch.equal(p, dest) for p in parts), name  # type: ignore[arg-type]
    assert sharded > len(full) // 2


def test_indivisible_heads_are_refused(ckpt: Path) -> None:
    mc = ModelConfig.from_pretrained(ckpt)
    device = torch.device("cpu")
    with pytest.raises(ValueError, match="not divisible by tp_size"):
        build_model(mc, resolve_kernels(device, features=mc.kernel_features), torch.float32,
                    device, ckpt, tp=TensorParallel(0, 3))
