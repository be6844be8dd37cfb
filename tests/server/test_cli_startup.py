"""The command line and a server's start-up and end, as a client or an operator sees them:
`python -m kdaserve`, the served model name and its aliases, the start-up log (each phase, then
"ready at"), an engine process that ends with its HTTP process however that one dies, and
sglang-router's connection probes answered without a warning.

Process deaths are waited for as events under a generous bound (busy CI machines); the times
measured are printed (`pytest -s`), not asserted.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from kdaserve.client.engine_process import sweep_ipc_dirs
from kdaserve.server.header_timeout import H2_PREFACE, H2_REFUSAL
from kdaserve.server.launch import served_names
from tests.ports import free_port
from tests.server.conftest import (
    REPO,
    ServerProc,
    children,
    cmdline,
    is_gone,
    kill,
    start_server,
    stop_router,
    stop_server,
)

GONE_TIMEOUT_S = 30.0
PHASES = ("config", "kernels", "weights", "pools", "warm-up")


def wait_gone(pids: list[int], timeout: float = GONE_TIMEOUT_S) -> float:
    """Seconds until every pid has exited (polled); fails after `timeout`."""
    start = time.monotonic()
    while not all(is_gone(p) for p in pids):
        assert time.monotonic() - start < timeout, \
            f"still running {timeout:.0f} s on: {[(p, cmdline(p)) for p in pids if not is_gone(p)]}"
        time.sleep(0.01)
    return time.monotonic() - start


def port_is_free(port: int) -> bool:
    """Nothing listens, and a new server could bind it (as uvicorn does: SO_REUSEADDR)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        pass
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    return True


# ---- the command line ----
def test_python_m_kdaserve_is_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "kdaserve", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kdaserve ")
    assert all(cmd in out.stdout for cmd in ("serve", "generate", "make-checkpoint"))


