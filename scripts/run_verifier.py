"""Runs the Kimi Vendor Verifier (../shared/kimi/vendor-verifier, third-party, run from a
writable copy) against `kdaserve serve` on two random-weight test checkpoints in turn (the real
Kimi tokenizer, the kimi-k3 sampling policy): one served with Moonshot's K3 Jinja template,
one a kimi_k3 checkpoint served by our K3 renderer; fails unless every test that does not need
a trained model passes on both. `make verify` runs it; CI runs it after `make test`.

The tests that need a trained model (a random model never chooses to call a tool, to stop, or to
write a given word) are listed in NEEDS_TRAINED_MODEL with the reason; they run and are counted,
and only their failures are tolerated.

    python scripts/run_verifier.py [--cases N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
KIMI = REPO.parent / "shared" / "kimi"
K3_TAGS = "<|open|>,<|sep|>,<|close|>,<|end_of_msg|>"

NEEDS_TRAINED_MODEL = {
    # the model must decide by itself to call a tool / to call the dynamic one of two
    "test_tool_choice_auto_may_call": "the model must choose to call a tool",
    "test_global_and_dynamic_tools_coexist": "the model must pick the dynamic tool of two",
    # the model must end its answer by itself (finish_reason "stop" on free text)
    "test_tool_choice_auto_may_not_call": "the model must end its answer (finish stop)",
    "test_tool_choice_none_forbids_call": "the model must end its answer (finish stop)",
    "test_tool_choice_without_tools_field_accepted": "the model must end its answer",
    "test_text_default": "the model must end its answer (finish stop)",
    "test_effort_stream_returns_reasoning_chunks": "the model must end its answer",
    # the model must write what the prompt asks for
    "test_json_object": "the JSON object must contain the key 'city' the prompt asks for",
    "test_effort_omitted_returns_reasoning": "the answer must name the effort ('max')",
    "test_reasoning_effort_ignored_when_effort_present": "the answer must name the effort",
    "test_reasoning_effort_effective_when_effort_absent": "the answer must name the effort",
    # 32k-token requests: beyond the test server's context (a random model fills it all,
    # past the client's 120 s timeout); a trained model stops long before
    "test_basic_enabled_returns_reasoning": "max_tokens 32768 beyond the test context",
    "test_default_type_is_enabled": "max_tokens 32768 beyond the test context",
}


def make_checkpoint(out: Path, kind: str) -> Path:
    """`template`: a Kimi Linear checkpoint served with Moonshot's K3 Jinja template (K3's
    tags added to the real tokenizer); `k3`: a kimi_k3 checkpoint (K3's special-id layout on
    the real tokenizer) and no template, so served by our K3 renderer (server/k3_render.py)."""
    from kdaserve.checkpoint import make_checkpoint as write

    if kind == "k3":
        return write(out, "k3-tiny", seed=0, tokenizer=KIMI / "tokenizer")
    return write(out, "tiny", seed=0, tokenizer=KIMI / "tokenizer",
                 extra_special_tokens=tuple(K3_TAGS.split(",")),
                 chat_template=KIMI / "templates" / "Kimi-K3.jinja")


def start_server(ckpt: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "kdaserve.cli", "serve", "--model", str(ckpt),
            "--port", str(port), "--served-model-name", "kimi-k3", "--api-key", "verifier",
            "--sampling-policy", "kimi-k3", "--default-max-tokens", "64",
            "--max-total-tokens", "16384"]
    proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited during start-up:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"server not healthy:\n{log.read_text()}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=40,
                        help="tool_call_json_schema cases (of 204; 0 = all), each in 2 modes")
    parser.add_argument("--keep", default=None, help="keep the work folder here")
    parser.add_argument("--checkpoint", default="template,k3",
                        help="which test checkpoints to serve, in turn (make_checkpoint)")
    args = parser.parse_args()
    if not (KIMI / "vendor-verifier").is_dir():  # a checkout without the shared folder
        print(f"SKIPPED: the Kimi Vendor Verifier is not at {KIMI / 'vendor-verifier'}")
        return
    work = Path(args.keep or tempfile.mkdtemp(prefix="kdaserve-verify-"))
    work.mkdir(parents=True, exist_ok=True)
    failed = [kind for kind in args.checkpoint.split(",")
              if not verify(work / kind, kind, args.cases)]
    if failed:
        sys.exit(f"the verifier failed on: {', '.join(failed)}")


def verify(work: Path, kind: str, cases: int) -> bool:
    """One server on the `kind` checkpoint, the suites against it; whether every failure is
    one a trained model is needed to avoid."""
    work.mkdir(parents=True, exist_ok=True)
    suite = work / "vendor-verifier"
    shutil.rmtree(suite, ignore_errors=True)
    shutil.copytree(KIMI / "vendor-verifier", suite)
    ckpt = make_checkpoint(work / "checkpoint", kind)
    port = 31000 + os.getpid() % 1000
    server = start_server(ckpt, port, work / "server.log")
    report = work / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/params", "tests/k3_features",
           "tests/tool_call_json_schema", "--base-url", f"http://127.0.0.1:{port}/v1",
           "--api-key", "verifier", "--smoke-model", "kimi-k3", "--think-mode", "opensource",
           "--max-tokens", "160", "-p", "no:cacheprovider", "-q", f"--junitxml={report}"]
    if cases:
        cmd += ["--max-cases", str(cases)]
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, cwd=suite, check=False)
    finally:
        server.terminate()
        server.wait(timeout=60)
    outcomes = {"passed": 0, "failed": 0, "skipped": 0}
    unexpected, tolerated = [], []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        if case.find("skipped") is not None:
            outcomes["skipped"] += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            outcomes["failed"] += 1
            base = name.split("[")[0]
            (tolerated if base in NEEDS_TRAINED_MODEL else unexpected).append(name)
        else:
            outcomes["passed"] += 1
    print(f"\nKimi Vendor Verifier ({kind} checkpoint) in {time.monotonic() - t0:.0f}s: "
          f"{outcomes['passed']} passed, {outcomes['failed']} failed ({len(tolerated)} need a "
          f"trained model), {outcomes['skipped']} skipped by the suite")
    for name in tolerated:
        print(f"  needs a trained model: {name}: {NEEDS_TRAINED_MODEL[name.split('[')[0]]}")
    if unexpected:
        print("FAILED (not explained by random weights):\n  " + "\n  ".join(unexpected))
        print(f"server log: {work / 'server.log'}")
    return not unexpected


if __name__ == "__main__":
    main()
