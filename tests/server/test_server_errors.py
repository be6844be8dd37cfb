"""What a real server does with bad input, a missing API key, a prompt beyond its context and
a crashed engine: an OpenAI-style error object with the right status (400/401/503), never a hang,
and a server that stays healthy."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import (
    ServerProc,
    is_gone,
    is_idle,
    metrics,
    start_server,
    stop_server,
    wait_idle,
)

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
GEN = "/generate"

# (id, path, JSON body or raw bytes, fragment the error message must contain)
BAD: list[tuple[str, str, dict[str, Any] | list[int] | bytes, str]] = [
    ("chat-malformed-json", CHAT, b'{"messages": [{"role": "user", "content": "hi"}', "JSON"),
    ("chat-body-not-object", CHAT, [1, 2], "dictionary"),
    ("cmpl-malformed-json", CMPL, b'{"prompt": "hi", max_tokens: 3}', "JSON"),
    ("gen-malformed-json", GEN, b'{"text": ', "JSON"),
    ("chat-temperature-str", CHAT, {"messages": USER, "temperature": "hot"}, "temperature"),
    ("cmpl-temperature-str", CMPL, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("chat-messages-str", CHAT, {"messages": "hello"}, "messages"),
    ("chat-messages-missing", CHAT, {"model": "m"}, "messages"),
    ("chat-content-int", CHAT, {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("chat-role-missing", CHAT, {"messages": [{"content": "hi"}]}, "role"),
    ("chat-max-tokens-negative", CHAT, {"messages": USER, "max_tokens": -5}, "max_tokens"),
    ("chat-max-tokens-zero", CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("chat-max-completion-tokens-zero", CHAT, {"messages": USER, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("chat-max-tokens-absurd", CHAT, {"messages": USER, "max_tokens": 10**12}, "max_tokens"),
    ("chat-max-tokens-huge-int", CHAT, {"messages": USER, "max_tokens": 10**40}, "max_tokens"),
    ("chat-max-tokens-fraction", CHAT, {"messages": USER, "max_tokens": 1.5}, "max_tokens"),
    ("cmpl-max-tokens-negative", CMPL, {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("cmpl-max-tokens-absurd", CMPL, {"prompt": "hi", "max_tokens": 10**9}, "context"),
    ("gen-max-new-tokens-negative", GEN, {"text": "hi", "sampling_params": {
        "max_new_tokens": -1}}, "max_new_tokens"),
    ("chat-temperature-negative", CHAT, {"messages": USER, "temperature": -0.5}, "temperature"),
    ("cmpl-temperature-negative", CMPL, {"prompt": "hi", "temperature": -1}, "temperature"),
    ("chat-top-p-zero", CHAT, {"messages": USER, "top_p": 0}, "top_p"),
    ("chat-top-p-above-one", CHAT, {"messages": USER, "top_p": 1.5}, "top_p"),
    ("gen-top-p-zero", GEN, {"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ("chat-presence-penalty", CHAT, {"messages": USER, "presence_penalty": 3}, "presence_penalty"),
    ("chat-empty-messages", CHAT, {"messages": []}, "messages: list should have at least 1 item"),
    ("chat-unknown-role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]},
     "messages.0.role: input should be 'system', 'user', 'assistant' or 'tool'"),
    ("chat-tool-without-id", CHAT, {"messages": [*USER, {"role": "tool", "content": "x"}]},
     "tool_call_id"),
    ("chat-image-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "content[0]: this model takes no images"),
    ("chat-tools-not-list", CHAT, {"messages": USER, "tools": "get_weather"}, "tools"),
    ("chat-tool-bad-type", CHAT, {"messages": USER, "tools": [{"type": "retrieval"}]},
     "tools[0].type"),
    ("chat-tool-no-name", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
    ("chat-tool-bad-parameters", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "parameters"),
    ("chat-tool-choice-missing-function", CHAT, {"messages": USER, "tools": [TOOL],
     "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ("chat-tool-choice-without-tools", CHAT, {"messages": USER, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, "get_weather"),
    ("chat-tool-choice-bad-string", CHAT, {"messages": USER, "tools": [TOOL],
     "tool_choice": "sometimes"}, "tool_choice"),
    ("chat-top-logprobs-too-many", CHAT, {"messages": USER, "logprobs": True,
     "top_logprobs": 21}, "logprobs"),
    ("chat-top-logprobs-negative", CHAT, {"messages": USER, "logprobs": True,
     "top_logprobs": -1}, "logprobs"),
    ("chat-top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 2},
     "top_logprobs"),
    ("cmpl-logprobs-too-many", CMPL, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("cmpl-logprobs-negative", CMPL, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("gen-top-logprobs-too-many", GEN, {"text": "hi", "return_logprob": True,
     "top_logprobs_num": 21}, "logprobs"),
    ("chat-n-zero", CHAT, {"messages": USER, "n": 0}, "n: input should be"),
    ("cmpl-n-negative", CMPL, {"prompt": "hi", "n": -2}, "n: input should be"),
    ("chat-empty-stop", CHAT, {"messages": USER, "stop": [""]}, "stop"),
    ("cmpl-empty-prompt-list", CMPL, {"prompt": []}, "prompt"),
    ("cmpl-empty-prompt-text", CMPL, {"prompt": ""},
     "prompt: string should have at least 1 character"),
    ("cmpl-token-out-of-vocab", CMPL, {"prompt": [1, 10**7]}, "vocabulary"),
    ("gen-token-negative", GEN, {"input_ids": [-1]}, "input_ids"),
    ("gen-neither-text-nor-ids", GEN, {"sampling_params": {"max_new_tokens": 2}},
     "text or input_ids"),
    ("gen-both-text-and-ids", GEN, {"text": "hi", "input_ids": [1]}, "text or input_ids"),
    ("gen-sampling-params-type", GEN, {"text": "hi", "sampling_params": {"temperature": "x"}},
     "temperature"),
    ("chat-stream-bad-temperature", CHAT, {"messages": USER, "stream": True,
     "temperature": -1}, "temperature"),
    ("cmpl-stream-bad-n", CMPL, {"prompt": "hi", "stream": True, "n": 0}, "n: input should be"),
    ("gen-stream-bad-top-p", GEN, {"text": "hi", "stream": True, "sampling_params": {
        "top_p": 0}}, "top_p"),
    # strings for numbers and booleans, non-finite numbers: no lax coercion
    ("chat-max-tokens-string", CHAT, {"messages": USER, "max_tokens": "10"}, "max_tokens"),
    ("cmpl-n-string", CMPL, {"prompt": "hi", "n": "2"}, "n"),
    ("chat-stream-string", CHAT, {"messages": USER, "stream": "yes"}, "stream"),
    ("gen-temperature-string", GEN, {"text": "hi", "sampling_params": {"temperature": "0.5"}},
     "temperature"),
    ("cmpl-temperature-infinity", CMPL, b'{"prompt": "hi", "temperature": Infinity}',
     "temperature"),
    ("chat-top-p-nan", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"top_p": NaN}', "top_p"),
    ("cmpl-min-tokens-above-max", CMPL, {"prompt": "hi", "max_tokens": 4, "min_tokens": 8},
     "min_tokens"),
    ("gen-min-new-tokens-above-max", GEN, {"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "min_new_tokens": 5}}, "min_new_tokens"),
    ("gen-repetition-penalty-tiny", GEN, {"text": "hi", "sampling_params": {
        "repetition_penalty": 1e-300}}, "repetition_penalty"),
    ("chat-repetition-penalty-huge", CHAT, {"messages": USER, "repetition_penalty": 1e6},
     "repetition_penalty"),
]


def assert_error(r: httpx.Response, status: int, fragment: str = "") -> dict[str, Any]:
    """An OpenAI-style error object: {"error": {"message", "type", "param", "code"}}."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status and isinstance(err["type"], str)
    assert fragment.lower() in err["message"].lower(), err["message"]
    return dict(err)


