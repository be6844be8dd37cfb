"""fla's naive KDA functions, loaded from their file so that `fla.ops` (which needs triton) is
never imported: naive.py is pure torch + einops."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def fla_naive() -> ModuleType:
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        pytest.skip("fla-core is not installed")
    path = Path(spec.origin).parent / "ops" / "kda" / "naive.py"
    mspec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    assert mspec is not None and mspec.loader is not None
    module = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(module)
    return module
