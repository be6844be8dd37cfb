"""Real `kdaserve serve` processes on 127.0.0.1 for the server tests, and the in-process `LLM`
reference their greedy outputs are compared against.

A server is a subprocess (`python -m kdaserve.cli serve`) whose output goes to a file, so a
failed start-up reports it. Stopping one sends SIGTERM and asserts that the server and every
process it started (the engine, multiprocessing's resource tracker) are gone: no orphans.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.request import RequestOutput
from kdaserve.server.chat_template import ChatTemplate
from kdaserve.tokenizer import Tokenizer
from tests.model.conftest import MIN_MARGIN, routing_margin
from tests.ports import free_port

STARTUP_TIMEOUT_S = 90.0
EXIT_TIMEOUT_S = 30.0
REPO = Path(__file__).resolve().parents[2]


# ---- processes (via /proc: psutil is not installed) ----
def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may contain spaces
    return fields[0], int(fields[1])


def children(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[1] == pid:
            out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def is_gone(pid: int) -> bool:
    st = _stat(pid)
    return st is None or st[0] in ("Z", "X")  # a zombie has exited; reaping is its parent's job


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class ServerProc:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    api_key: str | None = None
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def engine_pid(self) -> int:
        """The engine process (multiprocessing spawn child; the other child is the tracker)."""
        pids = [p for p in children(self.pid) if "spawn_main" in cmdline(p)]
        assert len(pids) == 1, f"expected one engine child of {self.pid}, found {pids}"
        return pids[0]


def start_server(model: Path, log_dir: Path, *extra: str, api_key: str | None = None) -> ServerProc:
    """Starts `kdaserve serve` and waits for /health; fails with the server's output."""
    port = free_port()
    args = [sys.executable, "-m", "kdaserve.cli", "serve", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), *extra]
    if api_key is not None:
        args += ["--api-key", api_key]
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        # One intra-op thread unless told otherwise: test machines are small and shared, and an
        # OpenMP team that spins for a core another process holds turns a millisecond decode
        # step into seconds. Outputs do not depend on it (see `clear`).
        env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    server = ServerProc(proc, f"http://127.0.0.1:{port}", log_path, api_key, args)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during start-up:\n{server.output()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(server, check=False)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{server.output()}")


def stop_server(server: ServerProc, check: bool = True) -> None:
    """SIGTERM; with `check`, asserts a clean exit of the server and all its descendants."""
    tree = descendants(server.pid)
    if check:
        assert tree, "the server has no child processes (where is the engine?)"
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill([server.pid, *tree])
        server.proc.wait()
        if check:
            pytest.fail(f"server ignored SIGTERM for {EXIT_TIMEOUT_S:.0f}s:\n{server.output()}")
        return
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and not all(is_gone(p) for p in tree):
        time.sleep(0.1)
    left = [p for p in tree if not is_gone(p)]
    kill(left)
    if check:
        assert code == 0, f"server exited with {code}:\n{server.output()}"
        assert not left, f"orphans after shutdown: {[(p, cmdline(p)) for p in left]}"
        assert "shut down" in server.output()


@pytest.fixture(scope="session")
def server(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """The shared server: default settings, tiny checkpoint."""
    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("server-logs"))
    engine = s.engine_pid()
    yield s
    stop_server(s)
    assert is_gone(engine)


@pytest.fixture(scope="session")
def http(server: ServerProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


# ---- the reference ----
@pytest.fixture(scope="session")
def llm(tiny_ckpt: Path) -> LLM:
    return LLM(tiny_ckpt)


@pytest.fixture(scope="session")
def tok(tiny_ckpt: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_ckpt)


@pytest.fixture(scope="session")
def template(tiny_ckpt: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_ckpt)


def greedy(max_tokens: int, logprobs: int | None = None, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs, **kw)


def reference(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    return llm.generate(prompt_token_ids=prompts, sampling_params=params)


def clear(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[bool]:
    """For each prompt: True when its greedy decoding has no near-tie that batching could flip,
    neither a MoE router near-tie (see tests/model/conftest.py) nor two top tokens within 1e-4.

    The server batches, chunks and prefix-caches requests differently from the in-process
    reference, which changes fp32 rounding by ~1e-6; only prompts without near-ties make token
    identity a fair requirement (a few percent of random prompts are dropped)."""
    outs = reference(llm, prompts, greedy(max_tokens, logprobs=2))
    flags = []
    for ids, out in zip(prompts, outs, strict=True):
        o = out.outputs[0]
        assert o.logprobs is not None
        gaps = [a - b for a, b in (sorted(step.values(), reverse=True)[:2] for step in o.logprobs
                                   if len(step) > 1)]
        flags.append(min(gaps, default=1.0) > 1e-4
                     and routing_margin(llm, ids + o.token_ids) > MIN_MARGIN)
    return flags


def is_clear(llm: LLM, ids: list[int], max_tokens: int) -> bool:
    return clear(llm, [ids], max_tokens)[0]


def chat_ids(tok: Tokenizer, template: ChatTemplate, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt the server must build: the checkpoint's template, then the tokenizer."""
    return tok.encode(template.render(messages, tools=tools, add_generation_prompt=True))


# ---- /metrics ----
_SAMPLE = re.compile(r"^(kdaserve_[a-z_]+)(\{[^}]*\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every kdaserve sample."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if (m := _SAMPLE.match(line)) is not None:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metrics(client: httpx.Client) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)


def is_idle(m: dict[str, float]) -> bool:
    """Nothing runs or waits, and every block and state slot is free or held by the prefix
    cache alone (cached prefixes outlive their requests until evicted or flushed)."""
    return (m["kdaserve_num_running"] == 0 and m["kdaserve_num_waiting"] == 0
            and m["kdaserve_free_blocks"] + m.get("kdaserve_cached_blocks", 0)
            == m["kdaserve_total_blocks"]
            and m["kdaserve_free_state_slots"] + m.get("kdaserve_cached_snapshots", 0)
            == m["kdaserve_total_state_slots"])


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> dict[str, float]:
    """Polls /metrics until `is_idle` (or the timeout); returns the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(client)
        if is_idle(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


# ---- SSE ----
def sse_events(lines: Iterator[str]) -> list[dict[str, Any]]:
    """The JSON events of an SSE body; asserts it ends with `data: [DONE]` and nothing else."""
    events: list[dict[str, Any]] = []
    done = False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    assert done, "stream did not end with data: [DONE]"
    return events


# ---- shared by the test modules of the main server ----
NEW = 8  # generated tokens per request: small keeps the directory fast
IGNORE_EOS = {"ignore_eos": True}  # fixed output lengths, so usage counts are known exactly


@pytest.fixture(scope="session")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def model(http: httpx.Client) -> str:
    return str(http.get("/v1/models").json()["data"][0]["id"])


@pytest.fixture(scope="session")
def prompts(llm: LLM) -> list[list[int]]:
    """40 random token-id prompts of 1..40 tokens whose greedy continuation has no near-tie."""
    g = torch.Generator().manual_seed(1234)
    out: list[list[int]] = []
    for _ in range(5):
        if len(out) == 40:
            return out
        batch = [torch.randint(0, llm.config.vocab_size - 256, (1 + (len(out) + k) * 7 % 40,),
                               generator=g).tolist() for k in range(40 - len(out))]
        out += [ids for ids, ok in zip(batch, clear(llm, batch, NEW), strict=True) if ok]
    raise AssertionError("too few prompts without near-ties")


@pytest.fixture(scope="session")
def conversations(llm: LLM, tok: Tokenizer,
                  template: ChatTemplate) -> list[list[dict[str, Any]]]:
    """8 chats (one with a system prompt) whose rendered prompts have no near-tie."""
    chats: list[list[dict[str, Any]]] = []
    for i in range(16):
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
        if i % 5 == 1:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        chats.append(messages)
    ok = clear(llm, [chat_ids(tok, template, m) for m in chats], NEW)
    with_system = [m for m, k in zip(chats, ok, strict=True) if k and m[0]["role"] == "system"]
    plain = [m for m, k in zip(chats, ok, strict=True) if k and m[0]["role"] != "system"]
    assert with_system and len(plain) >= 7, "too few chats without near-ties"
    return [with_system[0], *plain[:7]]


def token_str(tok: Tokenizer, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False)


def post_generate(http: httpx.Client, body: dict[str, Any]) -> Any:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stop_router(proc: subprocess.Popen[bytes]) -> None:
    """sglang-router: SIGTERM, then SIGKILL after 15 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_router(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", *args, "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn",
           "--disable-retries"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"router exited:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200 and httpx.post(
                    f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {
                        "max_new_tokens": 1}}, timeout=30).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"router not ready:\n{log.read_text()}")
