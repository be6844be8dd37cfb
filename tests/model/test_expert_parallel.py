"""DP attention with expert parallelism in the model: two ranks (gloo), each running
attention on its own sequences with its own caches and holding half the experts; every MoE
layer gathers both ranks' tokens, each rank applies its experts, the sums go back. Each
rank's logits equal the single-process logits of its sequences, through prefill and decode,
also on steps where one rank has no tokens at all."""

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
from kdaserve.layers.parallel import ExpertParallel
from kdaserve.models.loader import build_model
from tests.ports import free_port

PROMPTS = [[5, 17, 300, 41, 9, 77, 1000], [2, 3], list(range(60, 100)), [7] * 20]
OWNER = [0, 1, 0, 1]  # which rank serves each prompt
STEPS = 4  # the prefill, then decodes; rank 1 sits the second decode out (idle)


def run(ckpt: Path, ep: ExpertParallel, mine: list[int], steps: int = STEPS,
        idle: int | None = None) -> list[torch.Tensor]:
    """Logits per step for the prompts `mine` (indices into PROMPTS), greedy decodes; at
    step `idle` this rank has no tokens (its sequences wait a step)."""
    mc = ModelConfig.from_pretrained(ckpt)
    device = torch.device("cpu")
    kernels = resolve_kernels(device, features=mc.kernel_features)
    model = build_model(mc, kernels, torch.float32, device, ckpt, ep=ep)
    bs = 16
    states = StatePool(mc, len(PROMPTS), torch.float32)
    blocks = BlockPool(mc, 64, bs, torch.float32)
    slots = [states.allocate() for _ in mine]
    tables = [blocks.allocate(8) for _ in mine]
    seqs = [list(PROMPTS[i]) for i in mine]
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        batch = ForwardBatch.build(seqs, [0] * len(seqs), slots, tables, bs, device=device)
        for step in range(steps):
            if step == idle:
                model.idle_forward()  # no tokens this step; the others still need its experts
                continue
            logits = model(batch, states, blocks)
            out.append(logits)
            starts = [len(s) for s in seqs]
            for s, t in zip(seqs, logits.argmax(-1).tolist(), strict=True):
                s.append(t)
            batch = ForwardBatch.build([[s[-1]] for s in seqs], starts, slots, tables, bs,
                                       device=device)
    return out


def _rank_main(rank: int, port: int, ckpt: str, result: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        mine = [i for i, r in enumerate(OWNER) if r == rank]
        torch.save(run(Path(ckpt), ExpertParallel(rank, 2, dist.group.WORLD), mine,
                       idle=2 if rank == 1 else None), f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=["tiny", "k3", "k3_mxfp4"])
def ckpt(request: pytest.FixtureRequest) -> Path:
    """Kimi Linear, and K3 (its KDA heads with the stored-longer A_log, the LatentMoE's
    latent sums reduced before their norm, AttnRes), with float and MXFP4 experts."""
    return request.getfixturevalue(f"{request.param}_ckpt")


def test_two_ranks_equal_one(ckpt: Path, tmp_path: Path) -> None:
    result = str(tmp_path / "ep")
    mp.start_processes(_rank_main, args=(free_port(), str(ckpt), result), nprocs=2,
                       join=True, start_method="spawn")
    for rank in (0, 1):
        mine = [i for i, r in enumerate(OWNER) if r == rank]
        # rank 1 sat one step out: it made one step fewer
        want = run(ckpt, ExpertParallel(), mine, STEPS - (rank == 1))
        got = torch.load(f"{result}.{rank}")
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_ranks_hold_disjoint_experts(ckpt: Path) -> None:
    mc = ModelConfig.from_pretrained(ckpt)
    device = torch.device("cpu")
    k = resolve_kernels(device, features=mc.kernel_features)
    full = build_model(mc, k, torch.float32, device, ckpt).checkpoint_tensors()
    views = [build_model(mc, k, torch.float32, device, ckpt,
                         ep=ExpertParallel(r, 2)).checkpoint_tensors() for r in range(2)]
    experts = [n for n in full if ".experts." in n]
    assert experts
    for name in experts:
        held = [v[name] for v in views if v[name] is not None]
        assert len(held) == 1 and torch.equal(held[0], full[name]), name  # type: ignore
