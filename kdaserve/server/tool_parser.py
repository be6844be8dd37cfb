"""Model output text -> OpenAI message parts for Kimi models: tool calls in Kimi K2's marker
format (the `kimi_k2` parser of SGLang/vLLM), whole or streamed, and `<think>` reasoning.
Markers must survive detokenization: decode with skip_special_tokens=False when these run."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
TOOL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)
THINK_START = "<think>"
THINK_END = "</think>"

# Kimi ids are `functions.{name}:{idx}`; like SGLang we also accept a bare `{name}:{idx}`. The
# name is everything before the last `:digits` (OpenAI names cannot contain ':'), so a dotted
# name survives instead of being cut at its first or last dot as the reference parsers do.
_ID_RE = re.compile(r"(?:functions\.)?(?P<name>\S+):(?P<idx>\d+)")
# A header longer than this is not a call id; the limit also bounds what streaming buffers.
MAX_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete call. `id` as the model wrote it (`functions.NAME:IDX`, which Moonshot asks
    vendors to return unchanged), `arguments` the raw JSON text between the markers."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """`choices[].message.tool_calls[]` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed piece of call `index` (0-based over the whole output). The first delta of a
    call carries `id` and `name` (arguments may be ""), later ones only argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """`choices[].delta.tool_calls[]` entry, e.g. {"index": 0, "id": ..., "type": "function",
        "function": {"name": ..., "arguments": ""}} then {"index": 0, "function": {"arguments":
        "{\\"a"}}}; clients join `arguments` per index."""
        function: dict[str, str] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        delta: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            delta["id"] = self.id
            delta["type"] = "function"
        delta["function"] = function
        return delta


def _parse_id(raw: str) -> tuple[str, str] | None:
    """(id, name) of the text between CALL_BEGIN and ARG_BEGIN, or None if it is no call id."""
    if len(raw) > MAX_ID_CHARS:
        return None
    call_id = raw.strip()
    match = _ID_RE.fullmatch(call_id)
    if match is None or any(marker in call_id for marker in TOOL_MARKERS):
        return None
    return call_id, match["name"]


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split a complete output into (content, calls). Content is the text outside the tool-calls
    sections; calls keep the model's ids and raw argument text (invalid JSON included: the
    client sees exactly what the model produced). Any malformed or unterminated section makes the
    whole output plain content with no calls; this never raises.

    Accepted: content (SECTION_BEGIN ws* (CALL_BEGIN id ARG_BEGIN args CALL_END ws*)+ SECTION_END
    content)*, where args contain no tool marker. Whitespace between markers is dropped."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(SECTION_BEGIN, pos)) >= 0:
        content.append(text[pos:start])
        pos = start + len(SECTION_BEGIN)
        num_before = len(calls)
        while True:
            pos += len(text[pos:]) - len(text[pos:].lstrip())
            if text.startswith(SECTION_END, pos) and len(calls) > num_before:
                pos += len(SECTION_END)
                break
            if not text.startswith(CALL_BEGIN, pos):
                return text, []
            arg_at = text.find(ARG_BEGIN, pos)
            parsed = _parse_id(text[pos + len(CALL_BEGIN) : arg_at]) if arg_at >= 0 else None
            if parsed is None:
                return text, []
            end_at = text.find(CALL_END, arg_at)
            arguments = text[arg_at + len(ARG_BEGIN) : end_at]
            if end_at < 0 or any(marker in arguments for marker in TOOL_MARKERS):
                return text, []
            calls.append(ToolCall(parsed[0], parsed[1], arguments))
            pos = end_at + len(CALL_END)
    content.append(text[pos:])
    return "".join(content), calls


