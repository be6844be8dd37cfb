"""Prefill/decode disaggregation with real processes on loopback: the unmodified sglang-router
(`--pd-disaggregation`) in front of a `--disaggregation-mode prefill` and a `decode` kdaserve
server, the caches shipped by Mooncake's transfer engine (TCP).

Outputs through the router must equal the in-process reference (and the unified server);
every fault (a decode server that dies, a prefill server that dies, a mismatched peer, a
request no peer ever pairs) must fail the request with an error and leave both servers'
pools whole. The fault tests play the router themselves (the same request with the same
bootstrap fields to both servers), which lets them kill a server at a chosen moment.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kdaserve import LLM
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import ModelConfig
from tests.server.conftest import (
    ServerProc,
    clear,
    descendants,
    free_port,
    greedy,
    kill,
    reference,
    sse_events,
    start_router,
    start_server,
    stop_router,
    stop_server,
    wait_idle,
)

NEW = 8
LIVENESS_S = 3.0
TIMEOUT_S = 8.0
PD_ARGS = ("--max-num-batched-tokens", "32", "--disaggregation-liveness-s", str(LIVENESS_S),
           "--disaggregation-timeout-s", str(TIMEOUT_S))


@dataclass
class Cluster:
    prefill: ServerProc
    decode: ServerProc
    bootstrap_port: int
    router: subprocess.Popen[bytes]
    url: str
    log: Path


def start_prefill(ckpt: Path, logs: Path, *extra: str) -> tuple[ServerProc, int]:
    port = free_port()
    return start_server(ckpt, logs, "--disaggregation-mode", "prefill",
                        "--disaggregation-bootstrap-port", str(port), *PD_ARGS, *extra), port


def start_decode(ckpt: Path, logs: Path, *extra: str) -> ServerProc:
    return start_server(ckpt, logs, "--disaggregation-mode", "decode", *PD_ARGS, *extra)


@pytest.fixture(scope="module")
def cluster(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("pd-logs")
    prefill, bport = start_prefill(tiny_ckpt, logs)
    decode = start_decode(tiny_ckpt, logs)
    log = logs / "router.log"
    router, url = start_router(["--pd-disaggregation", "--prefill", prefill.url, str(bport),
                                "--decode", decode.url], log)
    yield Cluster(prefill, decode, bport, router, url, log)
    stop_router(router)
    stop_server(decode)
    stop_server(prefill)


def assert_whole(*servers: ServerProc) -> None:
    """Every block and slot free (or cached) again, and the pools' invariants hold."""
    for s in servers:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            m = wait_idle(c, timeout=60)  # generous: what freed it is checked by the tests
            assert m["kdaserve_free_state_slots"] + m.get("kdaserve_cached_snapshots", 0) \
                == m["kdaserve_total_state_slots"], f"{s.url}: state slots leaked"
            assert m["kdaserve_free_blocks"] + m.get("kdaserve_cached_blocks", 0) \
                == m["kdaserve_total_blocks"], f"{s.url}: blocks leaked"
            r = c.get("/check_integrity")
            assert r.status_code == 200, r.text


def generate(url: str, ids: list[int], max_new: int = NEW, **kw: Any) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                  "ignore_eos": True, **kw.pop("sp", {})}, **kw}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


@pytest.fixture(scope="module")
def long_prompts(llm: LLM) -> list[list[int]]:
    """Prompts of several prefill chunks (32 tokens each), without near-ties."""
    g = torch.Generator().manual_seed(77)
    cands = [torch.randint(0, llm.config.vocab_size - 256, (n,), generator=g).tolist()
             for n in (97, 150, 230, 64, 333, 181)]
    return [p for p, ok in zip(cands, clear(llm, cands, NEW), strict=True) if ok][:4]