# ---- bad input on the shared server ----
@pytest.mark.parametrize(("path", "body", "fragment"), [c[1:] for c in BAD],
                         ids=[c[0] for c in BAD])
def test_bad_input_is_400_and_server_stays_healthy(http: httpx.Client, path: str,
                                                   body: dict[str, Any] | list[int] | bytes,
                                                   fragment: str) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = assert_error(r, 400, fragment)
    assert err["type"] == "BadRequestError"
    assert http.get("/health").status_code == 200


def test_tiny_temperatures_are_greedy(http: httpx.Client) -> None:
    """Below 1e-5 a temperature samples greedily (as in vLLM and SGLang), where dividing the
    logits by it made them infinite and every token 0."""
    def ids(temperature: float) -> list[int]:
        r = http.post(GEN, json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 6, "temperature": temperature, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        return list(r.json()["output_ids"])

    greedy = ids(0.0)
    assert ids(1e-300) == ids(1e-39) == greedy
    assert greedy != [0] * 6


def test_integral_numbers_are_integers(http: httpx.Client) -> None:
    """JSON Schema's `integer` is any number with no fraction, and the document says
    integer: 2.0 and 1e1 are 2 and 10 (1.5 stays a 400, above), in a list too."""
    r = http.post(GEN, json={"input_ids": [5.0, 6, 7e0], "sampling_params": {
        "max_new_tokens": 2.0, "temperature": 0, "ignore_eos": True, "sampling_seed": 1e1}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 2
    plain = http.post(GEN, json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    assert r.json()["output_ids"] == plain.json()["output_ids"]
    assert_error(http.post(GEN, json={"input_ids": [5, 6.5]}), 400, "input_ids")


def test_logit_bias_keys_are_digits(http: httpx.Client) -> None:
    """As the document's pattern says: int() would also take " 5", "+5" and "1_0"."""
    for key in (" 5", "+5", "1_0", "-1", "5\n"):
        assert_error(http.post(CMPL, json={"prompt": "hi", "max_tokens": 1,
                                           "logit_bias": {key: 1}}), 400, "logit_bias")
    ok = http.post(CMPL, json={"prompt": "hi", "max_tokens": 1, "logit_bias": {"5": 100}})
    assert ok.status_code == 200, ok.text


def test_405_names_every_method_of_the_path(http: httpx.Client) -> None:
    r = http.request("OPTIONS", "/v1/responses/resp_x")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers


def test_prompt_beyond_the_context_is_400(http: httpx.Client) -> None:
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert_error(http.post(CMPL, json={"prompt": [5] * limit, "max_tokens": 1}), 400,
                 f"{limit} tokens")
    assert_error(http.post(CMPL, json={"prompt": [5] * (limit - 4), "max_tokens": 5}), 400,
                 "exceeds the context")


def test_openai_client_sees_bad_request(server: ServerProc) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[], max_tokens=2)
    assert e.value.status_code == 400 and "messages" in e.value.message
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="m", prompt="hi", temperature=-1, stream=True)


def test_server_is_sound_after_bad_inputs(http: httpx.Client) -> None:
    """Nothing a rejected request touched stays allocated; good requests still work."""
    assert is_idle(wait_idle(http))
    r = http.post(CHAT, json={"messages": USER, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health_generate").status_code == 200


# ---- a second server: API key, small context ----
KEY = "sekret-key"
SMALL = 256


@pytest.fixture(scope="module")
def guarded(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("guarded-logs"),
                     "--max-total-tokens", str(SMALL), api_key=KEY)
    engine = s.engine_pid()
    yield s
    stop_server(s)
    assert is_gone(engine)


def test_api_key(guarded: ServerProc) -> None:
    url = guarded.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
        assert_error(httpx.get(f"{url}/v1/models", headers=headers), 401)
    for scheme in ("Bearer", "bearer", "BEARER"):  # RFC 9110: the scheme is case-insensitive
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, r.text
        assert_error(httpx.post(f"{url}/v1/chat/completions", headers=headers,
                                json={"messages": USER, "max_tokens": 1}), 401)
        assert_error(httpx.post(f"{url}/generate", headers=headers, json={"text": "hi"}), 401)
    assert httpx.get(f"{url}/health").status_code == 200  # probes need no key

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id
    served = client.models.list().data[0].id
    kw: dict[str, Any] = {"model": served, "messages": USER, "max_tokens": 2}
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason in ("stop", "length")
    g = httpx.post(f"{url}/generate", headers=guarded.headers(),
                   json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert g.status_code == 200 and g.json()["meta_info"]["completion_tokens"] >= 1


def test_small_context(guarded: ServerProc) -> None:
    with httpx.Client(base_url=guarded.url, headers=guarded.headers(), timeout=60) as h:
        assert h.get("/v1/models").json()["data"][0]["max_model_len"] == SMALL
        long_chat = [{"role": "user", "content": "word " * 400}]
        for stream in (False, True):
            assert_error(h.post(CHAT, json={"messages": long_chat, "stream": stream}), 400,
                         f"the context holds {SMALL}")
        assert_error(h.post(CMPL, json={"prompt": [7] * 200, "max_tokens": 100}), 400,
                     f"context of {SMALL} tokens")
        assert_error(h.post(GEN, json={"input_ids": [7] * 300}), 400, str(SMALL))
        ok = h.post(CMPL, json={"prompt": [7] * 200, "max_tokens": 56, "ignore_eos": True,
                                "temperature": 0})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"] == {"prompt_tokens": 200, "completion_tokens": 56,
                                      "total_tokens": 256,
                                      "prompt_tokens_details": {"cached_tokens": 0}}
        # without max_tokens a chat may use the rest of the context, and no more
        r = h.post(CHAT, json={"messages": USER, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["total_tokens"] == SMALL and r.json()["choices"][0]["finish_reason"] == \
            "length"
        assert h.get("/health").status_code == 200


# ---- engine crash ----
def test_engine_crash_gives_503_not_a_hang(tiny_ckpt: Path,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("crash-logs"))
    long = {"prompt": "go", "max_tokens": 20000, "ignore_eos": True}
    streams = {CMPL: {**long, "stream": True},
               CHAT: {"messages": USER, "max_tokens": 20000, "ignore_eos": True, "stream": True},
               GEN: {"text": "go", "stream": True, "sampling_params": {
                   "max_new_tokens": 20000, "ignore_eos": True}}}
    started = threading.Semaphore(0)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(4))
        h = stack.enter_context(httpx.Client(base_url=s.url, timeout=30))
        # runs first on the way out, so a failure below cannot leave the threads streaming;
        # the HTTP process must still shut down cleanly, leaving no orphans
        stack.callback(stop_server, s)

        def in_flight_stream(path: str) -> str:
            lines: list[str] = []
            try:
                with h.stream("POST", path, json=streams[path]) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if not lines:
                            started.release()  # streaming: the engine may die now
                        lines.append(line)
            except httpx.TransportError as e:  # the connection was dropped: also no hang
                lines.append(f"transport error: {e!r}")
            return "\n".join(lines)

        engine = s.engine_pid()
        blocking = pool.submit(lambda: h.post(CMPL, json=long))
        streaming = [pool.submit(in_flight_stream, path) for path in streams]
        for _ in streams:
            assert started.acquire(timeout=30), "a stream never started"
        deadline = time.monotonic() + 30
        while metrics(h)["kdaserve_num_running"] < 4:  # the blocking one runs too
            assert time.monotonic() < deadline, "the blocking request never started"
            time.sleep(0.05)
        os.kill(engine, signal.SIGKILL)
        # requests sent as it dies and while it restarts get 503s, and never run later as
        # ghosts (their commands die with the dead engine's socket); their ids are free again
        for i in range(10):
            r = h.post(GEN, json={"text": "go", "rid": f"during-{i}", "sampling_params": {
                "max_new_tokens": 5000, "ignore_eos": True}})
            assert r.status_code == 503, r.text
        # ended by the engine's death (5,000 tokens each would run for minutes otherwise)
        assert_error(blocking.result(timeout=120), 503, "engine")
        for future in streaming:
            # ends with an error event, and is not passed off as a complete answer
            text = future.result(timeout=120)
            assert "[DONE]" not in text
            last = [ln for ln in text.splitlines() if ln.startswith("data: ")][-1]
            assert '"code": 503' in last and "engine" in last, last

        # the server restarts the engine: /health tells the truth on the way, then serves
        deadline = time.monotonic() + 120
        while (r := h.get("/health")).status_code != 200:
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
            assert time.monotonic() < deadline, "the engine was not restarted"
            time.sleep(0.2)
        assert "engine process died" in s.output() and "engine restarted" in s.output()
        assert s.engine_pid() != engine
        r = h.post(CHAT, json={"messages": USER, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert is_idle(wait_idle(h))  # nothing of the old engine's requests is left
        r = h.post(GEN, json={"text": "go", "rid": "during-0",
                              "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text


def test_engine_that_keeps_dying_exits_the_server(tiny_ckpt: Path,
                                                  tmp_path_factory: pytest.TempPathFactory,
                                                  ) -> None:
    """Restarts are bounded: past them the server exits non-zero (for a supervisor), with no
    orphans and its IPC folder removed."""
    before = set(Path(tempfile.gettempdir()).glob("kdaserve-*"))
    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("fatal-logs"),
                     "--max-engine-restarts", "0")
    assert set(Path(tempfile.gettempdir()).glob("kdaserve-*")) - before  # its IPC folder
    tree = [s.pid, s.engine_pid()]
    os.kill(tree[1], signal.SIGKILL)
    assert s.proc.wait(timeout=60) == 1
    assert "exiting: engine process died" in s.output()
    deadline = time.monotonic() + 60
    while not all(is_gone(p) for p in tree):
        assert time.monotonic() < deadline, "orphans left"
        time.sleep(0.1)
    assert not set(Path(tempfile.gettempdir()).glob("kdaserve-*")) - before


def test_unknown_model_is_404(http: httpx.Client, model: str) -> None:
    """As OpenAI: a model this server does not serve is a 404 error object naming it."""
    for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 1})):
        r = http.post(path, json={**body, "model": "no-such-model"})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and "no-such-model" in err["message"]
        assert http.post(path, json={**body, "model": model}).status_code == 200
