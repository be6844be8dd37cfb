"""Structured outputs in the engine: every constrained output of a random-weight model is valid
(json_schema checked by `jsonschema`, regex by `re`, the Kimi tool-call grammar by our parser),
in mixed batches, with n > 1, sampled, on tight budgets, with the prefix cache and with
speculative decoding (drafts checked against the grammar, rejected ones rolled back)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kdaserve import LLM, SamplingParams
from kdaserve.request import Grammar
from kdaserve.server.tool_parser import parse_tool_calls
from kdaserve.speculative.scripted import ScriptedDrafter

from .conftest import clear_prompt

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "additionalProperties": False,
           "required": ["city", "temperature", "tags"],
           "properties": {"city": {"type": "string"}, "temperature": {"type": "number"},
                          "tags": {"type": "array", "items": {"type": "string"}},
                          "unit": {"enum": ["C", "F"]}}}
TREE = {"type": "object", "required": ["name"],  # recursive: closing must not recurse
        "properties": {"child": {"$ref": "#"}, "name": {"type": "string"}}}
SCHEMAS = [WEATHER, TREE, {"type": "array", "items": {"type": "integer"}, "minItems": 2},
           {"anyOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "boolean"}]}]


def json_grammar(schema: dict) -> Grammar:
    return Grammar("json_schema", json.dumps(schema))


def valid(schema: dict, text: str | None) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> LLM:
    return LLM(tiny_ckpt)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [clear_prompt(llm, n, seed=900 + n) for n in (3, 17, 40)]


@pytest.mark.parametrize("max_tokens", [24, 64, 400])
def test_every_output_validates(llm: LLM, prompts: list[list[int]], max_tokens: int) -> None:
    """Greedy and sampled (n=2) requests per schema, beside unconstrained ones; a tight budget
    still ends in valid JSON (the forced close), finishing with "stop"."""
    params, schemas = [], []
    for schema in SCHEMAS:
        g = json_grammar(schema)
        params += [SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=g),
                   SamplingParams(temperature=1.0, max_tokens=max_tokens, grammar=g, seed=5,
                                  n=2, top_p=0.9)]
        schemas += [schema, schema]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[prompts[i % 3] for i in range(len(params))]
                        + prompts, sampling_params=params + [free] * 3)
    for out, schema in zip(outs, schemas, strict=False):
        for o in out.outputs:
            assert o.finish_reason == "stop", (o.text, schema)
            assert valid(schema, o.text), (o.text, schema)
            assert len(o.token_ids) <= max_tokens
    # the masks never touched the unconstrained requests
    alone = llm.generate(prompt_token_ids=prompts, sampling_params=free)
    assert [o.token_ids for o in outs[-3:]] == [o.token_ids for o in alone]
    llm.engine.check_integrity()


def test_json_object_regex_and_lark(llm: LLM, prompts: list[list[int]]) -> None:
    json_object = SamplingParams(temperature=0.0, max_tokens=40, grammar=Grammar("json_object"))
    regex = SamplingParams(temperature=1.0, seed=2, max_tokens=30,
                           grammar=Grammar("regex", r"(yes|no), [0-9]{1,3} (cats|dogs)"))
    # the model's tool-call format, special tokens included, arguments by a schema
    lark = ("start: <|tool_calls_section_begin|> <|tool_call_begin|> \"functions.get:0\" "
            "<|tool_call_argument_begin|> args <|tool_call_end|> <|tool_calls_section_end|>\n"
            "args: %json " + json.dumps(WEATHER) + "\n")
    call = SamplingParams(temperature=0.0, max_tokens=60, grammar=Grammar("lark", lark),
                          skip_special_tokens=False)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[json_object, regex, call])
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"(yes|no), [0-9]{1,3} (cats|dogs)", outs[1].text), outs[1].text
    rest, calls = parse_tool_calls(outs[2].text)
    assert rest == "" and len(calls) == 1 and calls[0].name == "get"
    assert valid(WEATHER, calls[0].arguments)
    llm.engine.check_integrity()


def test_prefix_cache_hits_keep_outputs(tiny_ckpt: Path, prompts: list[list[int]]) -> None:
    cached = LLM(tiny_ckpt)
    plain = LLM(tiny_ckpt, disable_prefix_cache=True)
    params = SamplingParams(temperature=0.0, max_tokens=48, grammar=json_grammar(WEATHER))
    long = prompts[2] * 4  # past a snapshot point
    ref = plain.generate(prompt_token_ids=[long], sampling_params=params)[0].token_ids
    for _ in range(2):  # the second run resumes from the cache
        assert cached.generate(prompt_token_ids=[long], sampling_params=params)[0].token_ids \
            == ref
    assert cached.get_metrics()["prefix_cache_hit_tokens"] > 0
    cached.engine.check_integrity()


@pytest.mark.parametrize("corrupt", [frozenset(), frozenset({1}), frozenset({0, 2})],
                         ids=["all", "some", "none"])
def test_speculation_keeps_constrained_outputs(tiny_ckpt: Path, llm: LLM,
                                               prompts: list[list[int]],
                                               corrupt: frozenset[int]) -> None:
    """Drafts of the constrained greedy continuation, some corrupted (often into tokens the
    grammar forbids, which are cut before verifying): outputs equal decoding without drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=120, grammar=json_grammar(WEATHER))
    refs = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    spec = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    futures = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
    drafter = ScriptedDrafter(None, 4, spec.config.vocab_size, futures, corrupt)
    spec.engine.spec.drafter = drafter
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == refs
    assert sum(n for n, _ in drafter.log) > 0  # drafts were verified
    if not corrupt:
        assert sum(a for _, a in drafter.log) > 0
    spec.engine.check_integrity()


