"""Chat template: builtin Kimi K2 format renders exact strings, markers tokenize to Kimi's special
ids, checkpoint templates override it, and bad requests are ValueErrors naming the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kdaserve.server.chat_template import (
    BUILTIN_KIMI_TEMPLATE,
    DEFAULT_SYSTEM_PROMPT,
    ChatTemplate,
)
from kdaserve.tokenizer import Tokenizer
from kdaserve.tokenizer_writer import write_kimi_tokenizer

SYS = f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "查询天气 (weather)",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {"city": {"type": "string", "description": "City name"}},
        },
    },
}


@pytest.fixture(scope="module")
def builtin() -> ChatTemplate:
    return ChatTemplate()


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kimi_tok")
    write_kimi_tokenizer(out, 4096)
    return out


def test_default_system_prompt_and_generation_prompt(builtin: ChatTemplate) -> None:
    text = builtin.render([{"role": "user", "content": "Hi"}])
    assert text == SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|>" + GEN
    no_gen = builtin.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_gen == SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|>"


def test_multi_turn_with_own_system_and_names(builtin: ChatTemplate) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?", "name": "alice"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ]
    assert builtin.render(messages) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>alice<|im_middle|>2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>4<|im_end|>"
        "<|im_user|>user<|im_middle|>and 3+3?<|im_end|>" + GEN
    )


def test_system_not_first_still_gets_default(builtin: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    assert builtin.render(messages, add_generation_prompt=False) == (
        SYS + "<|im_user|>user<|im_middle|>a<|im_end|>"
        "<|im_system|>system<|im_middle|>late<|im_end|>"
    )


def test_tools_declared_first_as_compact_json(builtin: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "Weather in Beijing?"}]
    text = builtin.render(messages, tools=[WEATHER_TOOL])
    declared = json.dumps([WEATHER_TOOL], separators=(",", ":"), ensure_ascii=False,
                          sort_keys=True)
    assert text == (
        f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>"
        + SYS
        + "<|im_user|>user<|im_middle|>Weather in Beijing?<|im_end|>"
        + GEN
    )
    # Keys sorted at every level (Moonshot's tokenizer deep-sorts tools before rendering), no
    # spaces, non-ASCII not escaped.
    assert '[{"function":{"description":"查询天气' in text
    # An empty tools list declares nothing, like `if tools` in Kimi's template.
    assert builtin.render([{"role": "user", "content": "x"}], tools=[]).startswith(SYS)


def test_assistant_tool_calls_and_tool_results(builtin: ChatTemplate) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Beijing and Shanghai?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Beijing"}'},
                },
                {   # object arguments -> tojson with HF's default separators, like K2's template
                    "id": "functions.get_weather:1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "上海"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather",
         "content": '{"weather": "Sunny"}'},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "Rain"},
    ]
    assert builtin.render(messages, tools=[WEATHER_TOOL]).split("<|im_end|>", 2)[2] == (
        "<|im_user|>user<|im_middle|>Weather in Beijing and Shanghai?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}'
        "<|tool_call_end|>"
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "上海"}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n"
        '{"weather": "Sunny"}<|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\nRain<|im_end|>"
        + GEN
    )


def test_tool_call_without_id_gets_kimi_id(builtin: ChatTemplate) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "a", "arguments": "{}"}},
            {"id": "", "function": {"name": "b", "arguments": "{}"}},
        ]},
    ]
    text = builtin.render(messages, add_generation_prompt=False)
    assert text.endswith(
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_call_begin|>functions.b:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>"
    )


def test_list_content_parts_are_joined(builtin: ChatTemplate) -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    text = builtin.render([{"role": "system", "content": parts},
                           {"role": "user", "content": parts}], add_generation_prompt=False)
    assert text == (
        "<|im_system|>system<|im_middle|>Hello, world<|im_end|>"
        "<|im_user|>user<|im_middle|>Hello, world<|im_end|>"
    )


def test_pydantic_style_none_fields_are_ignored(builtin: ChatTemplate) -> None:
    # A server dumping its request models sends explicit nulls for unset optional fields.
    message = {"role": "user", "content": "Hi", "name": None, "tool_calls": None,
               "tool_call_id": None}
    assert builtin.render([message]) == SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|>" + GEN


def test_render_then_encode_uses_special_ids(builtin: ChatTemplate, kimi_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(kimi_dir)
    special = tok.special_tokens
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Beijing"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
    ]
    text = builtin.render(messages, tools=[WEATHER_TOOL])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    base = 4096
    assert ids[0] == special["<|im_system|>"] == base + 10
    tail = [special["<|im_assistant|>"], *tok.encode("assistant"), special["<|im_middle|>"]]
    assert ids[-len(tail):] == tail
    expected_counts = {
        "<|im_system|>": 3, "<|im_user|>": 1, "<|im_assistant|>": 2, "<|im_middle|>": 6,
        "<|im_end|>": 5, "<|tool_calls_section_begin|>": 1, "<|tool_calls_section_end|>": 1,
        "<|tool_call_begin|>": 1, "<|tool_call_argument_begin|>": 1, "<|tool_call_end|>": 1,
    }
    for name, count in expected_counts.items():
        assert ids.count(special[name]) == count, name
    # Every special id in the prompt is one of these markers: none were split into plain text.
    assert {i for i in ids if i >= base} == {special[n] for n in expected_counts}


def _write_config_template(folder: Path, template: Any) -> None:
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")


def test_checkpoint_template_overrides_builtin(tmp_path: Path) -> None:
    write_kimi_tokenizer(tmp_path, 300)
    assert ChatTemplate.from_pretrained(tmp_path).source == BUILTIN_KIMI_TEMPLATE

    _write_config_template(tmp_path, "CFG{% for m in messages %}[{{ m.content }}]{% endfor %}")
    tmpl = ChatTemplate.from_pretrained(tmp_path)
    assert tmpl.origin.endswith("tokenizer_config.json")
    assert tmpl.render([{"role": "user", "content": "x"}]) == "CFG[x]"

    # HF's named-template list form: the "default" entry is used.
    _write_config_template(tmp_path, [{"name": "tool_use", "template": "T"},
                                      {"name": "default", "template": "D{{ messages | length }}"}])
    assert ChatTemplate.from_pretrained(tmp_path).render([{"role": "user", "content": "x"}]) == "D1"

    # A standalone chat_template.jinja wins over tokenizer_config.json, as in HF.
    (tmp_path / "chat_template.jinja").write_text(
        "{%- if thinking -%}T{%- else -%}F{%- endif -%}{{ tools | tojson }}", encoding="utf-8")
    tmpl = ChatTemplate.from_pretrained(tmp_path)
    assert tmpl.origin.endswith("chat_template.jinja")
    msgs = [{"role": "user", "content": "x"}]
    # kwargs (chat_template_kwargs) reach the template; tojson defaults match HF (spaced JSON).
    tool = {"type": "function", "function": {"name": "f"}}
    assert tmpl.render(msgs, tools=[tool], thinking=True) == (
        'T[{"function": {"name": "f"}, "type": "function"}]')  # keys deep-sorted
    assert tmpl.render(msgs) == "Fnull"


def test_from_pretrained_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ChatTemplate.from_pretrained(tmp_path / "nope")


def test_bad_named_template_list(tmp_path: Path) -> None:
    write_kimi_tokenizer(tmp_path, 300)
    _write_config_template(tmp_path, [{"name": "tool_use", "template": "T"}])
    with pytest.raises(ValueError, match="no 'default' template"):
        ChatTemplate.from_pretrained(tmp_path)


USER = {"role": "user", "content": "hi"}
CALL = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "tools", "match"),
    [
        ([], None, "messages must not be empty"),
        ("hi", None, "messages must be a list"),
        (["hi"], None, r"messages\[0\] must be an object"),
        ([{"role": "wizard", "content": "x"}], None, r"messages\[0\] has unknown role 'wizard'"),
        ([{"content": "x"}], None, "unknown role None"),
        ([USER, {"role": "user"}], None, r"messages\[1\] \(user\) has no content"),
        ([USER, {"role": "assistant", "content": None}], None, r"\(assistant\) has no content"),
        ([USER, {"role": "assistant", "tool_calls": []}], None, "has no content"),
        ([{"role": "user", "content": 5}], None, "content must be a string or a list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         None, r"content\[0\]: images need Kimi K3's chat format"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
         None, r"content\[0\].image_url must be an object with a url"),
        ([{"role": "user", "content": [{"type": "image", "image": "x"}]}],
         None, r"content\[0\] must be a .* part, got 'image'"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], None, "text must be a str"),
        ([{"role": "user", "content": "x", "name": 7}], None, "name must be a string"),
        ([USER, {"role": "tool", "content": "r"}], None, "needs a non-empty string tool_call_id"),
        ([USER, {"role": "tool", "content": "r", "tool_call_id": ""}], None, "tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], None,
         "only assistant messages may have tool_calls"),
        ([USER, {"role": "assistant", "content": None, "tool_calls": {"a": 1}}], None,
         r"tool_calls must be a list"),
        ([USER, {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}], None,
         r"tool_calls\[0\].function.name must be a non-empty string"),
        ([USER, {"role": "assistant", "content": None,
                 "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}], None,
         "arguments must be a JSON string or an object"),
        ([USER, {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}]}],
         None, "type must be 'function'"),
        ([USER], {"type": "function"}, "tools must be a list"),
        ([USER], [{"type": "retrieval"}], r"tools\[0\].type must be 'function'"),
        ([USER], [{"type": "function"}], r"tools\[0\].function must be an object"),
        ([USER], [{"type": "function", "function": {"description": "d"}}],
         r"tools\[0\].function.name must be a non-empty string"),
        ([USER], [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
         "parameters must be a JSON Schema object"),
        ([USER], [{"type": "function", "function": {"name": "f", "description": 1}}],
         "description must be a string"),
    ],
)
def test_validation_errors(builtin: ChatTemplate, messages: Any, tools: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        builtin.render(messages, tools=tools)


def test_assistant_with_only_tool_calls_is_valid(builtin: ChatTemplate) -> None:
    builtin.render([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}])
    builtin.render([USER, {"role": "assistant", "tool_calls": [CALL]}])


def test_template_errors_become_value_errors() -> None:
    raising = ChatTemplate("{{ raise_exception('roles must alternate') }}", origin="ckpt")
    with pytest.raises(ValueError, match="chat template from ckpt failed: roles must alternate"):
        raising.render([USER])
    # Sandbox: templates from the Hub must not reach Python internals.
    escaping = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template from builtin failed"):
        escaping.render([USER])
    # ImmutableSandboxedEnvironment: the request's messages cannot be mutated.
    with pytest.raises(ValueError, match="failed"):
        ChatTemplate("{{ messages.append(1) }}").render([USER])
    with pytest.raises(ValueError, match="failed on this request: TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([USER])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% if %}")
