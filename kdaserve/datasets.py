"""Where GSM8K comes from for the benchmarks (`bench gsm8k | spec | prefix-cache | accuracy`)
and the training commands (`train-lm`, `train-drafter`, `token-map`): the file or folder a
flag names (`--data`, `--data-dir`); else the folder $KDASERVE_GSM8K_DIR names (`test.jsonl`,
`train.jsonl`; `make` sets it to ../shared/data/gsm8k where that exists); else the cache,
~/.cache/kdaserve/gsm8k ($KDASERVE_CACHE moves it), filled from OpenAI's repository on first
use. Never a path relative to this source tree."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

GSM8K_ENV = "KDASERVE_GSM8K_DIR"
GSM8K_URL = ("https://raw.githubusercontent.com/openai/grade-school-math/master/"
             "grade_school_math/data/{split}.jsonl")
SPLITS = ("train", "test")


def cache_dir() -> Path:
    """kdaserve's cache folder (the native kernels' builds and the presets live there too)."""
    return Path(os.environ.get("KDASERVE_CACHE") or Path.home() / ".cache" / "kdaserve")


def gsm8k_file(split: str, data_dir: str | Path | None = None) -> Path:
    """`split`.jsonl of GSM8K, found as the module docstring says; ValueError naming where it
    looked when it is not there and cannot be fetched."""
    if split not in SPLITS:
        raise ValueError(f"GSM8K split {split!r}: one of {SPLITS}")
    named = data_dir or os.environ.get(GSM8K_ENV)
    if named:
        path = Path(named) / f"{split}.jsonl"
        if not path.is_file():
            where = "--data-dir" if data_dir else f"${GSM8K_ENV}"
            raise ValueError(f"GSM8K {split} data {path} not found ({where})")
        return path
    path = cache_dir() / "gsm8k" / f"{split}.jsonl"
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".part")
            urllib.request.urlretrieve(GSM8K_URL.format(split=split), tmp)
            tmp.replace(path)
        except OSError as e:
            raise ValueError(f"GSM8K {split} data is not in {path.parent} and could not be "
                             f"downloaded ({e}); set ${GSM8K_ENV} or pass --data / "
                             "--data-dir") from e
    return path


def read_jsonl(path: str | Path) -> list[dict[str, str]]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"GSM8K data file {p} not found")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
