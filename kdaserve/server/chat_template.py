"""OpenAI chat messages -> prompt text for Kimi models: a checkpoint's own Jinja chat template
(rendered the way HF `apply_chat_template` renders it) or our builtin Kimi K2 template, with
request validation that turns bad messages/tools into `ValueError`s the server maps to HTTP 400."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kdaserve.server.chat_request import check_tools
from kdaserve.server.tool_typescript import tools_to_typescript
from kdaserve.server.untrusted import Untrusted
from kdaserve.tokenizer import Tokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
ROLES = ("system", "user", "assistant", "tool")

# Kimi K2 chat format, written to match Moonshot's K2 `chat_template.jinja` (Kimi-K2-Instruct /
# K2-Thinking; Kimi-Linear-Instruct uses the same K2 format) for text-only requests:
# - a `tool_declare` system turn first, with the OpenAI `tools` array as compact JSON;
# - the default system prompt when messages[0] is not a system message. Moonshot's older
#   Instruct template left a stray "\n" after it (an untrimmed `{% endif %}`); K2-Thinking's
#   "fix-default-system-prompt" revision dropped it and so do we. A checkpoint that ships its own
#   template is rendered with that template instead (`ChatTemplate.from_pretrained`);
# - turn header `<|im_user|>`/`<|im_assistant|>`/`<|im_system|>` (system, tool and any other
#   role) + `name or role` + `<|im_middle|>`; every turn ends with `<|im_end|>`;
# - assistant tool calls: content, then one tool-calls section; ids are passed through as the
#   client sent them back (K2-Thinking does the same), and only a missing id is synthesised as
#   `functions.{name}:{idx}` with idx 0-based within the turn, the form the model emits;
# - string arguments verbatim, object arguments as `tojson` (HF default separators, like K2);
# - tool results: `## Return of {tool_call_id}\n{content}` under `name or "tool"`.
# - dynamic tools (K3's tools on a system message, content empty) become a `tool_declare` turn
#   at that point of the conversation.
# No `thinking` switch: neither K2-Instruct nor Kimi-Linear templates have one (K2-Thinking
# always renders `<think></think>` history, K2.5+ add `thinking`); extra kwargs still reach
# checkpoint templates. Every tag trims whitespace so the output has no stray newlines.
BUILTIN_KIMI_TEMPLATE = (
    "{%- macro render_content(message) -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{- tools | tojson(separators=(',', ':')) -}}<|im_end|>"
    "{%- endif -%}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and message.get('tools') -%}"
    "<|im_system|>tool_declare<|im_middle|>"
    "{{- message['tools'] | tojson(separators=(',', ':')) -}}<|im_end|>"
    "{%- continue -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>"
    "{%- endif -%}"
    "{{- message.get('name') or message['role'] -}}<|im_middle|>"
    "{%- if message['role'] == 'tool' -%}"
    "## Return of {{ message['tool_call_id'] }}{{- '\\n' -}}"
    "{%- endif -%}"
    "{{- render_content(message) -}}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>"
    "{{- call.get('id') or ('functions.' ~ call['function']['name'] ~ ':' ~ loop.index0) -}}"
    "<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{- call['function']['arguments'] -}}"
    "{%- else -%}{{- call['function']['arguments'] | tojson -}}"
    "{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's override of Jinja's `tojson`: no HTML escaping, no key sorting, non-ASCII kept, and
    # `separators`/`indent` exposed. Same defaults as HF (", " / ": ") so checkpoint templates
    # written for `apply_chat_template` render byte-identically; compact output is requested
    # explicitly with `separators=(',', ':')`, as Kimi's templates do for the tools array.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    # Mirrors HF's chat-template environment: templates from the Hub are untrusted code, so they
    # run sandboxed and cannot mutate their inputs; trim/lstrip_blocks change the output text, so
    # they must match HF for prompts (and prompt token counts) to be identical.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. `origin` says where it came from ("builtin" or a file path)."""

    def __init__(self, source: str = BUILTIN_KIMI_TEMPLATE, origin: str = "builtin") -> None:
        self.source = source
        self.origin = origin
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template from {origin} does not compile: {e}") from e

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTemplate:
        """The checkpoint's template: `chat_template.jinja`, else `chat_template` in
        `tokenizer_config.json` (HF gives the standalone file precedence too), else the builtin."""
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
        jinja_path = folder / CHAT_TEMPLATE_FILE
        if jinja_path.is_file():
            return cls(jinja_path.read_text(encoding="utf-8"), str(jinja_path))
        config_path = folder / TOKENIZER_CONFIG_FILE
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
            source = _config_template(config.get("chat_template"), config_path)
            if source is not None:
                return cls(source, str(config_path))
        return cls()

    def render_ids(self, tok: Tokenizer, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = True, **kwargs: Any) -> tuple[str, list[int]]:
        """(prompt text, its token ids) with no control token from anything the client sent
        (untrusted.py): the request validated as it is, then rendered from escaped values."""
        validate_messages(messages)
        if tools is not None:
            check_tools(tools, "tools")
        guard = _guard(tok)
        rendered = self.render(guard.escape(messages),
                               tools=None if tools is None else guard.escape(tools),
                               add_generation_prompt=add_generation_prompt,
                               **guard.escape(kwargs))
        return guard.restore(rendered), guard.encode(rendered)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Prompt text for `messages` (OpenAI chat format) and optional OpenAI `tools`. `kwargs`
        (e.g. a request's `chat_template_kwargs`) become template variables."""
        validate_messages(messages)
        images = image_parts(messages)  # a template would render them as text, or drop them
        if images:
            raise ValueError(f"{images[0][0]}: images need Kimi K3's chat format, not this chat "
                             f"template ({self.origin})")
        if tools is not None:
            check_tools(tools, "tools")
            tools = deep_sort(tools)  # as Moonshot's apply_chat_template: keys sorted
            ts = tools_to_typescript(tools)
            if ts:  # for templates that declare tools in TypeScript (K2.5 style)
                kwargs.setdefault("tools_ts_str", ts)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as e:  # includes raise_exception() and sandbox violations
            raise ValueError(f"chat template from {self.origin} failed: {e}") from e
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
            # A template doing arithmetic/indexing on request data it did not expect.
            raise ValueError(
                f"chat template from {self.origin} failed on this request: "
                f"{type(e).__name__}: {e}"
            ) from e


@functools.cache
def _guard(tok: Tokenizer) -> Untrusted:
    """One per tokenizer (a server has one): its pattern of every special spelling is
    compiled once, not per request."""
    return Untrusted(tok)


def deep_sort(obj: Any) -> Any:
    """Every mapping's keys sorted, recursively (list order kept)."""
    if isinstance(obj, Mapping):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


def _config_template(value: Any, config_path: Path) -> str | None:
    """`chat_template` of a tokenizer config: a string, or HF's list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            item.get("name"): item.get("template") for item in value if isinstance(item, dict)
        }
        if isinstance(named.get("default"), str):
            return named["default"]
        names = sorted(map(str, named))
        raise ValueError(f"chat_template in {config_path} has no 'default' template: {names}")
    raise ValueError(
        f"chat_template in {config_path} must be a string or a list of named templates, "
        f"got {type(value).__name__}"
    )


def image_parts(messages: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, part) of each `image_url` part, in message order; messages as dicts or as the
    request's message models."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else getattr(m, "content", None)
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                found.append((f"messages[{i}].content[{j}]", part))
    return found


def validate_messages(messages: Any) -> None:
    """Raise `ValueError` naming the first problem in an OpenAI `messages` list."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where} has unknown role {role!r}; expected one of {list(ROLES)}")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{where}.name must be a string, got {type(name).__name__}")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise ValueError(f"{where}: only assistant messages may have tool_calls")
            _validate_tool_calls(tool_calls, where)
        content = message.get("content")
        if content is None:
            # OpenAI allows `content: null` exactly when the assistant only called tools.
            # ...and a system message may only declare (dynamic) tools
            if not ((role == "assistant" and tool_calls) or
                    (role == "system" and message.get("tools"))):
                raise ValueError(f"{where} ({role}) has no content")
        else:
            _validate_content(content, where, role)
        if role == "tool":
            tool_call_id = message.get("tool_call_id")
            if not isinstance(tool_call_id, str) or not tool_call_id:
                raise ValueError(f"{where} (tool) needs a non-empty string tool_call_id")


