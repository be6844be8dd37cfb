"""The GRPO demo (examples/grpo_tiny.py) end to end for a few steps, as CI can afford: a
`kdaserve serve` process does the rollouts, transformers trains, weights sync every step.

What the run must show: the trainer's logprobs of the rollout tokens, computed with the
routing the server returned (R3), equal the server's to 1e-4 at every step, which holds only
if the synced weights are the trainer's; each step's rollouts come from the previous step's
weights (`weight_version`); rewards are the task's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def run_demo(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "grpo.json"
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "grpo_tiny.py"), "--steps",
                           "2", "--batch", "4", "--group", "4", "--out", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("extra", [(), ("--sync", "disk", "--deterministic")],
                         ids=["distributed", "disk-deterministic"])
def test_grpo_steps_run_end_to_end(tmp_path: Path, extra: tuple[str, ...]) -> None:
    r = run_demo(tmp_path, *extra)
    steps = r["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["weight_version"] for s in steps] == ["default", "step-1"]
    for s in steps:
        assert s["mismatch"] < 1e-4, s
        assert 0 <= s["reward"] <= 1 and s["rollout_tok_s"] > 0 and s["sync_s"] > 0
    assert r["plain_tok_s"] > 0
