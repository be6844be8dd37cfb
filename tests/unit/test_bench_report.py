"""`kdaserve bench report`: docs/benchmarks.md rendered from the bench commands' JSON, each
result with the run that wrote it (command, date, host, commit)."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from kdaserve.bench import run_record, write_result
from kdaserve.bench.report import main, render


def test_a_result_renders_as_its_run_settings_and_table(tmp_path: Path) -> None:
    path = write_result(tmp_path / "results" / "throughput.json", {
        "model": "bench", "output_len": 64, "kernels": {"linear": "linear_native"},
        "rows": [{"backend": "kdaserve", "batch": 1, "tok_s": 78.21, "vs_hf": 4.84},
                 {"backend": "hf", "batch": 1, "tok_s": 16.2, "vs_hf": None}]})
    result = json.loads(path.read_text())
    run = result["run"]
    assert run == {**run_record(), "date": run["date"]}  # where and how, recorded
    page = render([("throughput.json", result)])
    assert f"## `{run['command']}`" in page
    assert f"{run['host']['cores']} cores, native ISA {run['host']['isa']}" in page
    assert "Settings: model bench, output_len 64." in page  # nested values stay in the JSON
    table = page[page.index("| backend"):].splitlines()
    assert table[:4] == ["| backend | batch | tok_s | vs_hf |", "|---|---|---|---|",
                         "| kdaserve | 1 | 78.2 | 4.84 |", "| hf | 1 | 16.2 |  |"]
    out = tmp_path / "benchmarks.md"
    main(Namespace(results=str(tmp_path / "results"), out=str(out)))
    assert out.read_text() == page


def test_a_result_without_its_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no run record"):
        render([("old.json", {"rows": []})])
    with pytest.raises(ValueError, match="no \\*.json results"):
        main(Namespace(results=str(tmp_path), out=str(tmp_path / "b.md")))