def _validate_content(content: Any, where: str, role: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(
            f"{where}.content must be a string or a list of text parts, "
            f"got {type(content).__name__}"
        )
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, Mapping) and part.get("type") == "image_url":
            # checked here, taken only where the chat format and the model take images
            # (chat.py): a model without them refuses the request rather than mis-prompt
            if role != "user":
                raise ValueError(f"{at}: images go in user messages, not {role!r} ones")
            _validate_image(part.get("image_url"), f"{at}.image_url")
            continue
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{at} must be a {{'type': 'text', 'text': ...}} or image_url "
                             f"part, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{at}.text must be a string")


def _validate_image(image: Any, at: str) -> None:
    if not isinstance(image, Mapping) or not isinstance(image.get("url"), str):
        raise ValueError(f"{at} must be an object with a url string")
    unknown = sorted(set(image) - {"url", "detail"})
    if unknown:
        raise ValueError(f"{at}.{unknown[0]} is not supported")
    if image.get("detail", "auto") != "auto":  # K3 sees each image at its own resolution
        raise ValueError(f"{at}.detail {image['detail']!r} is not supported (only auto: the "
                         "image is seen at its own resolution, up to the processor's limit)")


def _validate_tool_calls(tool_calls: Any, where: str) -> None:
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}.tool_calls must be a list, got {type(tool_calls).__name__}")
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{at} must be an object, got {type(call).__name__}")
        if call.get("type", "function") not in ("function", None):
            raise ValueError(f"{at}.type must be 'function', got {call.get('type')!r}")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ValueError(f"{at}.id must be a string, got {type(call_id).__name__}")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{at}.function must be an object")
        fn_name = function.get("name")
        if not isinstance(fn_name, str) or not fn_name:
            raise ValueError(f"{at}.function.name must be a non-empty string")
        if not isinstance(function.get("arguments"), str | Mapping):
            raise ValueError(f"{at}.function.arguments must be a JSON string or an object")
