"""SGLang-native endpoints (/generate, /get_model_info, /health_generate), Prometheus /metrics,
the prefix cache behind the API, and clients that go away mid-stream (their blocks and state slot
must be freed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kdaserve import LLM
from kdaserve.tokenizer import Tokenizer

from .conftest import (
    NEW,
    ServerProc,
    clear,
    greedy,
    is_idle,
    metrics,
    post_generate,
    reference,
    sse_events,
    wait_idle,
)


def test_generate_shapes(http: httpx.Client, llm: LLM, tok: Tokenizer,
                         prompts: list[list[int]]) -> None:
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    refs = reference(llm, prompts[:2], greedy(NEW))

    one = post_generate(http, {"input_ids": prompts[0], "sampling_params": sp})
    assert set(one) >= {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == len(prompts[0]) and meta["completion_tokens"] == NEW
    assert meta["finish_reason"] == {"type": "length", "length": NEW}
    assert isinstance(meta["id"], str) and "output_token_logprobs" not in meta

    many = post_generate(http, {"input_ids": prompts[:2], "sampling_params": sp})
    assert isinstance(many, list) and len(many) == 2
    assert [m["output_ids"] for m in many] == [o.outputs[0].token_ids for o in refs]
    assert len({m["meta_info"]["id"] for m in many}) == 2

    texts = ["Question: 1 + 1?\nAnswer:", "Hello"]
    batch = post_generate(http, {"text": texts, "sampling_params": sp})
    assert isinstance(batch, list) and len(batch) == 2
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [len(tok.encode(t)) for t in texts]
    single = post_generate(http, {"text": texts[1], "sampling_params": sp})
    assert isinstance(single, dict) and single["text"] == batch[1]["text"]

    # SGLang streams cumulative text, each event with the full meta_info
    with http.stream("POST", "/generate", json={"input_ids": prompts[0], "sampling_params": sp,
                                                "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert len(events) >= 2
    for a, b in zip(events, events[1:], strict=False):
        assert str(b["text"]).startswith(str(a["text"]))
        assert b["meta_info"]["completion_tokens"] >= a["meta_info"]["completion_tokens"]
    assert events[-1]["text"] == one["text"] and events[-1]["output_ids"] == one["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": NEW}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_model_info_and_models(http: httpx.Client, tiny_ckpt: Path) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == str(tiny_ckpt) and info["is_generation"] is True
    assert "tokenizer_path" in info
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    m = models["data"][0]
    assert m["object"] == "model" and m["id"] and m["max_model_len"] > 0


def test_health_generate_and_metrics(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    before = wait_idle(http)
    fresh = list(range(1000, 1029))  # sent nowhere else: no prefix-cache hit
    post_generate(http, {"input_ids": fresh, "sampling_params": {
        "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = metrics(http)
    for gauge in ("num_running", "num_waiting", "free_blocks", "total_blocks",
                  "free_state_slots", "total_state_slots", "prompt_tokens",
                  "generation_tokens"):
        assert f"kdaserve_{gauge}" in after
    assert after["kdaserve_prompt_tokens"] - before["kdaserve_prompt_tokens"] == len(fresh)
    assert after["kdaserve_generation_tokens"] - before["kdaserve_generation_tokens"] == NEW
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        count = f"kdaserve_{hist}_count"
        assert after[count] > before[count]
        assert f'kdaserve_{hist}_bucket{{le="+Inf"}}' in after
    # one TTFT per request, one ITL per further token
    assert after["kdaserve_time_to_first_token_seconds_count"] - \
        before["kdaserve_time_to_first_token_seconds_count"] == 1
    assert after["kdaserve_inter_token_latency_seconds_count"] - \
        before["kdaserve_inter_token_latency_seconds_count"] == NEW - 1


# ---- client disconnects ----
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_disconnect_mid_stream_frees_blocks_and_slot(server: ServerProc, http: httpx.Client,
                                                     path: str) -> None:
    long = 4000
    body: dict[str, Any] = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "go on"}],
                                 "max_tokens": long, "ignore_eos": True, "stream": True},
        "/v1/completions": {"prompt": "go on", "max_tokens": long, "ignore_eos": True,
                            "stream": True},
        "/generate": {"text": "go on", "stream": True, "sampling_params": {
            "max_new_tokens": long, "ignore_eos": True}},
    }[path]
    before = wait_idle(http)
    with httpx.Client(base_url=server.url, timeout=60) as own:  # a connection of its own
        with own.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 4:
                    break  # the client goes away; closing the response drops the connection
    after = wait_idle(http)
    assert after["kdaserve_num_running"] == 0 and after["kdaserve_num_waiting"] == 0
    assert is_idle(after), after  # every block and slot free, or held by the prefix cache
    generated = after["kdaserve_generation_tokens"] - before["kdaserve_generation_tokens"]
    assert 3 <= generated < long  # it ran, and it was aborted rather than finished
    assert http.get("/health").status_code == 200
    flushed = http.post("/flush_cache")  # the prefix cache lets go of what it holds
    assert flushed.status_code == 200, flushed.text
    m = metrics(http)
    assert m["kdaserve_free_blocks"] == m["kdaserve_total_blocks"]
    assert m["kdaserve_free_state_slots"] == m["kdaserve_total_state_slots"]


def test_prefix_cache_hit_keeps_outputs(http: httpx.Client, llm: LLM) -> None:
    """Two prompts sharing a 150-token prefix: the second reuses cached prefix state through
    the server and still decodes exactly like the reference."""
    g = torch.Generator().manual_seed(99)
    for _ in range(10):
        prefix = torch.randint(0, llm.config.vocab_size - 256, (150,), generator=g).tolist()
        pair = [prefix + [11, 12, 13], prefix + [21, 22]]
        if all(clear(llm, pair, NEW)):
            break
    else:
        raise AssertionError("no clear prompt pair")
    refs = reference(llm, pair, greedy(NEW))
    before = metrics(http)
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    outs = [post_generate(http, {"input_ids": p, "sampling_params": sp}) for p in pair]
    after = metrics(http)
    assert [o["output_ids"] for o in outs] == [r.outputs[0].token_ids for r in refs]
    hit = after["kdaserve_prefix_cache_hit_tokens"] - before["kdaserve_prefix_cache_hit_tokens"]
    assert 64 <= hit <= 150


def test_prefill_only_generate_warms_the_cache(http: httpx.Client) -> None:
    """max_new_tokens 0 (what SGLang's frontend sends to warm the prefix cache): no output,
    and the same prompt then hits the cache."""
    assert http.post("/flush_cache").status_code == 200
    ids = list(range(300, 300 + 140))
    warm = post_generate(http, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}})
    assert warm["output_ids"] == [] and warm["text"] == ""
    assert warm["meta_info"]["completion_tokens"] == 0
    before = metrics(http)["kdaserve_prefix_cache_hit_tokens"]
    post_generate(http, {"input_ids": ids + [7], "sampling_params": {"max_new_tokens": 2}})
    assert metrics(http)["kdaserve_prefix_cache_hit_tokens"] - before >= 128


def test_bench_serving_against_the_server(server: ServerProc, tmp_path: Path) -> None:
    """`kdaserve bench serving` end to end (a smoke test: numbers are not asserted)."""
    import json

    from kdaserve.cli import main as cli_main

    out = tmp_path / "serving.json"
    cli_main(["bench", "serving", "--url", server.url, "--num-prompts", "6",
              "--random-input-len", "12", "--random-output-len", "5", "--max-concurrency", "3",
              "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_output_tokens"] == 30 and r["ttft"]["mean_ms"] > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/generate", "/v1/chat/completions"])
def test_disconnect_while_waiting_for_a_non_streaming_answer(server: ServerProc,
                                                             http: httpx.Client,
                                                             path: str) -> None:
    body: dict[str, Any] = {
        "/v1/completions": {"prompt": "go on", "max_tokens": 4000, "ignore_eos": True},
        "/generate": {"text": "go on", "sampling_params": {"max_new_tokens": 4000,
                                                           "ignore_eos": True}},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "go on"}],
                                 "max_tokens": 4000, "ignore_eos": True},
    }[path]
    before = wait_idle(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{path}", json=body, timeout=1.0)  # gives up, disconnects
    after = wait_idle(http)
    assert is_idle(after), after
    generated = after["kdaserve_generation_tokens"] - before["kdaserve_generation_tokens"]
    assert generated < 4000  # aborted, not run to the end
