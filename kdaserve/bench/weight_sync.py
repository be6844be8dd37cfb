"""`kdaserve bench weight-sync`: what a refit costs, per method, in seconds and MB/s.

The engine (in this process) receives the same weights three ways, as an RL trainer sends
them: from a checkpoint on disk, as shared tensors (`ForkingPickler` handles over the
`file_system` strategy: no copy through the request), and broadcast over torch.distributed
(gloo) by a trainer process. Each is timed end to end, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import io
import socket
import time
from typing import Any

from kdaserve.bench import write_result


def add_parser(sub: Any) -> None:
    p = sub.add_parser("weight-sync", help="refit time per method (disk, tensor, distributed)")
    p.add_argument("--model", default="bench")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_results/weight_sync.json")
    p.set_defaults(func=run)


def _trainer(path: str, port: int, repeats: int) -> None:
    """Rank 0: broadcasts the checkpoint's tensors `repeats` times."""
    import torch.distributed as dist

    from kdaserve import LLM

    named = list(LLM(path).model.checkpoint_tensors().items())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0)
    for _ in range(repeats):
        for _, v in named:
            dist.broadcast(v.detach().contiguous(), src=0)
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    import multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    import torch

    from kdaserve import LLM

    llm = LLM(args.model)
    e = llm.engine
    path = str(e.path)
    named = [(k, v.detach().clone()) for k, v in llm.model.checkpoint_tensors().items()]
    mb = sum(v.numel() * v.element_size() for _, v in named) / 2**20
    times: dict[str, float] = {}

    def best(fn: Any) -> float:
        out = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return min(out)

    times["disk"] = best(lambda: e.rl.update_weights_from_disk(path))
    torch.multiprocessing.set_sharing_strategy("file_system")

    def tensor() -> None:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(named)  # the trainer's side: handles, not bytes
        e.rl.update_weights_from_tensor([buf.getvalue()])

    times["tensor"] = best(tensor)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = mp.get_context("spawn").Process(target=_trainer, args=(path, port, args.repeats))
    trainer.start()
    e.rl.init_weights_update_group("127.0.0.1", port, 1, 2).result()
    names = [k for k, _ in named]
    dtypes = [str(v.dtype) for _, v in named]
    shapes = [list(v.shape) for _, v in named]
    times["distributed"] = best(lambda: e.rl.update_weights_from_distributed(names, dtypes, shapes))
    import torch.distributed as dist

    dist.barrier()
    e.rl.destroy_weights_update_group()
    trainer.join(60)
    rows = [{"method": m, "seconds": t, "mb": mb, "mb_per_s": mb / t} for m, t in times.items()]
    print(f"model {args.model}: {mb:.0f} MB of weights ({len(named)} tensors), best of "
          f"{args.repeats}")
    for r in rows:
        print(f"  {r['method']:<12} {r['seconds'] * 1e3:8.1f} ms  {r['mb_per_s']:8.0f} MB/s")
    write_result(args.out, {"model": args.model, "rows": rows})