# ---- outputs through the router ----
def test_generate_matches_reference_concurrently(cluster: Cluster, llm: LLM,
                                                 prompts: list[list[int]],
                                                 long_prompts: list[list[int]]) -> None:
    """Short and multi-chunk prompts, 8 at a time: greedy tokens equal a plain forward."""
    batch = prompts[:16] + long_prompts
    want = [o.token_ids for o in reference(llm, batch, greedy(NEW))]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda ids: generate(cluster.url, ids), batch))
    for r, w in zip(got, want, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == w
    assert_whole(cluster.prefill, cluster.decode)


def test_prefix_cache_hit_on_prefill(cluster: Cluster, llm: LLM,
                                     long_prompts: list[list[int]]) -> None:
    """The second request of a shared long prefix resumes from the prefill server's cache
    (reported by the decode server as cached tokens) and still gives the same tokens."""
    ids = long_prompts[-1]
    want = reference(llm, [ids], greedy(NEW))[0].token_ids
    first = generate(cluster.url, ids).json()
    second = generate(cluster.url, ids).json()
    assert first["output_ids"] == second["output_ids"] == want
    assert second["meta_info"]["cached_tokens"] >= 32
    assert_whole(cluster.prefill, cluster.decode)


def test_stream_and_logprobs(cluster: Cluster, llm: LLM, prompts: list[list[int]]) -> None:
    ids = prompts[20]
    ref = reference(llm, [ids], greedy(NEW, logprobs=1, prompt_logprobs=1,
                                       logprob_start_len=0))[0]
    r = generate(cluster.url, ids, return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    meta = r.json()["meta_info"]
    out = [lp for lp, _, _ in meta["output_token_logprobs"]]
    want = [step[t] for step, t in zip(ref.outputs[0].logprobs or [], ref.token_ids,
                                       strict=True)]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ref.token_ids
    assert out == pytest.approx(want, abs=1e-4)  # the first one computed by the prefill server
    # the router prepends the prefill server's input logprobs to the decode server's (none)
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids
    with httpx.stream("POST", f"{cluster.url}/generate", timeout=60, json={
            "input_ids": ids, "stream": True, "sampling_params": {
                "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}) as s:
        events = sse_events(s.iter_lines())
    assert events[-1]["output_ids"] == ref.token_ids or \
        [t for e in events for t in e["output_ids"]] == ref.token_ids


def test_chat_and_completions_match_unified(cluster: Cluster, server: ServerProc, model: str,
                                            conversations: list[list[dict[str, Any]]]) -> None:
    """Chat (streamed and not) and completions through the router equal the unified server."""
    for messages in conversations[:3]:
        body = {"model": model, "messages": messages, "max_tokens": NEW, "temperature": 0}
        want = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        got = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=60).json()
        assert got["choices"][0]["message"]["content"] == \
            want["choices"][0]["message"]["content"]
        with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", timeout=60,
                          json={**body, "stream": True}) as s:
            events = sse_events(s.iter_lines())
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e["choices"])
        assert text == want["choices"][0]["message"]["content"]
    body = {"model": model, "prompt": "The capital of", "max_tokens": NEW, "temperature": 0}
    want = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    got = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=60).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=60,
                      json={**body, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == \
        want["choices"][0]["text"]
    assert_whole(cluster.prefill, cluster.decode)


def test_seeded_sampling_matches_reference(cluster: Cluster, llm: LLM,
                                           prompts: list[list[int]]) -> None:
    """The first token is sampled on the prefill server: its generator's state travels with
    the caches, so a seeded request draws the same noise as in one process."""
    from kdaserve import SamplingParams

    ids = prompts[5]
    want = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=1.0, max_tokens=NEW, ignore_eos=True, seed=1234))[0].token_ids
    r = generate(cluster.url, ids, sp={"temperature": 1.0, "sampling_seed": 1234})
    assert r.json()["output_ids"] == want


def test_transfer_metrics(cluster: Cluster, tiny_ckpt: Path) -> None:
    """The prefill server counts what it shipped: the KDA state bytes are exactly one slot
    per request, and multi-chunk prompts were written chunk by chunk. The decode server
    never ran a forward over a prompt."""
    m = httpx.get(f"{cluster.prefill.url}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in m.splitlines()
              if line.startswith("kdaserve_pd_")}
    n = values["kdaserve_pd_transfers"]
    assert n >= 20
    slot = StatePool.bytes_per_slot(ModelConfig.from_pretrained(tiny_ckpt), torch.float32)
    assert values["kdaserve_pd_state_bytes"] == n * slot
    assert values["kdaserve_pd_kv_bytes"] > 0
    assert values["kdaserve_pd_writes"] > n  # the long prompts streamed blocks per chunk
    decode = httpx.get(f"{cluster.decode.url}/get_server_info").json()["internal_states"][0]
    assert decode["prompt_tokens"] == 0 and decode["pd_transfers"] == n


