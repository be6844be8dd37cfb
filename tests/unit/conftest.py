"""Fixtures shared by the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdaserve.tokenizer_writer import write_kimi_tokenizer

from .tokenizer_helpers import SMALL_BASE


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Kimi-format tokenizer folder over the first SMALL_BASE cl100k ranks."""
    out_dir = tmp_path_factory.mktemp("kimi_small")
    write_kimi_tokenizer(out_dir, SMALL_BASE)
    return out_dir