def _partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`: text
    that must be held back because the next chunk may complete a marker."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


_CONTENT, _SECTION, _CALL_ID, _ARGS, _PLAIN = range(5)


class StreamingToolParser:
    """Incremental `parse_tool_calls`. `feed(delta_text)` returns, in output order, content
    strings and `ToolCallDelta`s; `finish()` flushes what was held back at the end of output.

    Content is delayed only while its tail could still begin SECTION_BEGIN; a call's header
    delta is emitted once `id<|tool_call_argument_begin|>` is complete, then its argument text
    as it arrives (minus a possible partial marker at the tail).

    For well-formed output the joined events equal `parse_tool_calls(full_text)` however the
    text is chunked. Malformed output cannot be un-streamed: from the point the problem is seen,
    the rest (including the unconsumed raw text of the section, markers and all) is content.
    If no call had been emitted yet, that again equals `parse_tool_calls` (the whole text as
    content); otherwise calls already emitted stay. `is_malformed` is set whenever
    `parse_tool_calls` would return the text as plain content, `is_truncated` when the output
    ended inside a section (e.g. max_tokens)."""

    def __init__(self) -> None:
        self._state = _CONTENT
        self._buffer = ""  # received, not yet emitted or consumed
        self._raw = ""  # consumed section text not yet turned into a call header
        self._num_calls = 0  # completed calls; the call being streamed has this index
        self._num_headers = 0
        self._calls_in_section = 0
        self.is_malformed = False
        self.is_truncated = False

    @property
    def num_calls(self) -> int:
        """Calls whose header has been emitted so far, complete or not."""
        return self._num_headers

    def feed(self, delta_text: str) -> list[str | ToolCallDelta]:
        """Events for the next piece of output text."""
        self._buffer += delta_text
        events: list[str | ToolCallDelta] = []
        while self._step(events):
            pass
        return _coalesce(events)

    def finish(self) -> list[str | ToolCallDelta]:
        """Events for text held back when the output ends (stop, length or abort)."""
        events: list[str | ToolCallDelta] = []
        if self._state == _ARGS:
            # Cut inside a call's arguments: they are arguments, just unterminated.
            self.is_truncated = self.is_malformed = True
            if self._buffer:
                events.append(ToolCallDelta(self._num_calls, self._buffer))
        elif self._state in (_SECTION, _CALL_ID):
            self.is_truncated = True
            self._fall_back(events)
        elif self._buffer:
            events.append(self._buffer)
        self._buffer = ""
        return _coalesce(events)

    def _step(self, events: list[str | ToolCallDelta]) -> bool:
        """Consume what the current state can from the buffer; True if the state changed."""
        buf = self._buffer
        if self._state == _PLAIN:
            if buf:
                events.append(buf)
            self._buffer = ""
            return False
        if self._state == _CONTENT:
            start = buf.find(SECTION_BEGIN)
            if start < 0:
                keep = _partial_marker_len(buf, (SECTION_BEGIN,))
                self._emit_content(buf[: len(buf) - keep], events)
                self._buffer = buf[len(buf) - keep :]
                return False
            self._emit_content(buf[:start], events)
            self._raw = SECTION_BEGIN
            self._calls_in_section = 0
            self._buffer = buf[start + len(SECTION_BEGIN) :]
            self._state = _SECTION
            return True
        if self._state == _SECTION:
            stripped = buf.lstrip()
            self._raw += buf[: len(buf) - len(stripped)]
            self._buffer = stripped
            if stripped.startswith(SECTION_END) and self._calls_in_section:
                # An empty section is malformed (as in parse_tool_calls), so `_raw` is only ever
                # dropped here after a call was committed.
                self._raw = ""
                self._buffer = stripped[len(SECTION_END) :]
                self._state = _CONTENT
                return True
            if stripped.startswith(CALL_BEGIN):
                self._raw += CALL_BEGIN
                self._buffer = stripped[len(CALL_BEGIN) :]
                self._state = _CALL_ID
                return True
            if any(len(stripped) < len(m) and m.startswith(stripped)
                   for m in (SECTION_END, CALL_BEGIN)):
                return False  # empty, or a marker still arriving
            return self._fall_back(events)
        if self._state == _CALL_ID:
            arg_at = buf.find(ARG_BEGIN)
            if arg_at < 0:
                # Any other complete marker first, or a header already too long, can never
                # become a valid id.
                id_len = len(buf) - _partial_marker_len(buf, (ARG_BEGIN,))
                if id_len > MAX_ID_CHARS or any(marker in buf for marker in TOOL_MARKERS):
                    return self._fall_back(events)
                return False
            parsed = _parse_id(buf[:arg_at])
            if parsed is None:
                return self._fall_back(events)
            events.append(ToolCallDelta(self._num_calls, "", id=parsed[0], name=parsed[1]))
            self._num_headers += 1
            self._raw = ""  # committed: this section text is now a structured call
            self._buffer = buf[arg_at + len(ARG_BEGIN) :]
            self._state = _ARGS
            return True
        # _ARGS: stream argument text up to CALL_END; any other marker first is malformed.
        first = min(
            ((at, m) for m in TOOL_MARKERS if (at := buf.find(m)) >= 0), default=None
        )
        if first is None:
            keep = _partial_marker_len(buf, TOOL_MARKERS)
            if len(buf) > keep:
                events.append(ToolCallDelta(self._num_calls, buf[: len(buf) - keep]))
            self._buffer = buf[len(buf) - keep :]
            return False
        at, marker = first
        if marker != CALL_END:
            if at:
                events.append(ToolCallDelta(self._num_calls, buf[:at]))
            self._buffer = buf[at:]
            return self._fall_back(events)
        if at:
            events.append(ToolCallDelta(self._num_calls, buf[:at]))
        self._num_calls += 1
        self._calls_in_section += 1
        self._buffer = buf[at + len(CALL_END) :]
        self._state = _SECTION
        return True

    def _emit_content(self, text: str, events: list[str | ToolCallDelta]) -> None:
        if text:
            events.append(text)

    def _fall_back(self, events: list[str | ToolCallDelta]) -> bool:
        # Unparseable section: everything from here on is plain content, starting with the raw
        # section text consumed since the last emitted call header.
        self.is_malformed = True
        self._emit_content(self._raw + self._buffer, events)
        self._raw = ""
        self._buffer = ""
        self._state = _PLAIN
        return False


def _coalesce(events: list[str | ToolCallDelta]) -> list[str | ToolCallDelta]:
    """Merge adjacent content strings and adjacent deltas of one call, so one feed() gives at
    most one chunk per kind instead of one per internal step."""
    merged: list[str | ToolCallDelta] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, str) and isinstance(last, str):
            merged[-1] = last + event
        elif (
            isinstance(event, ToolCallDelta)
            and isinstance(last, ToolCallDelta)
            and last.index == event.index
            and event.id is None
        ):
            merged[-1] = ToolCallDelta(last.index, last.arguments + event.arguments,
                                       last.id, last.name)
        else:
            merged.append(event)
    return merged


class ReasoningParser:
    """Splits `<think>reasoning</think>content`, following SGLang's `kimi_k2` reasoning parser:

    - Output that does not start with `<think>` is all content (SGLang's default
      force_reasoning=False), unless `in_reasoning=True`: use that when the prompt itself opened
      the block (a template whose generation prompt ends in `<think>`), so output starts inside
      reasoning. A leading `<think>` is stripped either way.
    - Reasoning ends at `</think>` (dropped) or, early, at `<|tool_calls_section_begin|>`, which
      is kept at the start of content so the tool parser still sees the calls.
    - Output that ends inside reasoning is all reasoning (truncated thinking).
    Run it before the tool parser, feeding the tool parser only the content part."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self._starts_in_reasoning = in_reasoning
        self._state = "start"  # start -> reasoning | content
        self._buffer = ""

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a complete output. Stateless; ignores streaming state."""
        if text.startswith(THINK_START):
            body = text[len(THINK_START) :]
        elif self._starts_in_reasoning:
            body = text
        else:
            return "", text
        end_at, section_at = body.find(THINK_END), body.find(SECTION_BEGIN)
        if end_at >= 0 and (section_at < 0 or end_at < section_at):
            return body[:end_at], body[end_at + len(THINK_END) :]
        if section_at >= 0:
            return body[:section_at], body[section_at:]
        return body, ""

    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) for the next piece of output text."""
        self._buffer += delta_text
        reasoning = ""
        if self._state == "start":
            if THINK_START.startswith(self._buffer) and self._buffer != THINK_START:
                return "", ""  # could still become `<think>`
            if self._buffer.startswith(THINK_START):
                self._buffer = self._buffer[len(THINK_START) :]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self._starts_in_reasoning else "content"
        if self._state == "reasoning":
            buf = self._buffer
            end_at, section_at = buf.find(THINK_END), buf.find(SECTION_BEGIN)
            if end_at >= 0 and (section_at < 0 or end_at < section_at):
                reasoning, self._buffer = buf[:end_at], buf[end_at + len(THINK_END) :]
                self._state = "content"
            elif section_at >= 0:
                reasoning, self._buffer = buf[:section_at], buf[section_at:]
                self._state = "content"
            else:
                keep = _partial_marker_len(buf, (THINK_END, SECTION_BEGIN))
                reasoning, self._buffer = buf[: len(buf) - keep], buf[len(buf) - keep :]
                return reasoning, ""
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back when the output ends."""
        held, self._buffer = self._buffer, ""
        in_reasoning = self._state == "reasoning" or (
            self._state == "start" and self._starts_in_reasoning
        )
        return (held, "") if in_reasoning else ("", held)
