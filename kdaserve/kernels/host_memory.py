"""Host memory: the allocator kept from returning large buffers to the OS between forward
passes, weights on transparent huge pages (`advise_huge_pages`), and host data sent to a GPU
without waiting for it (`to_device`).

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
from typing import Any

import torch

logger = logging.getLogger("kdaserve")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # free memory kept by the heap before it is returned to the OS
MADV_HUGEPAGE = 14  # Linux's madvise advice (asm-generic/mman-common.h)
HUGE_PAGE = 2 << 20


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, TypeError):
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process; False (and nothing changed) where libc has no glibc mallopt."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        logger.info("no glibc mallopt: large host buffers are mapped per allocation")
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


@functools.cache
def _madvise() -> Any:
    fn = getattr(_libc(), "madvise", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Asks Linux for transparent huge pages under the whole 2 MB pages of a contiguous host
    tensor's memory; True where the kernel took the advice. Where THP is in `madvise` mode (many
    distributions' default) memory gets them only so advised, and only as it is first
    written: call this before filling t. Why weights: a decode step streams each of them
    once, and on 4 KB pages every 4 KB is a TLB miss and a boundary where the hardware
    prefetchers stop (the `bench` model's fp32 batch-1 decode steps, engines with and without
    huge pages alternated step by step in one process: 2-3% faster; the 100k x 768 lm_head
    read at 26.0 against 24.8 GB/s, median)."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    return end > start and madvise(start, end - start, MADV_HUGEPAGE) == 0


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