def test_served_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare name by default (no '/', which openai-agents refuses), the old names aliases."""
    ckpt = tmp_path / "my-model"
    ckpt.mkdir()
    assert served_names(f"{ckpt}/", str(ckpt), None) == ("my-model", (f"{ckpt}/", str(ckpt)))
    assert served_names("tiny", "/cache/tiny-seed0", None) == ("tiny", ("/cache/tiny-seed0",))
    assert served_names(str(ckpt), str(ckpt), "k3") == ("k3", (str(ckpt),))
    snapshot = tmp_path / "models--moonshotai--Kimi-Linear-48B" / "snapshots" / "abc123"
    assert served_names(str(snapshot), str(snapshot), None)[0] == "Kimi-Linear-48B"
    monkeypatch.chdir(ckpt)  # `--model .`: the folder's name, not "."
    assert served_names(".", ".", None) == ("my-model", (".",))


# ---- a running server (the shared one: default settings, tiny checkpoint) ----
def test_default_name_and_old_path_alias(server: ServerProc, tiny_ckpt: Path) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        listed = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [tiny_ckpt.name]
        assert "/" not in tiny_ckpt.name and listed[0]["root"] == str(tiny_ckpt)
        for asked in (tiny_ckpt.name, str(tiny_ckpt)):  # the path: the default before
            r = http.post("/v1/completions", json={"model": asked, "prompt": "hi",
                                                   "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == tiny_ckpt.name
        r = http.post("/v1/chat/completions", json={
            "model": str(tiny_ckpt), "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == tiny_ckpt.name, r.text
        r = http.post("/v1/completions", json={"model": "other", "prompt": "hi",
                                               "max_tokens": 1})
        assert r.status_code == 404 and tiny_ckpt.name in r.text


def test_start_up_log(server: ServerProc) -> None:
    """Every phase's line in order, then the HTTP process's "ready at" naming the address it
    listens on."""
    log = server.output()
    lines = [line for line in log.splitlines() if "start-up" in line or "ready at" in line]
    positions: dict[str, int] = {}
    for phase in PHASES:
        found = [i for i, line in enumerate(lines)
                 if re.search(rf"\[kdaserve engine\] start-up {phase}: .+ \(\d+\.\d s\)$", line)]
        assert found, f"no {phase!r} line in:\n{log}"
        positions[phase] = found[0]
    assert list(positions.values()) == sorted(positions.values())  # in PHASES' order
    assert re.search(r"\[kdaserve\] start-up config: checkpoint .+ \(\d+\.\d s\)", log)
    ready = [i for i, line in enumerate(lines) if line.startswith("[kdaserve] ready at ")]
    assert len(ready) == 1 and ready[0] > max(positions.values()), log
    assert f"ready at {server.url} " in lines[ready[0]]


def test_weight_load_progress(tiny_ckpt: Path, caplog: pytest.LogCaptureFixture,
                              capfd: pytest.CaptureFixture[str]) -> None:
    """Without a terminal: log lines with the share read (here one per tensor: every=0);
    on one: a tqdm bar. Either way the load reports every byte of the checkpoint."""
    import torch

    from kdaserve.config import ModelConfig
    from kdaserve.engine.lifecycle import LoadProgress
    from kdaserve.kernels import resolve_kernels
    from kdaserve.models.loader import build_model, checkpoint_files, read_header

    cpu = torch.device("cpu")
    total = sum(f.stat().st_size - read_header(f)[1] for f in checkpoint_files(tiny_ckpt))
    calls: list[tuple[int, int]] = []
    lines = LoadProgress(every=0.0, bar=False)
    bar = LoadProgress(bar=True)

    def both(done: int, all_bytes: int) -> None:
        calls.append((done, all_bytes))
        lines(done, all_bytes)
        bar(done, all_bytes)

    with caplog.at_level(logging.INFO, logger="kdaserve"):
        build_model(ModelConfig.from_pretrained(tiny_ckpt), resolve_kernels(cpu),
                    torch.float32, cpu, tiny_ckpt, progress=both)
    assert calls[-1] == (total, total) and [d for d, _ in calls] == sorted(d for d, _ in calls)
    shares = [int(m.group(1)) for r in caplog.records
              if (m := re.match(r"start-up weights: (\d+)% \(", r.getMessage()))]
    assert len(shares) == lines.lines == len(calls) - 1 and shares == sorted(shares)
    assert bar.bar is not None and bar.bar.n == total
    bar.close()
    assert "[kdaserve] weights" in capfd.readouterr().err


def test_http2_prior_knowledge_refused_without_a_warning(server: ServerProc) -> None:
    """What sglang-router's gRPC probe sends (the HTTP/2 preface, then its frames) gets
    HTTP/2's "use HTTP/1.1" (GOAWAY, HTTP_1_1_REQUIRED) and a closed connection, and the
    server logs nothing; plain HTTP/1.1 on the next connection is served."""
    before = len(server.output())
    settings = bytes.fromhex("000000040000000000")
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])),
                                  timeout=10) as s:
        s.sendall(H2_PREFACE[:5])  # split like a slow network: still recognised
        s.sendall(H2_PREFACE[5:] + settings)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert got == H2_REFUSAL
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert "Invalid HTTP request" not in server.output()[before:]


def test_router_probes_leave_no_warning(server: ServerProc, tmp_path: Path) -> None:
    """sglang-router in front of the server: its worker registration (HTTP and gRPC health
    probes side by side) and a few periodic health checks log nothing on the server."""
    pytest.importorskip("sglang_router")
    before = len(server.output())
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", server.url,
             "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
             str(metrics_port), "--health-check-interval-secs", "1", "--log-level", "warn"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        checks = 0.0
        while checks < 3:  # the router counts its health checks: wait for three
            assert router.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no health checks:\n{log.read_text()}"
            time.sleep(0.3)
            try:
                text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).text
            except httpx.TransportError:
                continue
            checks = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("smg_worker_health_checks_total"))
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60, json={
            "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text  # the router took the worker for HTTP
    finally:
        stop_router(router)
    assert "Invalid HTTP request" not in server.output()[before:]


# ---- the engine ends with its HTTP process ----
CHILD = """
import os, re, time
from kdaserve.engine.lifecycle import exit_with_parent
exit_with_parent(os.getppid(), {pdeathsig})
print(os.getpid(), flush=True)
{block}
"""
PARENT = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]])"


@pytest.mark.parametrize(("pdeathsig", "block", "state"), [
    # a C call that holds the GIL (a backtracking regex): no Python code of the child runs,
    # the kernel's signal ends it anyway
    (True, "re.match(r'(a|aa)+$', 'a' * 64 + 'b')", "R"),
    (False, "time.sleep(600)", "S"),  # the fallback where prctl is missing: polling
], ids=["pdeathsig-while-holding-the-gil", "polling-fallback"])
def test_exit_with_parent(pdeathsig: bool, block: str, state: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD.format(pdeathsig=pdeathsig, block=block)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while (st := Path(f"/proc/{child}/stat").read_text()).split(") ")[1][0] != state:
            assert time.monotonic() < deadline, st  # until it runs (or sleeps in) `block`
            time.sleep(0.01)
        parent.send_signal(signal.SIGKILL)
        took = wait_gone([child])
        print(f"child gone {took:.3f} s after its parent's SIGKILL (pdeathsig={pdeathsig})")
    finally:
        parent.kill()
        parent.wait()
        if child:
            kill([child])


def spawn_main_child(pid: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while not (found := [c for c in children(pid) if "spawn_main" in cmdline(c)]):
        assert time.monotonic() < deadline, "no engine process started"
        time.sleep(0.02)
    return found[0]


def test_sigkill_during_start_up_ends_the_engine(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Killed as soon as the engine process exists (it is starting: importing, or loading
    the model), the HTTP process takes the engine with it, and the next server removes the
    IPC folder it left."""
    port = free_port()
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kdaserve", "serve", "--model",
                                 str(tiny_ckpt), "--port", str(port)], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT)
    tree: list[int] = []
    try:
        engine = spawn_main_child(proc.pid)
        tree = children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        took = wait_gone(tree)
        print(f"engine gone {took:.3f} s after SIGKILL during start-up")
        proc.wait(timeout=GONE_TIMEOUT_S)
        assert is_gone(engine) and port_is_free(port)
    finally:
        kill([proc.pid, *tree])
    tmp = Path(tempfile.gettempdir())
    left = list(tmp.glob(f"kdaserve-{proc.pid}-*"))  # its SIGKILL left it: the next server's
    assert left and set(left) <= set(sweep_ipc_dirs(tmp))
    assert not any(d.exists() for d in left)


def test_sigkill_mid_stream_ends_the_engine(tiny_ckpt: Path, tmp_path: Path) -> None:
    s = start_server(tiny_ckpt, tmp_path)
    engine = s.engine_pid()
    tree = children(s.pid)
    port = int(s.url.rsplit(":", 1)[1])
    try:
        with httpx.Client(base_url=s.url, timeout=60) as http, http.stream(
                "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 100_000,
                                                 "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # streaming
            s.proc.send_signal(signal.SIGKILL)
            took = wait_gone([engine])
            print(f"engine gone {took:.3f} s after SIGKILL mid-stream")
            with pytest.raises(httpx.HTTPError):  # the stream breaks off, unfinished
                for line in lines:
                    assert "[DONE]" not in line
        wait_gone(tree)
        s.proc.wait(timeout=GONE_TIMEOUT_S)
        assert port_is_free(port)
    finally:
        stop_server(s, check=False)
        kill(tree)
    sweep_ipc_dirs(Path(tempfile.gettempdir()))  # what the killed server left
