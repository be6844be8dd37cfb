"""Hostile or careless clients against a real server: body size and read-time limits, JSON-only
bodies, POST-only mutations, a full queue (429), the request timeout (504), deep JSON, the
context-length cap, tokenization off the event loop, and shutdown that drains then exits."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import ServerProc, is_idle, metrics, start_server, stop_server, wait_idle

USER = [{"role": "user", "content": "hi"}]
LONG = {"prompt": "go", "max_tokens": 90000, "ignore_eos": True}
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def limited(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("limited-logs"),
                     "--max-request-body-bytes", str(BODY_LIMIT), "--body-read-timeout", "1",
                     "--max-queued-requests", "2", "--request-timeout", "4",
                     "--header-read-timeout", "1",
                     "--context-length", "100000")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def h(limited: ServerProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited.url, timeout=60) as client:
        yield client


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status
    return str(err["message"])


def test_mutations_are_post_and_bodies_json(http: httpx.Client) -> None:
    assert error_of(http.get("/flush_cache"), 405)
    assert http.post("/flush_cache").status_code in (200, 400)  # scripts: no body, no Origin
    r = http.post("/flush_cache", headers={"Origin": "https://evil.example"})
    assert error_of(r, 415)  # a web page's bodiless cross-site POST
    own = str(http.base_url).rstrip("/")  # this server's own pages (e.g. /docs) may
    assert http.post("/flush_cache", headers={"Origin": own}).status_code in (200, 400)
    # no CORS: a browser's preflight gets no Access-Control-Allow-Origin, so it sends nothing
    pre = http.options("/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in pre.headers and pre.status_code == 405
    for kind in ("text/plain", "application/x-www-form-urlencoded", ""):
        r = http.post("/v1/chat/completions", content=json.dumps({"messages": USER}),
                      headers={"Content-Type": kind} if kind else {})
        assert "JSON" in error_of(r, 415)
    r = http.post("/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 1}),
                  headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_body_size_limit(h: httpx.Client) -> None:
    big = {"prompt": "a " * BODY_LIMIT, "max_tokens": 1}
    assert "limit" in error_of(h.post("/v1/completions", json=big), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        body = json.dumps(big).encode()
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    r = h.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert "limit" in error_of(r, 413)
    assert h.get("/health").status_code == 200


def test_slow_body_times_out(limited: ServerProc) -> None:
    host, port = limited.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        answer = sock.recv(4096).decode()  # the rest never comes
    assert answer.startswith("HTTP/1.1 408"), answer


def test_slow_headers_are_cut_off(limited: ServerProc, h: httpx.Client) -> None:
    host, port = limited.url.removeprefix("http://").split(":")
    # the socket's own timeout (60 s against the server's 1 s) is the only clock: recv raises
    # if the server never closes
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert sock.recv(4096) == b""  # closed by the server
    with socket.create_connection((host, int(port)), timeout=60) as idle:
        assert idle.recv(4096) == b""  # connected, sent nothing: closed too
    assert h.get("/health").status_code == 200  # complete requests are unaffected


def test_trickled_body_times_out_as_a_whole(limited: ServerProc) -> None:
    host, port = limited.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n")
        answer, sent = b"", 0
        for byte in body:  # each byte well within the timeout, the whole body not
            try:
                sock.sendall(bytes([byte]))
                sent += 1
            except OSError:
                break
            time.sleep(0.3)
            sock.setblocking(False)
            try:
                answer += sock.recv(4096)
            except BlockingIOError:
                pass
            sock.setblocking(True)
            if answer:
                break
        assert answer.startswith(b"HTTP/1.1 408"), answer
        # cut off while bytes were still coming (sending them all takes 0.3 s x len(body))
        assert sent < len(body), sent


def test_pipelined_partial_request_is_cut_off(limited: ServerProc) -> None:
    host, port = limited.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:  # recv raises if
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /he")  # never closed
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200")


def test_queue_full_is_429_then_recovers(h: httpx.Client) -> None:
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(h.post, "/v1/completions", json=LONG) for _ in range(2)]
        deadline = time.monotonic() + 120
        while metrics(h)["kdaserve_num_running"] < 2:
            assert time.monotonic() < deadline, "the long requests never started"
            time.sleep(0.05)
        r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert "--max-queued-requests" in error_of(r, 429) and r.headers["Retry-After"] == "1"
        # the two long ones end at the request timeout (504), and the queue frees up
        for f in running:
            assert "timed out" in error_of(f.result(timeout=30), 504)
    assert is_idle(wait_idle(h))
    assert h.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_the_queue_counts_sequences(h: httpx.Client) -> None:
    r = h.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
    assert r.status_code == 200, r.text  # two sequences fit the limit of 2 on an idle server
    r = h.post("/v1/completions", json={"prompt": "a", "n": 3, "max_tokens": 1})
    assert "--max-queued-requests" in error_of(r, 400)  # never could fit


def test_request_timeout_ends_streams_too(h: httpx.Client) -> None:
    with h.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        last = [ln for ln in r.iter_lines() if ln.startswith("data: ")][-1]
    assert '"code": 504' in last
    assert is_idle(wait_idle(h))


def test_deep_json_and_reserved_template_kwargs_are_400(h: httpx.Client) -> None:
    deep = "[" * 5000 + "]" * 5000
    body = '{"messages": [{"role": "user", "content": "hi"}], "tools": ' + deep + "}"
    r = h.post("/v1/chat/completions", content=body,
               headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    for key in ("tools", "add_generation_prompt", "messages"):
        r = h.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1,
                                                 "chat_template_kwargs": {key: 1}})
        assert key in error_of(r, 400)


def test_context_length_caps_one_request(limited: ServerProc, h: httpx.Client) -> None:
    assert h.get("/v1/models").json()["data"][0]["max_model_len"] == 100000
    r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 100001})
    assert "context" in error_of(r, 400)


def test_tokenization_does_not_block_health(http: httpx.Client) -> None:
    """A multi-megabyte prompt is tokenized on a worker thread: /health answers meanwhile, many
    times over (a blocked event loop would answer the first probe only once it is done)."""
    big = {"prompt": "word " * 1_000_000, "max_tokens": 1}  # 5 MB: too long, a 400 at the end
    done = threading.Event()
    answered = 0

    def post() -> httpx.Response:
        try:
            return http.post("/v1/completions", json=big)
        finally:
            done.set()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(post)
        with httpx.Client(base_url=str(http.base_url), timeout=30) as probe:
            while not done.is_set():
                assert probe.get("/health").status_code == 200
                answered += not done.is_set()
        assert result.result().status_code == 400
    assert answered >= 5, answered


def test_sigterm_drains_then_exits_and_a_second_signal_exits_at_once(
        tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """SIGTERM (to the server alone, or to the whole group as systemd sends it): running
    requests get the grace period, then a 503 (whole) or a 503 error event (streamed), never a
    bare 500 or a restarted engine; a second signal exits at once."""
    import os

    # One signal: 2 s of grace, then both requests end with a 503 (which 90,000 tokens would
    # not do by themselves). Two: a grace period of 10 minutes, which the process must not wait
    # out. Neither needs a clock: each waits on the process's exit, with outer timeouts.
    for signals, group, grace in ((1, False, 2), (1, True, 2), (2, False, 600)):
        s = start_server(tiny_ckpt, tmp_path_factory.mktemp("drain-logs"),
                         "--graceful-shutdown-timeout", str(grace))
        engine = s.engine_pid()
        with httpx.Client(base_url=s.url, timeout=300) as client, \
                concurrent.futures.ThreadPoolExecutor(1) as pool, \
                client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            whole = pool.submit(client.post, "/v1/completions", json=LONG)
            lines = r.iter_lines()
            next(lines)  # streaming
            while metrics(client)["kdaserve_num_running"] < 2:
                time.sleep(0.05)
            for _ in range(signals):
                s.proc.send_signal(signal.SIGTERM)
                if group:
                    os.kill(engine, signal.SIGTERM)
                time.sleep(0.2)
            rest = list(lines)
            code = s.proc.wait(timeout=grace / 2 if signals == 2 else 300)
            if signals == 1:
                assert "shutting down" in error_of(whole.result(timeout=60), 503)
                assert '"code": 503' in [ln for ln in rest if ln.startswith("data: ")][-1]
        assert code == 0, (signals, group)
        assert "restarting" not in s.output()
        stop_server(s, check=False)


def test_signal_during_start_up_stops_cleanly(tiny_ckpt: Path, tmp_path: Path) -> None:
    import subprocess
    import sys
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("kdaserve-*"))
    from .conftest import children, cmdline

    proc = subprocess.Popen([sys.executable, "-m", "kdaserve.cli", "serve", "--model",
                             str(tiny_ckpt), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not any("spawn_main" in cmdline(c) for c in children(proc.pid)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the engine process is starting
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()
    assert b"stopped during start-up" in out
    deadline = time.monotonic() + 60
    while set(Path(tempfile.gettempdir()).glob("kdaserve-*")) - before:
        assert time.monotonic() < deadline, "temp folder left"
        time.sleep(0.1)


def test_watchdog_reports_a_stuck_engine(tiny_ckpt: Path,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """An engine alive but making no progress (here: stopped with SIGSTOP) while a request
    waits turns /health to 503; once it moves again, /health is 200 and the request ends."""
    import os

    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("stuck-logs"),
                     "--watchdog-timeout", "2")
    try:
        with httpx.Client(base_url=s.url, timeout=60) as client, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            engine = s.engine_pid()
            os.kill(engine, signal.SIGSTOP)
            try:
                pending = pool.submit(client.post, "/v1/completions",
                                      json={"prompt": "x", "max_tokens": 4})
                deadline = time.monotonic() + 20
                while (r := client.get("/health")).status_code == 200:
                    assert time.monotonic() < deadline, "a stuck engine looked healthy"
                    time.sleep(0.2)
                assert "stuck" in error_of(r, 503)
            finally:
                os.kill(engine, signal.SIGCONT)
            assert pending.result(timeout=30).status_code == 200
            deadline = time.monotonic() + 60
            while client.get("/health").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        stop_server(s)
