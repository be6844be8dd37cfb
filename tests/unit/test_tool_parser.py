"""Kimi tool-call and reasoning parsers: known model outputs parse as expected, and the streaming
parsers give exactly the one-shot result however the text is chunked."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kdaserve.server.tool_parser import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    MAX_ID_CHARS,
    SECTION_BEGIN,
    SECTION_END,
    ReasoningParser,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    parse_tool_calls,
)


def call(call_id: str, args: str) -> str:
    return f"{CALL_BEGIN}{call_id}{ARG_BEGIN}{args}{CALL_END}"


def section(*calls: str) -> str:
    return SECTION_BEGIN + "".join(calls) + SECTION_END


W0 = call("functions.get_weather:0", '{"city": "Beijing"}')
W1 = call("functions.get_weather:1", '{"city": "Shanghai"}')

# (model output, expected content, expected [(id, name, arguments)])
WELL_FORMED: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    "plain": ("The answer is 4.", "The answer is 4.", []),
    "plain_with_lookalikes": (
        "a <| b <|tool_calls <|tool_call_begin|> stray </think> <",
        "a <| b <|tool_calls <|tool_call_begin|> stray </think> <", []),
    "one_call": (section(W0), "", [("functions.get_weather:0", "get_weather",
                                    '{"city": "Beijing"}')]),
    "two_calls": (section(W0, W1), "", [
        ("functions.get_weather:0", "get_weather", '{"city": "Beijing"}'),
        ("functions.get_weather:1", "get_weather", '{"city": "Shanghai"}')]),
    "content_before": ("Let me check.\n" + section(W0), "Let me check.\n",
                       [("functions.get_weather:0", "get_weather", '{"city": "Beijing"}')]),
    "content_after": (section(W0) + "done", "done",
                      [("functions.get_weather:0", "get_weather", '{"city": "Beijing"}')]),
    "whitespace_between_markers": (
        f"x{SECTION_BEGIN}\n{W0}\n  {W1}\n{SECTION_END}", "x", [
            ("functions.get_weather:0", "get_weather", '{"city": "Beijing"}'),
            ("functions.get_weather:1", "get_weather", '{"city": "Shanghai"}')]),
    "padded_id": (section(call(" functions.f:3 ", "{}")), "", [("functions.f:3", "f", "{}")]),
    "bare_id_and_dotted_name": (
        section(call("search:0", "{}"), call("functions.a.b:1", "[]")), "",
        [("search:0", "search", "{}"), ("functions.a.b:1", "a.b", "[]")]),
    "malformed_json_kept": (section(call("functions.f:0", '{"a": 1,,')), "",
                            [("functions.f:0", "f", '{"a": 1,,')]),
    "empty_args": (section(call("functions.now:0", "")), "", [("functions.now:0", "now", "")]),
    "unicode_args": ("天气？" + section(call("functions.get_weather:0",
                                             '{"city": "北京", "note": "🌧️ naïve <b>"}')),
                     "天气？", [("functions.get_weather:0", "get_weather",
                               '{"city": "北京", "note": "🌧️ naïve <b>"}')]),
    "args_with_angle_brackets": (section(call("functions.f:0", '{"x": "<|tool", "y": "<|"}')),
                                 "", [("functions.f:0", "f", '{"x": "<|tool", "y": "<|"}')]),
    "two_sections": (section(W0) + " mid " + section(W1), " mid ", [
        ("functions.get_weather:0", "get_weather", '{"city": "Beijing"}'),
        ("functions.get_weather:1", "get_weather", '{"city": "Shanghai"}')]),
}

# Malformed before any call header completes: plain text in both parsers.
MALFORMED_EARLY: dict[str, str] = {
    "empty_section": f"a{SECTION_BEGIN}{SECTION_END}b",
    "garbage_in_section": f"a{SECTION_BEGIN}oops{W0}{SECTION_END}",
    "bad_id": f"a{SECTION_BEGIN}{call('get_weather', '{}')}{SECTION_END}",
    "empty_id": section(call("", "{}")),
    "marker_in_id": f"{SECTION_BEGIN}{CALL_BEGIN}functions.f:0{CALL_BEGIN}{ARG_BEGIN}{{}}"
                    f"{CALL_END}{SECTION_END}",
    "id_too_long": section(call("functions." + "x" * MAX_ID_CHARS + ":0", "{}")),
    "truncated_in_header": f"hi {SECTION_BEGIN}{CALL_BEGIN}functions.get_wea",
    "truncated_after_begin": f"hi {SECTION_BEGIN}",
    "truncated_partial_marker": f"hi {SECTION_BEGIN}<|tool_ca",
}

# Malformed after a call header was streamed: one-shot gives plain text; streaming cannot
# un-send the header, so it keeps the calls it sent and turns the rest into content.
# (output, streamed content, streamed calls)
MALFORMED_LATE: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    "missing_call_end": (f'{SECTION_BEGIN}{CALL_BEGIN}functions.f:0{ARG_BEGIN}{{"a": 1}}'
                         f"{SECTION_END}", SECTION_END, [("functions.f:0", "f", '{"a": 1}')]),
    "missing_section_end": (f"ok {SECTION_BEGIN}{W0}", "ok ",
                            [("functions.get_weather:0", "get_weather", '{"city": "Beijing"}')]),
    "truncated_in_args": (f'ok {SECTION_BEGIN}{CALL_BEGIN}functions.f:0{ARG_BEGIN}{{"a": ', "ok ",
                          [("functions.f:0", "f", '{"a": ')]),
    "second_call_bad": (f"{SECTION_BEGIN}{W0}{CALL_BEGIN}nope{ARG_BEGIN}{{}}{CALL_END}"
                        f"{SECTION_END}", f"{CALL_BEGIN}nope{ARG_BEGIN}{{}}{CALL_END}{SECTION_END}",
                        [("functions.get_weather:0", "get_weather", '{"city": "Beijing"}')]),
}


def expected_calls(spec: list[tuple[str, str, str]]) -> list[ToolCall]:
    return [ToolCall(i, n, a) for i, n, a in spec]


@pytest.mark.parametrize("name", WELL_FORMED)
def test_parse_known_outputs(name: str) -> None:
    text, content, calls = WELL_FORMED[name]
    assert parse_tool_calls(text) == (content, expected_calls(calls))


@pytest.mark.parametrize("text", [*MALFORMED_EARLY.values(),
                                  *(case[0] for case in MALFORMED_LATE.values())],
                         ids=[*MALFORMED_EARLY, *MALFORMED_LATE])
def test_malformed_is_plain_text(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


def test_to_openai() -> None:
    content, calls = parse_tool_calls(section(W0))
    assert [c.to_openai() for c in calls] == [{
        "id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Beijing"}'}}]
    first = ToolCallDelta(0, "", id="functions.f:0", name="f")
    assert first.to_openai() == {"index": 0, "id": "functions.f:0", "type": "function",
                                 "function": {"name": "f", "arguments": ""}}
    assert ToolCallDelta(0, '{"a"').to_openai() == {"index": 0, "function": {"arguments": '{"a"'}}


def run_stream(chunks: list[str]) -> tuple[str, list[ToolCall], StreamingToolParser]:
    """Feed chunks, then reassemble the events as an OpenAI client would (join by index)."""
    parser = StreamingToolParser()
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    content: list[str] = []
    headers: dict[int, tuple[str, str]] = {}
    args: dict[int, str] = {}
    for event in events:
        if isinstance(event, str):
            assert event, "empty content delta"
            content.append(event)
            continue
        if event.id is not None:
            assert event.index == len(headers) and event.name, "header out of order"
            headers[event.index] = (event.id, event.name)
            args[event.index] = ""
        else:
            assert event.index in headers and event.arguments, "args before header or empty"
        args[event.index] += event.arguments
    calls = [ToolCall(headers[i][0], headers[i][1], args[i]) for i in sorted(headers)]
    return "".join(content), calls, parser


def chunkings(text: str, seed: int, num_random: int = 30) -> Iterator[list[str]]:
    """Whole, one char at a time, every two-way split, and seeded random chunkings."""
    yield [text]
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(num_random):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("name", [*WELL_FORMED, *MALFORMED_EARLY])
def test_streaming_equals_one_shot_for_every_split(name: str) -> None:
    text = WELL_FORMED[name][0] if name in WELL_FORMED else MALFORMED_EARLY[name]
    expected = parse_tool_calls(text)
    for i, chunks in enumerate(chunkings(text, seed=len(text))):
        content, calls, parser = run_stream(chunks)
        assert (content, calls) == expected, (name, i, chunks)
        assert parser.is_malformed == (name in MALFORMED_EARLY)
        assert parser.is_truncated == ("truncated" in name)


@pytest.mark.parametrize("name", MALFORMED_LATE)
def test_streaming_late_malformed_keeps_sent_calls(name: str) -> None:
    text, content, calls = MALFORMED_LATE[name]
    for chunks in chunkings(text, seed=1):
        got_content, got_calls, parser = run_stream(chunks)
        assert (got_content, got_calls) == (content, expected_calls(calls)), chunks
        assert parser.is_malformed
        assert parser.is_truncated == (name in ("missing_section_end", "truncated_in_args"))


def test_streaming_holds_only_possible_markers() -> None:
    parser = StreamingToolParser()
    assert parser.feed("Hello <|tool_calls_sec") == ["Hello "]
    assert parser.feed("ret") == ["<|tool_calls_secret"]  # not a marker after all
    assert parser.feed(SECTION_BEGIN + CALL_BEGIN + "functions.f:") == []
    assert parser.num_calls == 0
    assert parser.feed("0" + ARG_BEGIN + '{"a"') == [
        ToolCallDelta(0, '{"a"', id="functions.f:0", name="f")]
    assert parser.feed(": 1}<|tool") == [ToolCallDelta(0, ": 1}")]
    assert parser.num_calls == 1  # counted from its header, before it completes
    assert parser.feed("_call_end|>" + SECTION_END + "bye") == ["bye"]
    assert parser.finish() == []
    assert parser.num_calls == 1 and not parser.is_malformed and not parser.is_truncated


def test_streaming_truncated_args_flush_as_arguments() -> None:
    parser = StreamingToolParser()
    events = parser.feed(f"{SECTION_BEGIN}{CALL_BEGIN}functions.f:0{ARG_BEGIN}{{\"a\": \"<|")
    assert events == [ToolCallDelta(0, '{"a": "', id="functions.f:0", name="f")]
    assert parser.finish() == [ToolCallDelta(0, "<|")]
    assert parser.is_truncated


# Reasoning: (output, expected reasoning, expected content) for in_reasoning=False / True.
REASONING_CASES: dict[str, tuple[str, tuple[str, str], tuple[str, str]]] = {
    "no_think": ("Just content.", ("", "Just content."), ("Just content.", "")),
    "think": ("<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4."),
              ("Let me see.", "It is 4.")),
    "think_not_at_start": ("x <think>y</think>z", ("", "x <think>y</think>z"),
                           ("x <think>y", "z")),
    "prompt_opened_think": ("hmm</think>answer", ("", "hmm</think>answer"), ("hmm", "answer")),
    "truncated_reasoning": ("<think>still thinking", ("still thinking", ""),
                            ("still thinking", "")),
    "tool_section_ends_reasoning": (
        "<think>need weather" + section(W0), ("need weather", section(W0)),
        ("need weather", section(W0))),
    "end_before_section": ("<think>a</think>b" + section(W0), ("a", "b" + section(W0)),
                           ("a", "b" + section(W0))),
    "empty_think": ("<think></think>hi", ("", "hi"), ("", "hi")),
    "partial_think_only": ("<thi", ("", "<thi"), ("<thi", "")),
    "lookalikes": ("<think>a </thin b <|tool_calls c</think>d", ("a </thin b <|tool_calls c", "d"),
                   ("a </thin b <|tool_calls c", "d")),
}


@pytest.mark.parametrize("name", REASONING_CASES)
@pytest.mark.parametrize("in_reasoning", [False, True])
def test_reasoning_split_and_stream(name: str, in_reasoning: bool) -> None:
    text, off, on = REASONING_CASES[name]
    expected = on if in_reasoning else off
    assert ReasoningParser(in_reasoning).split(text) == expected
    for chunks in chunkings(text, seed=7, num_random=20):
        parser = ReasoningParser(in_reasoning)
        parts = [parser.feed(c) for c in chunks] + [parser.finish()]
        got = ("".join(r for r, _ in parts), "".join(c for _, c in parts))
        assert got == expected, chunks


def test_reasoning_then_tools_pipeline_streams() -> None:
    """The server chain: reasoning parser first, its content deltas into the tool parser."""
    text = "<think>I should call the tool.</think>Sure. " + section(W0, W1)
    for chunks in chunkings(text, seed=3, num_random=20):
        reasoning_parser, tool_parser = ReasoningParser(), StreamingToolParser()
        reasoning, events = "", []
        for chunk in chunks:
            r, c = reasoning_parser.feed(chunk)
            reasoning += r
            events += tool_parser.feed(c)
        r, c = reasoning_parser.finish()
        reasoning += r
        events += tool_parser.feed(c) + tool_parser.finish()
        assert reasoning == "I should call the tool."
        assert "".join(e for e in events if isinstance(e, str)) == "Sure. "
        assert [e.name for e in events if isinstance(e, ToolCallDelta) and e.name] == [
            "get_weather", "get_weather"]
