"""Kimi K3 output text -> reasoning, content and tool calls, whole or streamed.

K3 writes its turn as tagged channels (`Kimi-K3.jinja`): `<|open|>TAG attrs<|sep|>` ...
`<|close|>TAG<|sep|>`: `think` (reasoning), `response` (content), then optionally `tools` holding
`call tool="NAME" index="i"` elements whose arguments are one `json type="object"` element or
`argument key="k" type="t"` elements; `<|close|>message<|sep|>` ends the turn. The generation
prompt opens the first channel (`think` or `response`), so parsing starts inside it.
The tags are special tokens: decode with them kept.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from kdaserve.server.tool_parser import ToolCallDelta

OPEN, SEP, CLOSE = "<|open|>", "<|sep|>", "<|close|>"
END_OF_MESSAGE = "<|end_of_msg|>"
MAX_TAG_CHARS = 1024  # a longer "tag" is text that happens to contain the marker
_ATTR_RE = re.compile(r'(\w+)="([^"]*)"')

Event = tuple[str, str] | ToolCallDelta  # ("reasoning" | "content", text) or a call piece


def _held_prefix(text: str) -> int:
    """Length of the tail of `text` that may be the start of a tag marker."""
    for n in range(min(len(text), len(END_OF_MESSAGE) - 1), 0, -1):
        tail = text[-n:]
        if OPEN.startswith(tail) or CLOSE.startswith(tail) or END_OF_MESSAGE.startswith(tail):
            return n
    return 0


def _typed(value: str, kind: str) -> Any:
    """An `argument` element's text as the JSON value its `type` attribute names."""
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class K3OutputParser:
    """Incremental: `feed` text pieces, then `finish`; each returns events in output order."""

    def __init__(self, in_reasoning: bool) -> None:
        self.channel = "think" if in_reasoning else "response"
        self.buffer = ""
        self.num_calls = 0
        self._args: dict[str, Any] | None = None  # argument-form call being collected
        self._arg: tuple[str, str] | None = None  # (key, type) of the open argument
        self._arg_text = ""

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            at = min((i for i in (self.buffer.find(OPEN), self.buffer.find(CLOSE)) if i >= 0),
                     default=-1)
            if at < 0:
                keep = _held_prefix(self.buffer)
                self._text(self.buffer[:len(self.buffer) - keep], events)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return events
            self._text(self.buffer[:at], events)
            self.buffer = self.buffer[at:]
            end = self.buffer.find(SEP)
            if end < 0:
                if len(self.buffer) > MAX_TAG_CHARS:  # not a tag after all
                    self._text(self.buffer[0], events)
                    self.buffer = self.buffer[1:]
                    continue
                return events
            is_open = self.buffer.startswith(OPEN)
            body = self.buffer[len(OPEN if is_open else CLOSE):end]
            self.buffer = self.buffer[end + len(SEP):]
            self._tag(is_open, body, events)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        rest, self.buffer = self.buffer, ""
        self._text(rest, events)
        self._end_call(events)
        return events

    def _text(self, text: str, events: list[Event]) -> None:
        text = text.replace(END_OF_MESSAGE, "")
        if not text:
            return
        if self.channel == "think":
            events.append(("reasoning", text))
        elif self.channel == "json":
            events.append(ToolCallDelta(self.num_calls - 1, text))
        elif self.channel == "argument":
            self._arg_text += text
        elif self.channel == "response" or text.strip():
            # text outside any channel is kept as content rather than lost
            events.append(("content", text))

    def _tag(self, is_open: bool, body: str, events: list[Event]) -> None:
        name, _, rest = body.strip().partition(" ")
        attrs = {k: html.unescape(v) for k, v in _ATTR_RE.findall(rest)}
        if not is_open:
            if name == "call":
                self._end_call(events)
                self.channel = "tools"
            elif name == "argument" and self._arg is not None and self._args is not None:
                self._args[self._arg[0]] = _typed(self._arg_text, self._arg[1])
                self._arg, self._arg_text = None, ""
                self.channel = "call"
            elif name == "json":
                self.channel = "call"
            else:
                self.channel = "between"
            return
        if name in ("think", "response", "tools"):
            self.channel = name
        elif name == "call":
            self._end_call(events)
            tool = attrs.get("tool", "")
            events.append(ToolCallDelta(self.num_calls, "", f"functions.{tool}:{self.num_calls}",
                                        tool))
            self.num_calls += 1
            self._args = {}
            self.channel = "call"
        elif name == "json" and self._args is not None:
            self._args = None  # the arguments stream as they are written
            self.channel = "json"
        elif name == "argument" and self._args is not None:
            self._arg = (attrs.get("key", ""), attrs.get("type", "string"))
            self.channel = "argument"

    def _end_call(self, events: list[Event]) -> None:
        if self._args is not None:  # argument form: the JSON object once complete
            events.append(ToolCallDelta(self.num_calls - 1,
                                        json.dumps(self._args, ensure_ascii=False)))
            self._args = None
