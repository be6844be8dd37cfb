"""The K3 output parser: channels to reasoning / content / tool calls, the same events whole
and streamed in any split, argument-form calls as a JSON object."""

from __future__ import annotations

import json

import pytest

from kdaserve.server.k3_parser import K3OutputParser
from kdaserve.server.tool_parser import ToolCallDelta

OUT = ('let me think<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response'
       '<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
       '<|open|>json type="object"<|sep|>{"city":"Paris"}<|close|>json<|sep|><|close|>call'
       '<|sep|><|open|>call tool="add" index="2"<|sep|><|open|>argument key="a" type="number"'
       '<|sep|>2<|close|>argument<|sep|><|open|>argument key="b" type="string"<|sep|>x "y"'
       '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message'
       '<|sep|><|end_of_msg|>')


def collect(events: list) -> tuple[str, str, dict[int, dict]]:
    reasoning = "".join(e[1] for e in events if isinstance(e, tuple) and e[0] == "reasoning")
    content = "".join(e[1] for e in events if isinstance(e, tuple) and e[0] == "content")
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            c = calls.setdefault(e.index, {"id": e.id, "name": e.name, "arguments": ""})
            c["arguments"] += e.arguments
    return reasoning, content, calls


@pytest.mark.parametrize("step", [len(OUT), 1, 3, 7])
def test_whole_and_streamed(step: int) -> None:
    p = K3OutputParser(in_reasoning=True)
    events = []
    for i in range(0, len(OUT), step):
        events += p.feed(OUT[i:i + step])
    reasoning, content, calls = collect(events + p.finish())
    assert reasoning == "let me think" and content == "Checking."
    assert calls[0]["name"] == "get_weather" and calls[0]["id"] == "functions.get_weather:0"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert calls[1]["name"] == "add"
    assert json.loads(calls[1]["arguments"]) == {"a": 2, "b": 'x "y"'}


def test_plain_text_and_unfinished_output() -> None:
    p = K3OutputParser(in_reasoning=False)
    assert collect(p.feed("just text <|clo") + p.finish()) == ("", "just text <|clo", {})
    p = K3OutputParser(in_reasoning=True)
    assert collect(p.feed("thinking forever") + p.finish()) == ("thinking forever", "", {})


def test_k2_splits_think_only_when_asked() -> None:
    from kdaserve.server.chat_format import K2Format

    out = "<think>x</think>answer"
    for reasoning, expected in ((True, ("x", "answer", {})), (False, ("", out, {}))):
        p = K2Format().parser(thinking=False, tools=False, reasoning=reasoning)
        assert collect(p.feed(out) + p.finish()) == expected
