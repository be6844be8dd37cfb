"""Builds the C++ kernels in csrc/ for this host on first use and binds them with ctypes.

Why g++ + ctypes rather than `torch.utils.cpp_extension`: the source includes no torch headers,
so it compiles in about two seconds instead of a minute, and the call costs a few microseconds.
`-march=native` makes the binary specific to this CPU (capped to a lower instruction-set level
with KDASERVE_ISA: isa.py), so the cache key includes the CPU's feature flags and the build's
flags as well as the source and the compiler. A machine without a compiler gets
`available() == (False, reason)` and the registry falls back to the torch backends.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdaserve.kernels.native import isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]
MAX_HEAD_DIM = 512  # kMaxDim in kda_common.h

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@dataclass(frozen=True)
class Library:
    sources: tuple[str, ...]
    flags: tuple[str, ...]  # on top of FLAGS
    signatures: dict[str, list | tuple[list, Any]]  # args, or (args, return type)


LIBRARIES = {
    "kda_cpu": Library(("kda_cpu.cpp", "kda_chunked_cpu.cpp", "gemm_cpu.cpp", "moe_cpu.cpp",
                        "mla_cpu.cpp", "elementwise_cpu.cpp", "decode_step.cpp", "amx_cpu.cpp",
                        "mxfp4_cpu.cpp", "image_attention_cpu.cpp", "vision_cpu.cpp"),
                       (), {
        "kda_decode_f32": [_P] * 13 + [_I] * 5 + [_F, _F],
        "kda_prefill_f32": [_P] * 3 + [_I] * 3 + [_P] * 2 + [_I] + [_P] * 7 + [_I] * 5
        + [_P, _F],
        "gated_rmsnorm_f32": [_P] * 4 + [_I] * 2 + [_F],
        "short_conv_f32": [_P, _I] + [_P] * 5 + [_I] * 3,
        "kda_chunked_f32": [_P] * 12 + [_I] * 4 + [_F],
        "mla_decode_f32": [_P] * 7 + [_I] * 6 + [_F],
        "mla_forward_f32": [_P, _I] + [_P] * 6 + [_I] * 9 + [_F],
        "rms_norm_f32": [_P, _I, _P, _P, _I, _I, _F],
        "argmax_rows_f32": [_P, _I, _I, _P],
        "decode_forward_f32": [_P] * 5 + [_I] + [_P] * 4 + [_I, _I, _P, _I, _I, _P, _P],
        "moe_experts_f32": [_P] * 6 + [_I] * 6 + [_F, _F],
        "linear_small_f32": [_P] * 3 + [_I] * 3,
        "linear_small_bf16w": [_P] * 3 + [_I] * 3,
        "linear_amx_ready": ([], _I),
        "linear_amx_bf16w": ([_P] * 3 + [_I] * 4, _I),
        "linear_amx_int8w": ([_P] * 4 + [_I] * 4, _I),
        "linear_amx_mxfp4w": ([_P] * 4 + [_I] * 4, _I),
        "moe_experts_bf16w": [_P] * 6 + [_I] * 6 + [_F, _F],
        "linear_small_int8w": [_P] * 4 + [_I] * 3,
        "moe_experts_int8w": [_P] * 8 + [_I] * 6 + [_F, _F],
        "moe_experts_mxfp4": [_P] * 8 + [_I] * 5 + [_F, _F],
        "mxfp4_rows_bf16": [_P, _P, _I, _I, _I, _P, _I],
        "moe_route_f32": [_P] * 4 + [_I] * 7 + [_F],
        "silu_mul_f32": [_P] * 2 + [_I] * 2,
        "situ_mul_f32": [_P] * 2 + [_I] * 2 + [_F, _F],
        "sigmoid_mul_f32": [_P] * 3 + [_I],
        "attn_res_norm_f32": [_P, _I, _P, _P, _F, _P, _F, _P, _I, _I],
        "copy_blocks": [_P] + [_I] * 3 + [_P] * 2 + [_I],
        "read_f32": ([_P, _I, _I], _F),
        "image_attention_ready": ([], _I),
        "image_attention_bf16": ([_P, _I] * 4 + [_I] * 3 + [_F], _I),
        "gelu_tanh_f32": [_P, _P, _I],
        "gelu_tanh_bf16": [_P, _P, _I],
        "rope_pairs_f32": [_P, _I] + [_P] * 3 + [_I] * 3,
        "rope_pairs_bf16": [_P, _I] + [_P] * 3 + [_I] * 3,
    }),
    # No fused multiply-add contraction: each value's operations are fixed by the source alone
    # (deterministic inference; see the file's header).
    "batch_invariant": Library(("batch_invariant.cpp",), ("-ffp-contract=off",), {
        "bi_linear_f32": [_P] * 3 + [_I] * 3,
        "bi_rms_norm_f32": [_P] * 3 + [_I] * 2 + [_F],
        "bi_gated_rms_norm_f32": [_P] * 4 + [_I] * 2 + [_F],
        "bi_silu_mul_f32": [_P] * 2 + [_I] * 2,
        "bi_sigmoid_f32": [_P] * 2 + [_I],
        "bi_situ_mul_f32": [_P] * 2 + [_I] * 2 + [_F, _F],
        "bi_attn_res_norm_f32": [_P, _I] + [_P] * 2 + [_F, _P, _F, _P] + [_I] * 2,
        "bi_short_conv_f32": [_P] * 6 + [_I] * 3,
        "bi_mla_attention_f32": [_P] * 9 + [_I] * 9 + [_F],
        "bi_moe_f32": [_P] * 6 + [_I] * 5 + [_F, _F],
        "bi_moe_mxfp4": [_P] * 8 + [_I] * 5 + [_F, _F],
    }),
}


def _cpu_flags() -> str:
    return " ".join(sorted(isa.cpu_flags())) or platform.processor()


def _isa_flags() -> list[str]:
    """-march=native, less the features above KDASERVE_ISA's level where it caps them; the
    BF16 dots where isa.bf16_dots() asks for them."""
    host = isa.host_level(isa.cpu_flags()) if isa.level() is not None else None
    return isa.compile_flags(isa.level(), host) + \
        (["-DKDASERVE_WANT_BF16_DOTS"] if isa.bf16_dots() else [])


def _cache_dir() -> Path:
    root = os.environ.get("KDASERVE_CACHE") or Path.home() / ".cache" / "kdaserve"
    return Path(root) / "native"


def _compile(cxx: str, sources: list[Path], flags: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes (test workers, a server and
    # its engine) never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *flags, *map(str, sources), "-o", tmp], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {' '.join(s.name for s in sources)} failed:\n"
                           f"{e.stderr}") from e


@functools.cache
def _load(name: str) -> tuple[ctypes.CDLL | None, str]:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None, "no C++ compiler (g++) on PATH"
    spec = LIBRARIES[name]
    sources, flags = [CSRC / s for s in spec.sources], [*FLAGS, *_isa_flags(), *spec.flags]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    headers = "".join(h.read_text() for h in sorted(CSRC.glob("*.h")))  # tiles.h
    key = hashlib.sha256("\0".join([*(s.read_text() for s in sources), headers,
                                    " ".join(flags), version, _cpu_flags()]).encode()
                         ).hexdigest()[:16]
    path = _cache_dir() / f"{name}-{key}.so"
    try:
        if not path.exists():
            logger.info("compiling %s for this CPU (level %s) -> %s", name, isa.level(), path)
            _compile(cxx, sources, flags, path)
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as e:
        logger.warning("native CPU kernels unavailable: %s", e)
        return None, str(e)
    for fn_name, sig in spec.signatures.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = sig if isinstance(sig, tuple) else (sig, None)
    return lib, ""


def available(name: str = "kda_cpu") -> tuple[bool, str]:
    lib, reason = _load(name)
    return lib is not None, reason


def library(name: str = "kda_cpu") -> ctypes.CDLL:
    lib, reason = _load(name)
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {reason}")
    return lib
