"""Tools as TypeScript declarations: identical to Moonshot's reference
(`tool_declaration_ts.encode_tools_to_typescript_style`, read from ../shared/kimi) on every JSON
Schema of the Kimi Vendor Verifier used as tool parameters (deep-sorted, as the reference
tokenizer passes them), on the verifier's tools, and None exactly where the reference fails."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kdaserve.server.chat_template import ChatTemplate, deep_sort
from kdaserve.server.tool_typescript import tools_to_typescript

KIMI = Path(__file__).resolve().parents[3] / "shared" / "kimi"
CASES = KIMI / "vendor-verifier" / "testdata" / "walle_validator_cases" / "validator_cases"
pytestmark = pytest.mark.skipif(not CASES.is_dir(), reason="needs ../shared/kimi")


def reference() -> Any:
    spec = importlib.util.spec_from_file_location(
        "tool_declaration_ts", KIMI / "tokenizer" / "tool_declaration_ts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.encode_tools_to_typescript_style


def schemas() -> list[Any]:
    out = []
    for path in sorted(CASES.glob("*/valid.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def test_matches_the_reference_on_every_verifier_schema() -> None:
    ref = reference()
    checked = failed = 0
    for i, schema in enumerate(schemas()):
        for params in (schema, {"type": "object", "properties": {"value": schema},
                                "required": ["value"], "description": "wrapped"}):
            tools = deep_sort([{"type": "function", "function": {
                "name": f"case_{i}", "description": "A tool.\n\nSecond line.",
                "parameters": params}}])
            try:
                expected = ref(tools)
            except Exception:  # noqa: BLE001 - the reference tokenizer then passes None
                expected = None
            assert tools_to_typescript(tools) == expected, json.dumps(params)
            checked += 1
            failed += expected is None
    assert checked > 400 and failed < checked / 4  # most schemas are expressible


def test_template_gets_tools_ts_str() -> None:
    tmpl = ChatTemplate("{{ tools_ts_str }}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "City"}},
        "required": ["city"]}}}]
    assert tmpl.render([{"role": "user", "content": "x"}], tools=tools) == reference()(tools)
