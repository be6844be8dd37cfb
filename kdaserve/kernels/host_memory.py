"""Host memory: the allocator kept from returning large buffers to the OS between forward
passes, and host data sent to a GPU without waiting for it (`to_device`).

glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mapping
and unmaps it on free, so each such temporary of a forward (a prefill step's MoE gather is
16k rows x 768 = 50 MB on the bench model) is paid again in page faults: the kernel zeroes
and maps every 4 KB page on first touch. Measured on a 2,048-token step: the gather took 11-18
ms, 1.2-1.7 ms into reused memory. With mmap off and a high trim threshold, freed blocks
stay in the heap for the next step (CPU inference stacks get the same by preloading
tcmalloc or jemalloc; glibc's own `mallopt` needs no extra library).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import torch

logger = logging.getLogger("kdaserve")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # free memory kept by the heap before it is returned to the OS


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process; False (and nothing changed) where libc has no glibc mallopt."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        logger.info("no glibc mallopt: large host buffers are mapped per allocation")
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device. A plain copy from pageable
    memory to a GPU waits for every kernel already queued, so a step's inputs sent that way
    would wait for the step in flight and undo overlap scheduling (engine/overlap.py); from
    pinned memory (torch's caching host allocator) the copy is queued like a kernel."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
