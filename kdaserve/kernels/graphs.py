"""Recording a CUDA graph: the one way the engine's step runner (engine/cuda_graph.py) and a
drafter's pass (speculative/draft_graph.py) capture their forwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(run: Callable[[], None], device: torch.device, pool: Any = None,
            warmups: int = 2) -> torch.cuda.CUDAGraph:
    """`run` recorded into a graph on `device` (its memory from `pool`, shared between the
    caller's graphs: graph.pool()). It runs `warmups` times first on a side stream, which
    compiles and autotunes its kernels outside the capture."""
    with torch.cuda.device(device):  # the engine's GPU, not the default one
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls other threads make meanwhile (a weight-sync rendezvous, a
        # transfer engine's workers) do not invalidate the capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            run()
    return graph
