"""Benchmarks (`kdaserve bench ...`): print a table, write JSON; never part of the test suite."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(out: str | Path, result: dict[str, Any]) -> Path:
    """Every bench command's JSON result, its folder created as needed."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
