"""Chat request validation beyond types: tools (request-level and "dynamic" tools declared on
system messages, as Kimi K3 takes them), tool_choice, response_format and the thinking switches.
Every problem is a `ValueError` naming the field, which the server answers with HTTP 400."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# OpenAI's function-name rule, minus a leading digit (Kimi's call ids `functions.NAME:IDX`
# and K3's tags would read a leading digit as an index)
TOOL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
TOOL_CHOICES = ("none", "auto", "required")
EFFORTS = ("low", "high", "max")  # what Kimi-K3.jinja accepts
# the share of max_tokens a thinking request may reason for before its reasoning is closed
REASONING_SHARE = {"low": 0.25, "high": 0.5, "max": 0.75}
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "tool_choice",
                            "response_format")


def check_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """An OpenAI `tools` array of function tools; returns it."""
    if not isinstance(tools, list):
        raise ValueError(f"{where} must be a list of tools, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, Mapping):
            raise ValueError(f"{at} must be an object, got {type(tool).__name__}")
        if tool.get("type") != "function":
            raise ValueError(f"{at}.type must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{at}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{at}.function.name must be a non-empty string")
        if not TOOL_NAME_RE.fullmatch(name):
            raise ValueError(f"{at}.function.name must match {TOOL_NAME_RE.pattern} "
                             f"(letters, digits, _ and -, at most 64, not starting with a "
                             f"digit), got {name!r}")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{at}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ValueError(f"{at}.function.parameters must be a JSON Schema object")
        strict = fn.get("strict", tool.get("strict"))
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{at}.function.strict must be a boolean")
    return tools


def dynamic_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools declared on system messages (K3's dynamic tools), checked; in message order."""
    found: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if "tools" not in m:
            continue
        if m.get("role") != "system":
            raise ValueError(f"messages[{i}]: only system messages may declare tools, "
                             f"not {m.get('role')!r}")
        if m.get("content") not in (None, ""):
            raise ValueError(f"messages[{i}]: a system message declaring tools must have "
                             "empty content (the template renders only the declarations)")
        found += check_tools(m["tools"], f"messages[{i}].tools")
    return found


def check_unique(tools: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for t in tools:
        name = t["function"]["name"]
        if name in seen:
            raise ValueError(f"tool name {name!r} is declared more than once")
        seen.add(name)


def resolve_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    """`none` / `auto` / `required` or {"type": "function", "function": {"name": ...}}."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {TOOL_CHOICES} or a function "
                             f"object, got {choice!r}")
        if choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs at least one tool in tools (or in "
                             "a system message)")
        return choice
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or \
            not isinstance(choice.get("function"), Mapping):
        raise ValueError("tool_choice object must be {'type': 'function', 'function': "
                         "{'name': ...}}")
    name = choice["function"].get("name")
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    return dict(choice)


@dataclass(frozen=True)
class ResponseFormat:
    kind: str  # "text", "json_object" or "json_schema"
    schema: dict[str, Any] | None = None


def parse_response_format(raw: Any) -> ResponseFormat:
    if raw is None:
        return ResponseFormat("text")
    if not isinstance(raw, Mapping):
        raise ValueError("response_format must be an object")
    kind = raw.get("type")
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be text, json_object or json_schema, "
                         f"got {kind!r}")
    spec = raw.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError("response_format.json_schema must be an object with name and schema")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ValueError("response_format.json_schema.name must be 1-64 letters, digits, _ "
                         f"or -, got {name!r}")
    if "schema" not in spec:
        raise ValueError("response_format.json_schema.schema is required")
    schema = spec["schema"]
    if not isinstance(schema, Mapping):
        raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError("response_format.json_schema.strict must be a boolean")
    return ResponseFormat("json_schema", dict(schema))


def resolve_thinking(thinking: Any, reasoning_effort: Any, template_kwargs: dict[str, Any],
                     default: bool) -> tuple[bool, str | None]:
    """(thinking on, effort) from `chat_template_kwargs.thinking` (open-source style), Kimi's
    top-level `thinking: {type, effort, keep}` and `reasoning_effort`; `thinking.effort` wins
    over `reasoning_effort`, as Moonshot's API does."""
    on, effort = default, None
    if thinking is not None:
        if not isinstance(thinking, Mapping):
            raise ValueError("thinking must be an object like {'type': 'enabled'}")
        kind = thinking.get("type", "enabled")
        if kind not in ("enabled", "disabled"):
            raise ValueError(f"thinking.type must be enabled or disabled, got {kind!r}")
        on = kind == "enabled"
        effort = thinking.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise ValueError(f"thinking.effort must be one of {EFFORTS}, got {effort!r}")
    if effort is None and reasoning_effort is not None:
        if reasoning_effort not in EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {EFFORTS}, got "
                             f"{reasoning_effort!r}")
        effort = reasoning_effort
    if "thinking" in template_kwargs:
        if not isinstance(template_kwargs["thinking"], bool):
            raise ValueError("chat_template_kwargs.thinking must be a boolean")
        on = template_kwargs["thinking"]
    if "thinking_effort" in template_kwargs:
        effort = template_kwargs["thinking_effort"]
        if effort not in EFFORTS:
            raise ValueError(f"chat_template_kwargs.thinking_effort must be one of {EFFORTS}")
    return on, effort


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError("chat_template_kwargs must be an object")
    bad = [k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS]
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {bad[0]!r}: it is a request field")
    return dict(kwargs)
