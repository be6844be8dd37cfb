"""Our own Triton kernels (kdaserve/kernels/triton/) on the CPU: under Triton's interpreter,
and compiled ahead of time for a GPU. Triton lives in .venv/triton (the Makefile's `pip
install --target`), off this process's path on purpose: with triton importable,
transformers' Kimi Linear (the oracle of the model tests) would take fla's Triton kernels
instead of its torch path. So the checks (tests/kernels/interpreted/, compiled/) run in a
pytest process of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = ROOT / ".venv" / "triton"


def run_checks(folder: str, **env: str) -> None:
    """The folder's check_*.py in a pytest process of its own, with triton importable."""
    checks = sorted(str(p) for p in (ROOT / "tests" / "kernels" / folder).glob("check_*.py"))
    assert checks
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *checks],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(TRITON_DIR), str(ROOT)]), **env),
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


needs_triton = pytest.mark.skipif(not (TRITON_DIR / "triton").is_dir(),
                                  reason="no triton in .venv/triton (`make venv` installs it)")


@needs_triton
def test_triton_kernels_under_the_interpreter() -> None:
    run_checks("interpreted", TRITON_INTERPRET="1")


@needs_triton
def test_triton_kernels_compile_for_a_gpu() -> None:
    """tests/kernels/compiled/: each kernel compiled for sm_90 by Triton's own toolchain (no
    GPU needed) at Kimi's shapes, without register spills."""
    run_checks("compiled", TRITON_INTERPRET="0")
