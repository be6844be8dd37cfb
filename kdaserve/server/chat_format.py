"""How a chat template's assistant turn is written, per template family: the output parser,
the special tokens that must survive detokenization, the tokens that close reasoning, and the
grammars that force a tool call or a JSON response in that family's own format.

- `K2Format`: Kimi K2 / Kimi Linear (`<|tool_calls_section_begin|>`... markers, `<think>`).
- `K3Format`: Kimi K3 tagged channels (`<|open|>think<|sep|>`...), see `k3_parser.py`.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from kdaserve.engine.grammar import JSON_OPTIONS, prepare_schema
from kdaserve.request import Grammar
from kdaserve.server.k3_parser import CLOSE, OPEN, SEP, Event, K3OutputParser
from kdaserve.server.tool_parser import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
    THINK_START,
    ReasoningParser,
    StreamingToolParser,
    ToolCallDelta,
)
from kdaserve.tokenizer import Tokenizer


def lark_json(schema: dict[str, Any] | None) -> str:
    """`%json` of a schema for a Lark grammar, compact like our json_schema grammars."""
    # no schema, or `{}`: arguments are still a JSON object
    schema = prepare_schema(schema) if schema else {"type": "object"}
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class OutputParser(Protocol):
    """Splits streamed output text into reasoning, content and tool-call events."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


class ChatFormat:
    name = ""
    default_thinking = False
    markers: tuple[str, ...] = ()

    def marker_ids(self, tok: Tokenizer) -> tuple[int, ...]:
        ids = tuple(tok.token_to_id(m) for m in self.markers)
        return tuple(i for i in ids if i is not None)

    def pending_tokens(self, thinking: bool) -> int:
        """Trailing prompt tokens that open the model's channel: counted as output, as the
        reference API counts them."""
        return 0

    def reasoning_end(self, tok: Tokenizer) -> tuple[int, ...]:
        raise NotImplementedError

    def parser(self, thinking: bool, tools: bool, reasoning: bool) -> OutputParser:
        """`reasoning`: split reasoning out (K2: only with a reasoning parser configured)."""
        raise NotImplementedError

    def tool_grammar(self, tools: list[dict[str, Any]], thinking: bool,
                     optional: bool = False) -> Grammar:
        """One or more calls of the given tools (OpenAI tool objects), arguments by schema;
        `optional`: free text first and the calls optional (tool_choice auto, strict tools)."""
        raise NotImplementedError

    def json_grammar(self, schema: dict[str, Any] | None, thinking: bool) -> Grammar:
        raise NotImplementedError


class _K2Parser:
    def __init__(self, thinking: bool, tools: bool, reasoning: bool) -> None:
        self.reasoning = ReasoningParser(in_reasoning=thinking) if reasoning else None
        self.tools = StreamingToolParser() if tools else None

    def _events(self, reasoning: str, content: str, final: bool) -> list[Event]:
        out: list[Event] = [("reasoning", reasoning)] if reasoning else []
        if self.tools is None:
            return out + ([("content", content)] if content else [])
        for ev in self.tools.feed(content) + (self.tools.finish() if final else []):
            out.append(ev if isinstance(ev, ToolCallDelta) else ("content", ev))
        return out

    def feed(self, text: str) -> list[Event]:
        split = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._events(*split, final=False)

    def finish(self) -> list[Event]:
        split = self.reasoning.finish() if self.reasoning else ("", "")
        return self._events(*split, final=True)


class K2Format(ChatFormat):
    name = "kimi_k2"
    markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END, THINK_START,
               THINK_END)

    def reasoning_end(self, tok: Tokenizer) -> tuple[int, ...]:
        end = tok.token_to_id(THINK_END)
        return (end,) if end is not None else ()

    def parser(self, thinking: bool, tools: bool, reasoning: bool) -> OutputParser:
        return _K2Parser(thinking, tools, reasoning)

    def tool_grammar(self, tools: list[dict[str, Any]], thinking: bool,
                     optional: bool = False) -> Grammar:
        rules = [f"call_{i}: {CALL_BEGIN} {lark_str('functions.' + t['function']['name'] + ':')}"
                 f" IDX {ARG_BEGIN} args_{i} {CALL_END}\n"
                 f"args_{i}: {lark_json(t['function'].get('parameters'))}\n"
                 for i, t in enumerate(tools)]
        think = f"THINK {THINK_END} " if thinking else ""
        section = f"{SECTION_BEGIN} call+ {SECTION_END}"
        body = f"TEXT ({section})?" if optional else section
        lark = (f"start: {think}{body}\nTEXT: /(?s:.*)/\n"
                f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}\n"
                "IDX: /[0-9]{1,2}/\nTHINK: /(?s:.*)/\n" + "".join(rules))
        return Grammar("lark", lark)

    def json_grammar(self, schema: dict[str, Any] | None, thinking: bool) -> Grammar:
        think = f"THINK {THINK_END} " if thinking else ""
        return Grammar("lark", f"start: {think}body\nbody: {lark_json(schema)}\n"
                               "THINK: /(?s:.*)/\n")


JSON_TAG = 'json type="object"'


class K3Format(ChatFormat):
    name = "kimi_k3"
    default_thinking = True  # Kimi-K3.jinja: `thinking` defaults to true
    markers = (OPEN, SEP, CLOSE)
    THINK_CLOSE = f"{CLOSE}think{SEP}{OPEN}response{SEP}"

    def pending_tokens(self, thinking: bool) -> int:
        return 3  # <|open|> think|response <|sep|>

    def reasoning_end(self, tok: Tokenizer) -> tuple[int, ...]:
        return tuple(tok.encode(self.THINK_CLOSE))

    def parser(self, thinking: bool, tools: bool, reasoning: bool) -> OutputParser:
        return K3OutputParser(in_reasoning=thinking)

    def _turn(self, body: str, tools: str, thinking: bool) -> str:
        think = f'THINK {CLOSE} "think" {SEP} {OPEN} "response" {SEP} ' if thinking else ""
        return (f'start: {think}{body}{CLOSE} "response" {SEP} {tools}{CLOSE} "message" {SEP}\n'
                "THINK: /(?s:.*)/\n")

    def tool_grammar(self, tools: list[dict[str, Any]], thinking: bool,
                     optional: bool = False) -> Grammar:
        rules = []
        for i, t in enumerate(tools):
            head = lark_str('call tool="' + t["function"]["name"] + '" index="')
            rules.append(f'call_{i}: {OPEN} {head} IDX {lark_str(chr(34))} {SEP} {OPEN} '
                         f'{lark_str(JSON_TAG)} {SEP} args_{i} {CLOSE} "json" {SEP} '
                         f'{CLOSE} "call" {SEP}\n'
                         f"args_{i}: {lark_json(t['function'].get('parameters'))}\n")
        calls = f'{OPEN} "tools" {SEP} call+ {CLOSE} "tools" {SEP} '
        if optional:
            calls = f"({calls})? "
        return Grammar("lark", self._turn("TEXT " if optional else "", calls, thinking)
                       + "TEXT: /(?s:.*)/\n"
                       + f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}\n"
                       + "IDX: /[1-9][0-9]?/\n" + "".join(rules))

    def json_grammar(self, schema: dict[str, Any] | None, thinking: bool) -> Grammar:
        return Grammar("lark", self._turn("body ", "", thinking)
                       + f"body: {lark_json(schema)}\n")


def detect_format(template_source: str) -> ChatFormat:
    return K3Format() if OPEN in template_source else K2Format()