# ---- faults (the test plays the router) ----
def pd_pair(prefill: ServerProc, decode: ServerProc, bport: int, body: dict[str, Any],
            path: str = "/generate", prefill_after: float = 0.0,
            ) -> tuple[concurrent.futures.Future, concurrent.futures.Future]:
    """Both halves of a request, posted at once (or the prefill half `prefill_after`
    seconds after the decode half)."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
            "bootstrap_room": int.from_bytes(os.urandom(7), "big")}
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def post(s: ServerProc) -> httpx.Response:
        return httpx.post(f"{s.url}{path}", json=body, timeout=60)

    d = pool.submit(post, decode)
    if prefill_after:
        time.sleep(prefill_after)
    return pool.submit(post, prefill), d


def test_mismatched_decode_is_refused(cluster: Cluster, tiny_ckpt: Path,
                                      tmp_path: Path) -> None:
    """A decode server whose pools differ (block size 32 against 16) is refused before any
    byte moves: both halves fail with the reason; both pools stay whole. Twice: the halves
    sent together, then the decode half first, so that its reservation waits on the prefill
    server and the refusal happens as the prefill request arrives, between steps (that
    error once went unreported and the request hung)."""
    bad = start_decode(tiny_ckpt, tmp_path, "--block-size", "32", "--snapshot-interval", "64")
    try:
        for decode_first in (False, True):
            p, d = pd_pair(cluster.prefill, bad, cluster.bootstrap_port,
                           {"input_ids": list(range(1, 40)), "sampling_params": {
                               "max_new_tokens": 4}}, prefill_after=3.0 if decode_first else 0)
            rp, rd = p.result(), d.result()
            assert rp.status_code == 500 and "block size mismatch" in rp.text, rp.text
            assert rd.status_code == 500 and "block size mismatch" in rd.text, rd.text
            assert_whole(cluster.prefill, bad)
    finally:
        stop_server(bad)


def test_decode_dies_before_transfer(cluster: Cluster, tiny_ckpt: Path, tmp_path: Path) -> None:
    """The decode server reserves memory, then dies: the prefill server's write fails, its
    request gets an error, and its pools are whole."""
    doomed = start_decode(tiny_ckpt, tmp_path)
    room = int.from_bytes(os.urandom(7), "big")
    body = {"input_ids": list(range(5, 200)), "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap_port,
            "bootstrap_room": room}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pending = pool.submit(httpx.post, f"{doomed.url}/generate", json=body, timeout=60)
    deadline = time.monotonic() + 20
    with httpx.Client(base_url=doomed.url) as c:  # until its reservation is out
        while time.monotonic() < deadline:
            m = c.get("/get_server_info").json()["internal_states"][0]
            if m["free_state_slots"] < m["total_state_slots"]:
                break
            time.sleep(0.05)
    kill([doomed.pid, *descendants(doomed.pid)])
    doomed.proc.wait()
    with pytest.raises(httpx.TransportError):
        pending.result()
    r = httpx.post(f"{cluster.prefill.url}/generate", json=body, timeout=60)
    assert r.status_code == 500 and "transfer" in r.text, r.text
    assert_whole(cluster.prefill)


def test_prefill_dies_decode_frees(cluster: Cluster, tiny_ckpt: Path, tmp_path: Path) -> None:
    """The prefill server dies holding the decode server's reservation (its half of the
    request not arrived yet): the decode server's pings go unanswered, it fails the request
    within the liveness window and frees the reservation."""
    doomed, bport = start_prefill(tiny_ckpt, tmp_path)
    body = {"input_ids": [3] * 50, "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": 99}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    d = pool.submit(httpx.post, f"{cluster.decode.url}/generate", json=body, timeout=60)
    time.sleep(1.0)
    kill([doomed.pid, *descendants(doomed.pid)])
    doomed.proc.wait()
    rd = d.result()
    # the liveness check's words, not the transfer timeout's ("... within 8 s")
    assert rd.status_code == 500 and "did not answer" in rd.text, rd.text
    assert_whole(cluster.decode)


def test_unpaired_request_times_out(cluster: Cluster) -> None:
    """A prefill request no decode server ever reserves memory for fails after the timeout;
    a decode request whose prefill half never comes does too."""
    body = {"input_ids": [7] * 20, "sampling_params": {"max_new_tokens": 2},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap_port}
    pool = concurrent.futures.ThreadPoolExecutor(2)
    rp = pool.submit(httpx.post, f"{cluster.prefill.url}/generate",
                     json={**body, "bootstrap_room": 11}, timeout=60)
    rd = pool.submit(httpx.post, f"{cluster.decode.url}/generate",
                     json={**body, "bootstrap_room": 12}, timeout=60)
    assert rp.result().status_code == 500 and "no decode server" in rp.result().text
    assert rd.result().status_code == 500 and "within" in rd.result().text
    assert_whole(cluster.prefill, cluster.decode)


def test_unified_and_disaggregated_requests_refused_where_wrong(
        cluster: Cluster, server: ServerProc) -> None:
    """A unified server refuses bootstrap fields; a PD server requires them."""
    r = httpx.post(f"{server.url}/generate", json={
        "input_ids": [1, 2], "bootstrap_host": "127.0.0.1", "bootstrap_room": 5})
    assert r.status_code == 400 and "not in disaggregation mode" in r.text
    r = httpx.post(f"{cluster.decode.url}/generate", json={"input_ids": [1, 2]})
    assert r.status_code == 400 and "PD router" in r.text


def test_client_gone_cancels_reservation(cluster: Cluster) -> None:
    """A decode request whose client leaves while its transfer is pending is cancelled with
    the prefill server, and its reservation is freed only once the prefill server confirms
    (long before any timeout)."""
    body = {"input_ids": [9] * 30, "sampling_params": {"max_new_tokens": 2},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap_port,
            "bootstrap_room": 4242}
    unconfirmed = cluster.decode.output().count("never confirmed")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.decode.url}/generate", json=body, timeout=1.0)
    assert_whole(cluster.decode, cluster.prefill)
    # freed by the prefill server's confirmation, not by the fallback after the timeout
    assert cluster.decode.output().count("never confirmed") == unconfirmed


def test_plain_router_over_unified_servers(server: ServerProc, llm: LLM,
                                           prompts: list[list[int]], model: str,
                                           tmp_path: Path) -> None:
    """sglang-router's regular mode (cache-aware policy) in front of a unified server: the
    router's re-serialized requests (its default-valued extra fields) are accepted and the
    outputs are the server's own."""
    router, url = start_router(["--worker-urls", server.url, "--policy", "cache_aware"],
                               tmp_path / "router.log")
    try:
        want = [o.token_ids for o in reference(llm, prompts[:4], greedy(NEW))]
        for ids, w in zip(prompts[:4], want, strict=True):
            r = generate(url, ids)
            assert r.status_code == 200 and r.json()["output_ids"] == w, r.text
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": NEW, "temperature": 0}
        direct = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        routed = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    finally:
        stop_router(router)


