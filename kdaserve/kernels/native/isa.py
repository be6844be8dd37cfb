"""The instruction-set level the native kernels are built for: the host's best, or a lower one
asked for with KDASERVE_ISA, so that one machine runs (and tests) the code every CPU kind below
it runs.

The levels are the kinds of x86 CPU the kernels have separate code for, in order:
  avx2         AVX2 + FMA (8-lane vectors; AMD Zen 1-3, Intel Haswell-Skylake client)
  avx512       AVX-512 F/BW/DQ/VL (16 lanes; Skylake-SP, Ice Lake)
  avx512_bf16  AVX-512 with the BF16 dot instructions (AMD Zen 4-5, Cooper Lake)
  amx          AMX tiles (Intel Sapphire Rapids and later)
A capped build keeps `-march=native` (its tuning and the features no kernel branches on) and
turns off the features above the level with `-mno-*`, which also switches off every extension
gcc makes depend on them (`-mno-avx512f` takes all of AVX-512 with it).

What the level does not reach: torch's own kernels (oneDNN, MKL) keep the host's best; cap them
with their own switches (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY) to emulate a whole machine.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from kdaserve.kernels.cpu.gemm import cpu_vendor

ENV = "KDASERVE_ISA"
LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
# /proc/cpuinfo flags each level needs, on top of the level below
_NEEDS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl"},
          "avx512_bf16": {"avx512_bf16"}, "amx": {"amx_tile", "amx_bf16", "amx_int8"}}
# what a build capped below a level turns off
_OFF = {"avx2": ["-mno-avx2"], "avx512": ["-mno-avx512f"], "avx512_bf16": ["-mno-avx512bf16"],
        "amx": ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512fp16"]}


BF16_DOTS_ENV = "KDASERVE_BF16_DOTS"


def cpu_flags() -> set[str]:
    """The host's /proc/cpuinfo feature flags (empty where there is no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def host_level(flags: set[str]) -> str | None:
    """The highest level whose features (and those of every level below) are all in flags;
    None for a CPU below AVX2 or not x86, where the build is `-march=native` uncapped."""
    best = None
    for name in LEVELS:
        if not _NEEDS[name] <= flags:
            break
        best = name
    return best


def resolve(host: str | None, asked: str | None) -> str | None:
    """The level to build for: the host's, or `asked` where it is set and not above it."""
    if not asked:
        return host
    asked = asked.strip().lower()
    if asked not in LEVELS:
        raise ValueError(f"{ENV}={asked!r}: not one of {', '.join(LEVELS)}")
    if host is None or LEVELS.index(asked) > LEVELS.index(host):
        raise ValueError(f"{ENV}={asked!r} is above this CPU's level ({host or 'below avx2'}): "
                         f"a cap can only lower the instruction set")
    return asked


@functools.cache
def level() -> str | None:
    """This process's level: KDASERVE_ISA if set (at most the host's), else the host's."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return resolve(host_level(cpu_flags()), os.environ.get(ENV))


def supported() -> list[str]:
    """Every level this host can run, lowest first (what a test run covers)."""
    host = host_level(cpu_flags()) if platform.machine() in ("x86_64", "AMD64") else None
    return [] if host is None else list(LEVELS[:LEVELS.index(host) + 1])


def compile_flags(target: str | None, host: str | None) -> list[str]:
    """`-march` and `-mno-*` flags that build for `target` on a host of level `host`."""
    flags = ["-march=native"]
    if target is None or host is None:
        return flags
    for name in LEVELS[LEVELS.index(target) + 1:LEVELS.index(host) + 1]:
        flags += _OFF[name]
    return flags


def at_least(name: str) -> bool:
    """Whether this process's kernels are built with the instructions of level `name`."""
    current = level()
    return current is not None and LEVELS.index(current) >= LEVELS.index(name)


def bf16_dots() -> bool:
    """Whether bf16 weights at 1-4 rows run on the BF16 dot instruction (gemm_blocks.h): a
    level from avx512_bf16 up, on AMD by default (Zen 4 issues a 512-bit VDPBF16PS a cycle by
    the instruction tables, and its widening shuffles are double-pumped: the bf16 weights there
    ran at 1.36-1.81x our fp32, not ~2x, so compute-bound; not yet measured on one here). On a
    Sapphire Rapids Xeon the dots measured slower than widening (gemm_blocks.h), so Intel keeps
    widening. KDASERVE_BF16_DOTS=1 or 0 decides instead (the tests run both ways)."""
    if not at_least("avx512_bf16"):
        return False
    asked = os.environ.get(BF16_DOTS_ENV, "").strip()
    if asked in ("0", "1"):
        return asked == "1"
    if asked:
        raise ValueError(f"{BF16_DOTS_ENV}={asked!r}: 0 or 1")
    return cpu_vendor() == "AuthenticAMD"
