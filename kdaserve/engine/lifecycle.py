"""An engine's start-up and end: each start-up phase logged with its time, the weight load's
progress (a bar on a terminal, periodic log lines otherwise), and an engine process that exits
with the process that started it, however that one ends."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kdaserve.kernels import Kernels

logger = logging.getLogger("kdaserve")

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_S = 0.5


@dataclass(slots=True)
class Phase:
    name: str
    note: str = ""  # what the phase's log line reports besides its time


@contextlib.contextmanager
def phase(name: str) -> Iterator[Phase]:
    """Logs `start-up NAME: NOTE (T s)` when the block ends (operators read where start-up
    time goes; tests look for each phase's line)."""
    p = Phase(name)
    start = time.perf_counter()
    yield p
    logger.info("start-up %s: %s (%.1f s)", name, p.note or "done", time.perf_counter() - start)


class LoadProgress:
    """The weight load's progress, called with (bytes read, bytes in all): a tqdm bar when
    stderr is a terminal; otherwise a log line every `every` seconds, since a log file or a
    journal gets a bar's carriage returns as noise."""

    def __init__(self, every: float = 5.0, bar: bool | None = None) -> None:
        self.every = every
        self.use_bar = sys.stderr.isatty() if bar is None else bar
        self.bar: Any = None
        self.start = self.last = time.monotonic()
        self.lines = 0  # log lines written (without a bar)

    def __call__(self, done: int, total: int) -> None:
        if self.use_bar:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                desc="[kdaserve] weights", leave=False, file=sys.stderr)
            self.bar.update(done - self.bar.n)
            return
        now = time.monotonic()
        if now - self.last >= self.every and done < total:
            self.last = now
            self.lines += 1
            logger.info("start-up weights: %d%% (%.2f of %.2f GiB, %.0f s)",
                        100 * done // max(total, 1), done / 2**30, total / 2**30,
                        now - self.start)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def kernel_summary(kernels: Kernels) -> str:
    """Which backend each op resolved to, grouped: `native: linear, kda_chunk, ...`."""
    from kdaserve.kernels import OPS, registry

    by_backend: dict[str, list[str]] = {}
    for op in OPS:
        fn = getattr(kernels, op)
        name = next((b.name for b in registry.backends(op) if b.fn is fn), "?")
        by_backend.setdefault(name, []).append(op)
    return "; ".join(f"{name}: {', '.join(ops)}" for name, ops in by_backend.items())


def weights_summary(model: torch.nn.Module, load_format: str) -> str:
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    how = "random (load_format=dummy)" if load_format == "dummy" else "loaded"
    return (f"{sum(p.numel() for p in params) / 1e6:.0f}M parameters, "
            f"{nbytes / 2**30:.2f} GiB, {how}")


def exit_with_parent(parent: int, use_pdeathsig: bool) -> None:
    """Ends this process when `parent` (its parent at spawn) ends, SIGKILL included.

    Linux's PR_SET_PDEATHSIG=SIGKILL needs no Python code to run here, so a weight load or a
    forward holding the main thread (or the GIL) cannot delay the exit. The kernel sends it
    when the *thread* that forked us ends, so the parent asks for it only when it spawned us
    from its main thread (`use_pdeathsig`); otherwise, and where prctl is missing, a daemon
    thread polls getppid() (bounded by the GIL, unlike the signal)."""
    if not (use_pdeathsig and _set_pdeathsig(signal.SIGKILL)):
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_S)
            os._exit(1)

        threading.Thread(target=watch, name="kdaserve-parent-watch", daemon=True).start()
    # a parent that died before the prctl sent no signal: we are already someone else's
    if os.getppid() != parent:
        os._exit(1)


def run_with_parent(parent: int, use_pdeathsig: bool, target: str, *args: Any) -> None:
    """A spawned process's entry (multiprocessing target): exit_with_parent first, then
    `target` ("module:function") called with `args`. This module imports nothing heavy, so
    the process watches its parent within its first moments, not after the seconds torch's
    import takes (a target's module imports it: unpickling a target imports its module)."""
    exit_with_parent(parent, use_pdeathsig)
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(*args)


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc symbol (a static or unusual runtime)
        return False
