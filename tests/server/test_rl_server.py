"""SGLang's RL endpoints on a real server: refit from disk, from shared tensors and by a
torch.distributed broadcast from this test process (the trainer, rank 0, gloo), each followed
by the tokens and logprobs of a fresh engine on the new weights and `weight_version` in
meta_info; bad updates refused with the old weights serving; sleep/wake with the engine
process's RSS measured; pause/continue."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kdaserve import LLM, RequestOptions, SamplingParams
from kdaserve.checkpoint import make_checkpoint
from tests.ports import free_port

from .conftest import ServerProc, start_server, stop_server

PROMPT = [5, 9, 17, 33, 40, 41]
NEW = 6


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("rl-other"), "tiny", seed=7)


@pytest.fixture(scope="module")
def rl_server(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("rl-logs"))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def h(rl_server: ServerProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=rl_server.url, timeout=120) as client:
        yield client


def generate(h: httpx.Client) -> dict[str, Any]:
    r = h.post("/generate", json={"input_ids": PROMPT, "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                      "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def reference(ckpt: Path) -> tuple[list[int], list[float]]:
    out = LLM(ckpt).generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0))[0]
    lps = out.outputs[0].logprobs or []
    return out.token_ids, [d[t] for d, t in zip(lps, out.token_ids, strict=True)]


def check(g: dict[str, Any], ref: tuple[list[int], list[float]], version: str) -> None:
    assert g["output_ids"] == ref[0]
    got = [x[0] for x in g["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(ref[1], abs=1e-4)
    assert g["meta_info"]["weight_version"] == version


def post(h: httpx.Client, path: str, body: dict[str, Any], status: int = 200) -> dict:
    r = h.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def serialized(ckpt: Path) -> str:
    torch.multiprocessing.set_sharing_strategy("file_system")
    named = [(k, v.detach().clone()) for k, v in LLM(ckpt).model.checkpoint_tensors().items()]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


def test_refit_from_disk_tensor_and_distributed(h: httpx.Client, tiny_ckpt: Path,
                                                other_ckpt: Path) -> None:
    base, other = reference(tiny_ckpt), reference(other_ckpt)
    assert base[0] != other[0]
    check(generate(h), base, "default")
    post(h, "/update_weights_from_disk", {"model_path": str(other_ckpt), "weight_version": "v1"})
    check(generate(h), other, "v1")
    assert h.get("/get_weight_version").json() == {"weight_version": "v1"}
    post(h, "/update_weights_from_tensor", {"serialized_named_tensors": [serialized(tiny_ckpt)],
                                            "weight_version": "v2"})
    check(generate(h), base, "v2")

    # the trainer (this process, rank 0) broadcasts the other checkpoint's weights
    import torch.distributed as dist

    port = free_port()
    named = [(k, v.detach().clone()) for k, v in LLM(other_ckpt).model.checkpoint_tensors().items()]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(post, h, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "backend": "gloo"})
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                rank=0)
        try:
            joined.result(timeout=60)
            sent = pool.submit(post, h, "/update_weights_from_distributed", {
                "names": [k for k, _ in named], "dtypes": [str(v.dtype) for _, v in named],
                "shapes": [list(v.shape) for _, v in named], "weight_version": "v3"})
            for _, v in named:
                dist.broadcast(v, src=0)
            sent.result(timeout=60)
            post(h, "/destroy_weights_update_group", {})
        finally:
            dist.destroy_process_group()
    check(generate(h), other, "v3")


def test_bad_updates_leave_the_weights(h: httpx.Client, small_ckpt: Path) -> None:
    before = generate(h)
    for path, body, message in (
            ("/update_weights_from_disk", {"model_path": str(small_ckpt)}, "architecture"),
            ("/update_weights_from_disk", {"model_path": "/no/such"}, "checkpoint"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": ["@@"]}, "base64"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": [
                base64.b64encode(b"junk").decode()]}, "serialized"),
            ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"],
                                                  "shapes": [[1]]}, "group"),
            ("/release_memory_occupation", {"tags": ["gpu"]}, "tags")):
        err = post(h, path, body, 400)["error"]["message"]
        assert message in err, err
    after = generate(h)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_sleep_and_wake(h: httpx.Client, rl_server: ServerProc, tiny_ckpt: Path) -> None:
    post(h, "/update_weights_from_disk", {"model_path": str(tiny_ckpt), "weight_version": "w"})
    before = generate(h)
    engine = rl_server.engine_pid()
    rss = rss_kb(engine)
    out = post(h, "/release_memory_occupation", {})
    assert out["rss_mb_after"] < out["rss_mb_before"]
    assert rss_kb(engine) < rss  # measured from outside too
    r = h.post("/generate", json={"input_ids": PROMPT})
    assert r.status_code == 503 and "resume" in r.json()["error"]["message"]
    post(h, "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert generate(h)["output_ids"] == before["output_ids"]


def test_pause_abort_answers_the_aborted(h: httpx.Client) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(h.post, "/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 20000, "ignore_eos": True}})
        while h.get("/metrics").text.find("kdaserve_num_running 1") < 0:
            pass
        post(h, "/pause_generation", {"mode": "abort"})
        r = long.result(timeout=120)  # answered now (abort), not when a later request comes
        assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
        post(h, "/continue_generation", {})
    assert generate(h)["output_ids"]


def test_pause_retract_and_continue(h: httpx.Client) -> None:
    want = generate(h)["output_ids"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, h)
        post(h, "/pause_generation", {"mode": "retract"})
        post(h, "/continue_generation", {})
        assert running.result(timeout=60)["output_ids"] == want


def test_routed_experts_in_meta_info(h: httpx.Client, tiny_ckpt: Path) -> None:
    post(h, "/update_weights_from_disk", {"model_path": str(tiny_ckpt)})
    llm = LLM(tiny_ckpt)
    want = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        temperature=0, max_tokens=NEW, ignore_eos=True), options=RequestOptions(
        return_routed_experts=True, routed_experts_start=2))[0].outputs[0].routed_experts
    r = h.post("/generate", json={"input_ids": PROMPT, "return_routed_experts": True,
                                  "routed_experts_start_len": 2, "sampling_params": {
                                      "max_new_tokens": NEW, "temperature": 0,
                                      "ignore_eos": True}})
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["meta_info"]["routed_experts"])
    got = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(want.shape)
    assert want.shape[0] == len(PROMPT) + NEW - 1 - 2 and torch.equal(got, want)


def test_hidden_states_in_meta_info(h: httpx.Client, tiny_ckpt: Path) -> None:
    post(h, "/update_weights_from_disk", {"model_path": str(tiny_ckpt)})
    want = LLM(tiny_ckpt).generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(
        temperature=0, max_tokens=NEW, ignore_eos=True), options=RequestOptions(
        return_hidden_states=True))[0].outputs[0].hidden_states
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                     "ignore_eos": True}}
    r = h.post("/generate", json={**body, "return_hidden_states": True})
    assert r.status_code == 200, r.text
    hs = r.json()["meta_info"]["hidden_states"]
    # SGLang's layout: the prompt's rows first, then one row per later output token
    assert len(hs) == NEW and len(hs[0]) == len(PROMPT)
    got = torch.tensor(hs[0] + hs[1:])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    r = h.post("/generate", json=body)
    assert "hidden_states" not in r.json()["meta_info"]


def test_a_restarted_engine_reports_its_own_weights(h: httpx.Client, rl_server: ServerProc,
                                                    tiny_ckpt: Path) -> None:
    """(Last in this module: it restarts the engine.) The new engine serves its start-up
    checkpoint, unpaused; the server must not keep reporting what the old one had."""
    post(h, "/update_weights_from_disk", {"model_path": str(tiny_ckpt), "weight_version": "v9"})
    post(h, "/pause_generation", {"mode": "in_place"})
    os.kill(rl_server.engine_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while h.get("/health").status_code == 200:  # until the server has seen it die
        assert time.monotonic() < deadline, "the engine's death went unnoticed"
        time.sleep(0.05)
    while h.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.2)
    out = generate(h)  # not held back by the dead engine's pause
    assert out["meta_info"]["weight_version"] == "default"
    assert h.get("/get_weight_version").json()["weight_version"] == "default"
