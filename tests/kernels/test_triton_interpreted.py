"""Our own Triton kernels (kdaserve/kernels/triton/moe.py) on the CPU, under Triton's
interpreter. Triton lives in .venv/triton (the Makefile's `pip install --target`), off this
process's path on purpose: with triton importable, transformers' Kimi Linear (the oracle of
the model tests) would take fla's Triton kernels instead of its torch path. So the checks
(tests/kernels/interpreted/) run in a pytest process of their own with TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = ROOT / ".venv" / "triton"


@pytest.mark.skipif(not (TRITON_DIR / "triton").is_dir(),
                    reason="no triton in .venv/triton (`make venv` installs it)")
def test_triton_kernels_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(TRITON_DIR), str(ROOT)]))
    checks = sorted(str(p) for p in (ROOT / "tests" / "kernels" / "interpreted").glob("check_*.py"))
    assert checks
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *checks],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
