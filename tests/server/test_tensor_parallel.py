"""Tensor parallelism in the server: `kdaserve serve --tp-size 2` (two ranks joined by gloo,
rank 0 the engine, rank 1 a follower), on one node and on two "nodes" on loopback; greedy
outputs equal the single-process reference through chunked prefill, preemption and prefix
hits; a rank that dies takes the server down cleanly (503s, exit 1, no orphans)."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kdaserve import LLM
from tests.server.conftest import (
    REPO,
    ServerProc,
    children,
    clear,
    cmdline,
    descendants,
    free_port,
    greedy,
    is_gone,
    kill,
    metrics,
    reference,
    start_server,
    stop_server,
    wait_idle,
)

NEW = 8
# 16 requests of up to 40 + 8 tokens do not fit in 128 tokens of KV at once: preemption
# (at 256, with arrivals trickling in one by one, a CI run preempted nothing)
TP_ARGS = ("--tp-size", "2", "--max-num-batched-tokens", "32", "--max-total-tokens", "128")


def generate_all(url: str, prompts: list[list[int]], new: int = NEW) -> list[dict]:
    def one(ids: list[int]) -> dict:
        r = httpx.post(f"{url}/generate", timeout=120, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0,
                                                  "ignore_eos": True}})
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, prompts))


def check_outputs(server: ServerProc, llm: LLM, prompts: list[list[int]]) -> None:
    want = [o.token_ids for o in reference(llm, prompts, greedy(NEW))]
    first = generate_all(server.url, prompts)
    assert [r["output_ids"] for r in first] == want
    again = generate_all(server.url, prompts)  # partly from the prefix cache
    assert [r["output_ids"] for r in again] == want
    # a wave may evict what it caches from a 128-token pool; one request alone, repeated,
    # surely hits
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    for _ in range(2):
        alone = generate_all(server.url, [prompts[longest]])[0]
        assert alone["output_ids"] == want[longest]
    assert alone["meta_info"]["cached_tokens"] > 0
    with httpx.Client(base_url=server.url) as c:
        wait_idle(c)
        assert c.get("/check_integrity").status_code == 200


@pytest.fixture(scope="module")
def tp_server(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("tp-logs"), *TP_ARGS)
    yield s
    stop_server(s)


def test_two_ranks_equal_reference(tp_server: ServerProc, llm: LLM,
                                   prompts: list[list[int]]) -> None:
    batch = prompts[:16]
    check_outputs(tp_server, llm, batch)
    want = [o.token_ids for o in reference(llm, batch, greedy(NEW))]
    with httpx.Client(base_url=tp_server.url, timeout=60) as c:
        before = metrics(c)["kdaserve_num_preemptions"]
        # all 16 queued while paused, then released at once, so the pool must preempt
        # whatever the machine's load (trickling arrivals could each finish alone)
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(generate_all, tp_server.url, batch)
            deadline = time.monotonic() + 60
            while metrics(c)["kdaserve_num_waiting"] < len(batch):
                assert time.monotonic() < deadline and not future.done()
                time.sleep(0.05)
            assert c.post("/continue_generation", json={}).status_code == 200
            assert [r["output_ids"] for r in future.result()] == want
        assert metrics(c)["kdaserve_num_preemptions"] > before
        wait_idle(c)
        assert c.get("/check_integrity").status_code == 200
    assert "tensor parallel over 2 ranks" in tp_server.output()


def test_two_nodes_on_loopback(tiny_ckpt: Path, tmp_path: Path, llm: LLM,
                               prompts: list[list[int]]) -> None:
    """Rank 1 on "node 1" (a process that serves no HTTP) joins rank 0's server through
    --dist-init-addr; stopping node 0 ends node 1 too."""
    addr = f"127.0.0.1:{free_port()}"
    multi = ("--nnodes", "2", "--dist-init-addr", addr)
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "kdaserve.cli", "serve", "--model", str(tiny_ckpt),
             *TP_ARGS, *multi, "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT,
            cwd=REPO)
    try:
        node0 = start_server(tiny_ckpt, tmp_path, *TP_ARGS, *multi, "--node-rank", "0")
        try:
            check_outputs(node0, llm, prompts[16:24])
        finally:
            stop_server(node0)
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.send_signal(signal.SIGKILL)
            node1.wait()


def test_rank_death_takes_the_server_down(tiny_ckpt: Path, tmp_path: Path) -> None:
    s = start_server(tiny_ckpt, tmp_path, "--tp-size", "2")
    engine = s.engine_pid()
    followers = [p for p in children(engine) if "spawn_main" in cmdline(p)]
    assert len(followers) == 1
    tree = descendants(s.pid)
    kill(followers)
    r = httpx.post(f"{s.url}/generate", timeout=60, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503
    assert s.proc.wait(timeout=30) == 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(is_gone(p) for p in tree):
        time.sleep(0.1)
    assert all(is_gone(p) for p in tree), "orphans after a rank died"
    assert "a parallel rank is gone" in s.output()


@pytest.mark.parametrize("parallel", [("--tp-size", "2"),
                                      ("--dp-size", "2", "--enable-dp-attention", "--ep-size",
                                       "2")], ids=["tp2", "dp_attention"])
def test_speculative_decoding_per_rank(tiny_ckpt: Path, tmp_path: Path, llm: LLM,
                                       parallel: tuple[str, ...]) -> None:
    """n-gram speculation on repetitive prompts: drafts verified in one forward on every
    rank, and the rejected ones rolled back on every rank (the followers restore their
    heads' states and replay from their own record): the reference's tokens."""
    import random

    rng = random.Random(3)
    base = [rng.randrange(300, 3000) for _ in range(12)]
    batch = [base * 4 + [rng.randrange(300, 3000) for _ in range(5)] for _ in range(6)]
    batch = [p for p, ok in zip(batch, clear(llm, batch, 24), strict=True) if ok]
    assert len(batch) >= 3
    s = start_server(tiny_ckpt, tmp_path, *parallel, "--speculative-algorithm", "ngram",
                     "--speculative-num-draft-tokens", "4")
    try:
        want = [o.token_ids for o in reference(llm, batch, greedy(24))]
        assert [r["output_ids"] for r in generate_all(s.url, batch, 24)] == want
        with httpx.Client(base_url=s.url) as c:
            assert metrics(c)["kdaserve_spec_num_verifies"] > 0
            wait_idle(c)
            assert c.get("/check_integrity").status_code == 200
    finally:
        stop_server(s)
