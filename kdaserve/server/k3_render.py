"""Kimi K3's chat format ("XTML", k3_spec.md 6.3) in our own code. K3 ships no Jinja template:
Moonshot renders in Python, as a list of segments where only the control tokens (`<|open|>`,
`<|sep|>`, `<|close|>`, `<|end_of_msg|>`) may be special and every other piece, tag names and
attribute text included, is encoded on its own as ordinary text. So no content can spell a
control token, and the ids are those of encoding each segment alone.

A message is `<|open|>message role="user"[ name=".."]<|sep|>..<|close|>message<|sep|>
<|end_of_msg|>`; an assistant's body is a `think` channel (in thinking mode, even empty), a
`response` channel and a `tools` channel of `call`s with typed `argument`s (or a raw `json`
block where the arguments are no JSON object); tool results go back in call order; internal
system messages declare tools, the thinking effort, the tool choice and the response format.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kdaserve.server.chat_request import check_tools
from kdaserve.server.chat_template import deep_sort, validate_messages
from kdaserve.tokenizer import Tokenizer

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
# an image's marker (a control segment: text cannot spell it), which the image's prompt
# replaces once the image is processed (multimodal.expand)
MEDIA_PAD = "<|media_pad|>"
CONTROL_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)
EFFORTS = ("low", "high", "max")
KWARGS = {"thinking", "thinking_effort", "tool_choice", "response_format"}

Segment = tuple[str, bool]  # (text, a control token)


def is_kimi_k3(path: str | Path) -> bool:
    """Whether the checkpoint at `path` is a Kimi K3 one (its config's `model_type`)."""
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") == "kimi_k3"
    except (OSError, ValueError):
        return False


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _Segments:
    """The rendered conversation as it grows: control tokens and ordinary pieces apart."""

    def __init__(self) -> None:
        self.items: list[Segment] = []
        self.images: list[dict[str, Any]] = []  # the image parts, in prompt order

    def control(self, token: str) -> None:
        self.items.append((token, True))

    def text(self, value: Any) -> None:
        s = str(value)
        if s:  # an empty piece encodes to nothing
            self.items.append((s, False))

    def open(self, tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:  # each piece alone: ` key`, `="`, the value, `"`
            self.text(f" {key}")
            self.text('="')
            self.text(str(value).replace("&", "&amp;").replace('"', "&quot;"))
            self.text('"')
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def message(self, attrs: list[tuple[str, Any]], body: Any = None) -> None:
        self.open("message", attrs)
        if body is not None:
            self.content(body)
        self.close("message")
        self.control(END_OF_MSG)

    def system(self, kind: str, body: str) -> None:
        self.open("message", [("role", "system"), ("type", kind)])
        self.text(body.strip())
        self.close("message")
        self.control(END_OF_MSG)

    def content(self, content: Any) -> None:
        if isinstance(content, str):
            self.text(content)
            return
        for part in content or ():
            if part.get("type") == "image_url":
                self.control(MEDIA_PAD)
                self.images.append(part)
            else:
                self.text(part.get("text", ""))


def _arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """A call's arguments as (object, None), or ({}, raw text) where they are no JSON."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}, None
    if isinstance(raw, dict):
        return raw, None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return {}, raw
    if not isinstance(parsed, dict):
        raise ValueError("a K3 tool call's arguments must be a JSON object")
    return parsed, None


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _in_call_order(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool results sorted by the position of the call it answers (matched by
    `tool_call_id` against the last assistant turn's calls), its `tool` set to that call's
    function; a run with a result that matches no call is left as it came."""
    out: list[dict[str, Any]] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "tool":
            if m.get("role") == "assistant":
                calls = {}
                for pos, call in enumerate(m.get("tool_calls") or [], start=1):
                    if call.get("id") is not None and str(call["id"]) not in calls:
                        calls[str(call["id"])] = (pos, call.get("function", call).get("name"))
            out.append(m)
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i].get("role") == "tool":
            call_id = messages[i].get("tool_call_id", messages[i].get("id"))
            run.append((calls.get(str(call_id)) if call_id is not None else None, messages[i]))
            i += 1
        if any(match is None for match, _ in run):
            out.extend(m for _, m in run)
            continue
        for (_, name), m in sorted(run, key=lambda r: r[0][0]):  # stable: ties keep order
            out.append({**m, "tool": name, **({"name": name} if "name" in m else {})})
    return out


class K3Renderer:
    """The chat renderer served for `kimi_k3` checkpoints (ChatTemplate's interface)."""

    origin = "builtin (kimi_k3)"
    source = ""  # no template text: K3's format is this code

    def segments(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                 add_generation_prompt: bool = True, **kwargs: Any) -> list[Segment]:
        return self._render(messages, tools, add_generation_prompt, **kwargs).items

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, **kwargs: Any) -> _Segments:
        validate_messages(messages)
        unknown = sorted(set(kwargs) - KWARGS)
        if unknown:
            raise ValueError(f"chat_template_kwargs: {unknown[0]!r} is not a Kimi K3 option "
                             f"({', '.join(sorted(KWARGS))})")
        thinking = kwargs.get("thinking", True)
        effort = kwargs.get("thinking_effort")
        if effort is not None and effort not in EFFORTS:
            raise ValueError(f"thinking_effort={effort!r} is not one of {', '.join(EFFORTS)}")
        out = _Segments()
        if tools:
            check_tools(tools, "tools")
            out.system("tool-declare", "# Tools\nHere are the available tools, described in "
                       f"JSONSchema.\n\n```json\n{_compact(deep_sort(tools))}\n```")
        if thinking and effort is not None:
            out.system("thinking-effort", (
                "`thinking_effort` guides on how much to think in your thinking channel (not "
                "including the response channel), supported values include `low`, `medium`, "
                f"`high`, and `max`.\nNow the system is invoked with `thinking_effort={effort}`."))
        calls: list[dict[str, Any]] = []
        results = 0
        for m in _in_call_order(messages):
            role = m["role"]
            named = [("name", m["name"])] if m.get("name") else []
            if role == "system" and m.get("tools"):
                out.system("tool-declare", (
                    "## New Tools Available\nThe system dynamically extends the toolset via "
                    "lazy-loading.\nYou have access to all existing and extended tools.\nHere "
                    "are the specs for the extended tools.\n\n"
                    f"```json\n{_compact(deep_sort(m['tools']))}\n```"))
            elif role in ("system", "user"):
                out.message([("role", role), *named], m.get("content"))
            elif role == "tool":
                results += 1
                name = m.get("tool", m.get("name"))
                if name is None and results <= len(calls):
                    name = calls[results - 1].get("function", calls[results - 1])["name"]
                if name is None:
                    raise ValueError("a tool message needs `name` or a preceding assistant "
                                     "tool call it answers")
                out.message([("role", "tool"), ("tool", name), ("index", results)],
                            m.get("content"))
            else:  # assistant
                calls, results = m.get("tool_calls") or [], 0
                out.open("message", [("role", "assistant"), *named])
                self._assistant(out, m, thinking)
                out.close("message")
                out.control(END_OF_MSG)
        self._request_messages(out, kwargs)
        if add_generation_prompt:
            out.open("message", [("role", "assistant")])
            out.open("think" if thinking else "response")
        return out

    @staticmethod
    def _assistant(out: _Segments, m: dict[str, Any], thinking: bool) -> None:
        if thinking:  # every past turn gets the channel, empty where it had no reasoning
            out.open("think")
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning is not None and str(reasoning).strip():
                out.text(reasoning)
            out.close("think")
        out.open("response")
        out.content(m.get("content"))
        out.close("response")
        if not m.get("tool_calls"):
            return
        out.open("tools")
        for index, call in enumerate(m["tool_calls"], start=1):
            fn = call.get("function", call)
            out.open("call", [("tool", fn["name"]), ("index", index)])
            args, raw = _arguments(fn.get("arguments"))
            if raw is not None:
                out.open("json", [("type", "object")])
                out.text(raw)
                out.close("json")
            for key, value in args.items():
                out.open("argument", [("key", key), ("type", _xtml_type(value))])
                out.text(value if isinstance(value, str) else json.dumps(value,
                                                                         ensure_ascii=False))
                out.close("argument")
            out.close("call")
        out.close("tools")

    @staticmethod
    def _request_messages(out: _Segments, kwargs: dict[str, Any]) -> None:
        """The tool choice and the response format, after the conversation."""
        choice = kwargs.get("tool_choice")
        if choice in ("required", "none"):
            must = "MUST call tools" if choice == "required" else "MUST NOT call any tools"
            out.system("tool-choice", f"The system is invoked with `tool_choice={choice}`.\n"
                       f"You {must} in the next message.")
        rf = kwargs.get("response_format")
        kind = rf.get("type") if isinstance(rf, dict) else rf
        if kind not in ("json_object", "json_schema"):
            return
        body = (f"The system is invoked with `response_format={kind}`.\nYour response must "
                "be raw JSON data without markdown code blocks (```json) or any additional "
                "formatting.")
        if kind == "json_schema":
            spec = rf.get("json_schema") or {}
            schema = spec.get("schema", spec.get("json_schema", spec)) \
                if isinstance(spec, dict) else spec
            body += ("\nThe JSON data must match the following schema:\n"
                     f"```json\n{_compact(deep_sort(schema))}\n```")
        out.system("response-format", body)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return "".join(t for t, _ in self.segments(messages, tools, add_generation_prompt,
                                                   **kwargs))

    def render_ids(self, tok: Tokenizer, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = True, **kwargs: Any) -> tuple[str, list[int]]:
        text, ids, _ = self.render_with_images(tok, messages, tools, add_generation_prompt,
                                               **kwargs)
        return text, ids

    def render_with_images(self, tok: Tokenizer, messages: list[dict[str, Any]],
                           tools: list[dict[str, Any]] | None = None,
                           add_generation_prompt: bool = True, **kwargs: Any,
                           ) -> tuple[str, list[int], list[dict[str, Any]]]:
        """The text, its ids (one `<|media_pad|>` per image) and the image parts in order."""
        missing = [t for t in CONTROL_TOKENS if t not in tok.special_tokens]
        if missing:
            raise ValueError(f"Kimi K3's chat format needs the tokenizer's {missing[0]} token")
        out = self._render(messages, tools, add_generation_prompt, **kwargs)
        if out.images and MEDIA_PAD not in tok.special_tokens:
            raise ValueError(f"images need the tokenizer's {MEDIA_PAD} token")
        ids: list[int] = []
        for text, control in out.items:
            ids.extend([tok.special_tokens[text]] if control else tok.encode_ordinary(text))
        return "".join(t for t, _ in out.items), ids, out.images