def test_bad_grammars_are_value_errors(llm: LLM) -> None:
    for g in (Grammar("json_schema", "{not json"), Grammar("regex", "(unclosed"),
              Grammar("lark", "start: undefined_rule")):
        with pytest.raises(ValueError):
            llm.generate(["hi"], SamplingParams(max_tokens=4, grammar=g))
    # compiles, but no output ends: refused before generation, not aborted mid-way
    endless = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}
    with pytest.raises(ValueError, match="no output that ends"):
        llm.generate(["hi"], SamplingParams(max_tokens=4, grammar=json_grammar(endless)))
    with pytest.raises(ValueError, match="kind"):
        Grammar("xml", "")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=Grammar("json_object"), ignore_eos=True)
    llm.engine.check_integrity()
    assert llm.engine.get_metrics()["num_running"] == 0


def test_reasoning_budget_forces_the_end(llm: LLM, prompts: list[list[int]]) -> None:
    """After `reasoning_budget` tokens without it, `reasoning_end` is written token by token;
    with a grammar that expects it, the constrained part follows and validates."""
    tok = llm.tokenizer
    marker = "<|tool_calls_section_end|>"  # a special token standing in for </think>
    end = (tok.token_to_id(marker), *tok.encode("ok"))
    plain = SamplingParams(temperature=1.0, seed=1, max_tokens=20, reasoning_budget=5,
                           reasoning_end=end, skip_special_tokens=False)
    lark = (f'start: TEXT {marker} "ok" body\nTEXT: /[a-z ]*/\n'
            f"body: %json {json.dumps(WEATHER)}\n")
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=60, reasoning_budget=5,
                                 reasoning_end=end, grammar=Grammar("lark", lark))
    outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=[plain, constrained])
    n = len(end)
    assert tuple(outs[0].token_ids[5:5 + n]) == end and len(outs[0].token_ids) == 20
    ids = outs[1].token_ids
    at = ids.index(end[0])
    assert at <= 5 + 2  # forced once the budget is spent (a grammar may delay it a token)
    assert valid(WEATHER, tok.decode(ids[at + n:]))
    llm.engine.check_integrity()
