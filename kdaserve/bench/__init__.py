"""Benchmarks (`kdaserve bench ...`): print a table, write JSON; never part of the test suite."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def write_result(out: str | Path, result: dict[str, Any]) -> Path:
    """Every bench command's JSON result, its folder created as needed, with its run: what
    `bench report` says about where and how the numbers were taken."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run_record(), **result}, indent=2))
    return path


def run_record() -> dict[str, Any]:
    import torch

    from kdaserve.kernels.native.isa import level

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no", "--", ":/kdaserve"):
        commit += "-dirty"  # the package differs from the commit: say so
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]]
    command = "kdaserve " + " ".join(argv[1:]) if argv[0] in ("kdaserve", "__main__.py") \
        else " ".join(argv)
    return {"command": command,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit or None,
            "host": {"cpu": cpu, "cores": os.cpu_count(), "isa": level() or "none",
                     "torch": torch.__version__}}


def _git(*args: str) -> str:
    """git's answer about the package's own checkout ("" outside one, or without git)."""
    try:
        return subprocess.run(["git", "-C", str(Path(__file__).parent), *args],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