def test_hostile_input_leaves_both_sides_healthy(cluster: Cluster, llm: LLM,
                                                 prompts: list[list[int]]) -> None:
    """A bootstrap host that is no address is a 400 with nothing reserved; junk sent to the
    prefill server's bootstrap port (not JSON, wrong types, huge numbers, extra frames, a
    cancel for someone else's room) is dropped; requests still work afterwards."""
    import zmq

    for host in ("a b", "*", "x;y"):
        r = httpx.post(f"{cluster.decode.url}/generate", timeout=30, json={
            "input_ids": [1, 2, 3], "bootstrap_host": host,
            "bootstrap_port": cluster.bootstrap_port, "bootstrap_room": 77})
        assert r.status_code == 400 and "bootstrap" in r.text, r.text
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{cluster.bootstrap_port}")
    for junk in (b"not json", b"[1, 2]", b'{"type": "reserve", "room": 1e400}',
                 b'{"type": "reserve", "room": 5, "blocks": "x", "layout": {}}',
                 b'{"type": "cancel", "room": 5, "tid": "nope"}', b'{"type": 3}'):
        sock.send(junk)
    sock.send_multipart([b"two", b"frames"])
    sock.close()
    time.sleep(0.5)
    want = reference(llm, [prompts[3]], greedy(NEW))[0].token_ids
    assert generate(cluster.url, prompts[3]).json()["output_ids"] == want
    assert_whole(cluster.prefill, cluster.decode)


# ---- Kimi K3 ----
def test_k3_through_the_router_matches_reference(k3_ckpt: Path, tmp_path: Path) -> None:
    """K3 disaggregated: its KDA states (the lower-bounded gate), MLA blocks and nothing of
    AttnRes (recomputed per forward, never cached) cross over; outputs equal the in-process
    engine's, multi-chunk prompts included, and both sides' pools end whole."""
    llm = LLM(k3_ckpt)
    g = torch.Generator().manual_seed(3)
    cands = [torch.randint(0, llm.config.vocab_size - 256, (n,), generator=g).tolist()
             for n in (5, 17, 40, 70, 100, 9)]
    batch = [p for p, ok in zip(cands, clear(llm, cands, NEW), strict=True) if ok]
    assert len(batch) >= 4
    want = [o.token_ids for o in reference(llm, batch, greedy(NEW))]
    prefill, bport = start_prefill(k3_ckpt, tmp_path)
    decode = start_decode(k3_ckpt, tmp_path)
    router, url = start_router(["--pd-disaggregation", "--prefill", prefill.url, str(bport),
                                "--decode", decode.url], tmp_path / "router.log")
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda ids: generate(url, ids), batch))
        for r, w in zip(got, want, strict=True):
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == w
        assert_whole(prefill, decode)
    finally:
        stop_router(router)
        stop_server(decode)
        stop_server(prefill)
