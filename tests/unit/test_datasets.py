"""Where GSM8K is found (kdaserve/datasets.py): a flag's folder, then $KDASERVE_GSM8K_DIR, then
the cache; never beside the source tree. No download happens here (the cache is pre-filled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdaserve.datasets import GSM8K_ENV, gsm8k_file, read_jsonl
from kdaserve.training.data import gsm8k_rows


def _write(folder: Path, split: str, question: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.jsonl").write_text(f'{{"question": "{question}", "answer": "#### 1"}}\n')


def test_flag_then_environment_then_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDASERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(GSM8K_ENV, raising=False)
    _write(tmp_path / "cache" / "gsm8k", "test", "cached")
    _write(tmp_path / "env", "test", "from env")
    _write(tmp_path / "flag", "test", "from flag")
    assert read_jsonl(gsm8k_file("test"))[0]["question"] == "cached"
    monkeypatch.setenv(GSM8K_ENV, str(tmp_path / "env"))
    assert read_jsonl(gsm8k_file("test"))[0]["question"] == "from env"
    assert gsm8k_rows("test", tmp_path / "flag")[0]["question"] == "from flag"


def test_a_named_folder_without_the_split_is_an_error(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GSM8K_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=rf"train.jsonl not found \(\${GSM8K_ENV}\)"):
        gsm8k_file("train")
    with pytest.raises(ValueError, match=r"not found \(--data-dir\)"):
        gsm8k_file("test", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="split 'dev'"):
        gsm8k_file("dev")
