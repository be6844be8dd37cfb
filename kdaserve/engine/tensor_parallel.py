"""Tensor-parallel ranks: rank 0 is the engine (scheduler, sampler, every decision); ranks
1..tp-1 are followers that hold their slices of the model and their heads' KDA states and run
every forward rank 0 runs, on the same `ForwardBatch`.

Each step rank 0 broadcasts the batch and the state-pool changes it made outside the forward
since the last one (slots zeroed on allocation, prefix-cache snapshot copies), then all ranks
run the forward together, all-reducing after each row-parallel projection; only rank 0
computes logits. The broadcast and the all-reduces are torch.distributed collectives (gloo on
CPU) over a TCP rendezvous at `dist_init_addr`, so ranks on other machines (`nnodes`,
`node_rank`) join the same way as local ones. A follower whose parent process dies exits (no
orphans); a rank that dies fails the next collective on every other rank.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import ModelConfig
from kdaserve.engine_config import EngineConfig, kernel_features
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import resolve_kernels
from kdaserve.layers.parallel import COMM, ExpertParallel, TensorParallel
from kdaserve.models.loader import build_model

logger = logging.getLogger("kdaserve")

# followers wait for rank 0's next step in a broadcast: an idle server must not time them out
IDLE_TIMEOUT = timedelta(days=365)


def local_ranks(c: EngineConfig) -> range:
    per_node = c.tp_size // c.nnodes
    return range(c.node_rank * per_node, (c.node_rank + 1) * per_node)


def free_local_addr(avoid: int | None = None) -> str:
    """host:port of a free local port other than `avoid`: a server's HTTP port is free until
    it binds it, after its engine (and the ranks' rendezvous on this port) has started."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != avoid:
            return f"127.0.0.1:{port}"


def with_init_addr(c: EngineConfig) -> EngineConfig:
    """A single-node config without dist_init_addr gets a free local port for it."""
    if c.tp_size == 1 or c.dist_init_addr:
        return c
    return dataclasses.replace(c, dist_init_addr=free_local_addr())


def join(c: EngineConfig, rank: int) -> TensorParallel:
    assert c.dist_init_addr is not None
    dist.init_process_group("gloo", init_method=f"tcp://{c.dist_init_addr}", rank=rank,
                            world_size=c.tp_size, timeout=IDLE_TIMEOUT)
    return TensorParallel(rank, c.tp_size, dist.group.WORLD)


def join_expert_parallel(c: EngineConfig) -> ExpertParallel:
    """A DP-attention engine joins the group of all data-parallel ranks (its MoE layers'
    collectives run over it)."""
    assert c.dist_init_addr is not None  # set by the data-parallel controller
    dist.init_process_group("gloo", init_method=f"tcp://{c.dist_init_addr}", rank=c.dp_rank,
                            world_size=c.dp_size, timeout=IDLE_TIMEOUT)
    return ExpertParallel(c.dp_rank, c.dp_size, dist.group.WORLD)


class Followers:
    """Rank 0's side: starts this node's other ranks, then leads them step by step."""

    def __init__(self, c: EngineConfig) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = [
            ctx.Process(target=follower_main, args=(c, rank), daemon=True,
                        name=f"kdaserve-tp{rank}") for rank in local_ranks(c) if rank != 0]
        for p in self.procs:
            p.start()
        joined = threading.Event()

        def watch() -> None:  # a local rank that dies before the rendezvous: never waited on
            while not joined.wait(0.5):
                dead = [p.name for p in self.procs if p.exitcode is not None]
                if dead:
                    logger.error("tensor parallel: %s exited during start-up", dead)
                    os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
        self.tp = join(c, 0)
        joined.set()

    def start(self, blocks: BlockPool, states: StatePool) -> None:
        """Tells every rank the pools' geometry (decided here, from rank 0's memory budget)
        and starts logging state changes."""
        dist.broadcast_object_list([(blocks.num_blocks, states.num_slots)], src=0)
        states.log = []

    def forward(self, fb: ForwardBatch, states: StatePool) -> None:
        log, states.log = states.log or [], []
        start = time.perf_counter()
        dist.broadcast_object_list([("forward", fb.owning(), log)], src=0)
        COMM["broadcast_s"] += time.perf_counter() - start

    def replay(self, rows: torch.Tensor, cu: torch.Tensor, slots: torch.Tensor,
               states: StatePool) -> None:
        """A speculative rollback: the followers restore their heads' states (the logged
        copies) and replay the accepted steps from their own record of the verify forward."""
        log, states.log = states.log or [], []
        dist.broadcast_object_list([("replay", rows, cu, slots, log)], src=0)

    @staticmethod
    def metrics() -> dict[str, float]:
        return {"tp_all_reduces": COMM["all_reduces"],
                "tp_all_reduce_bytes": COMM["all_reduce_bytes"],
                "tp_all_reduce_ms": COMM["all_reduce_s"] * 1e3,
                "tp_broadcast_ms": COMM["broadcast_s"] * 1e3}

    def stop(self) -> None:
        try:
            dist.broadcast_object_list([("stop",)], src=0)
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - a follower already gone: nothing to stop
            logger.warning("tensor parallel: stopping the followers: %s", e)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def serve_node(c: EngineConfig) -> int:
    """A node other than rank 0's (`node_rank` > 0): its ranks as followers, until they end
    (rank 0 stops them, or a rank's death breaks the collectives)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=follower_main, args=(c, rank), daemon=True,
                         name=f"kdaserve-tp{rank}") for rank in local_ranks(c)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max((p.exitcode or 0) for p in procs)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)  # blocked in a collective: only an exit ends it

    threading.Thread(target=watch, daemon=True).start()


def follower_main(c: EngineConfig, rank: int) -> None:
    """A follower rank: its model slice and pools, then every forward rank 0 sends."""
    logging.basicConfig(level=logging.INFO, format=f"[kdaserve tp{rank}] %(message)s")
    _exit_with_parent()
    from kdaserve.checkpoint import resolve_model_path

    path = resolve_model_path(c.model)
    mc = ModelConfig.from_pretrained(path)
    device = torch.device(c.device)
    tp = join(c, rank)
    model = build_model(mc, resolve_kernels(device, c.kernel_backend,
                                            features=kernel_features(mc, c)), torch.float32,
                        device,
                        path, c.load_format, c.seed,
                        getattr(torch, c.dtype) if c.dtype else None, c.quantization, tp)
    got: list[Any] = [None]
    dist.broadcast_object_list(got, src=0)
    if got[0] == ("stop",):  # rank 0 failed to start
        dist.destroy_process_group()
        return
    num_blocks, num_slots = got[0]
    blocks = BlockPool(mc, num_blocks, c.block_size, torch.float32, device)
    states = StatePool(mc, num_slots, torch.float32, device, tp.size)
    record = None  # this rank's step record of the last verify forward
    with torch.inference_mode():
        while True:
            msg: list[Any] = [None]
            dist.broadcast_object_list(msg, src=0)
            if msg[0][0] == "stop":
                break
            if msg[0][0] == "replay":
                _, rows, cu, slots, log = msg[0]
                states.apply(log)
                model.replay_kda(record, rows, cu, slots, states)
                continue
            _, fb, log = msg[0]
            states.apply(log)
            model.forward_hidden(fb, states, blocks)
            record = fb.record
    dist.destroy_process_group()
