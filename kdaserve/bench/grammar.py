"""`kdaserve bench grammar`: what structured outputs cost.

1. Generation tok/s with and without a JSON-schema grammar at batch 1 and 16 (same prompts,
   same token counts: the constrained requests are sampled with `ignore_eos` off and their
   lengths are what they are, so tok/s is output tokens over wall time).
2. The grammar engines on this model's vocabulary: compile time and the time to compute one
   next-token mask, llguidance (used) and xgrammar (if installed), over a recorded
   constrained output.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "required": ["city"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string"}}}}}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("grammar", help="structured-output overhead and grammar engines")
    p.add_argument("--model", default="bench")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch", default="1,16")
    p.add_argument("--out", default="bench_results/grammar.json")
    p.set_defaults(func=run)


def _generate(llm: Any, batch: int, params: Any) -> tuple[float, int]:
    prompts = [[100 + i, 200 + i, 300 + i] for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def _engines(llm: Any, tokens: list[int]) -> dict[str, dict[str, float]]:
    from kdaserve.engine.grammar import GrammarBackend
    from kdaserve.request import Grammar

    tok = llm.tokenizer
    out: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    backend = GrammarBackend(tok, llm.config.vocab_size, list(tok.eos_token_ids))
    setup = time.perf_counter() - t0
    g = Grammar("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    backend.compile(g)
    compile_s = time.perf_counter() - t0
    m = backend.matcher(g)
    row = backend.allocate_bitmask(1)[0]
    t0 = time.perf_counter()
    for t in tokens:
        m._fill(row)
        m.m.consume_token(t)
    out["llguidance"] = {"tokenizer_setup_s": setup, "compile_ms": compile_s * 1e3,
                         "mask_ms": (time.perf_counter() - t0) / len(tokens) * 1e3}
    try:
        import torch
        import xgrammar  # optional: not a dependency
    except ImportError:
        return out
    vocab = [tok.decode_bytes([i]) for i in range(tok.vocab_size)]
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo(vocab, vocab_size=llm.config.vocab_size,
                                  stop_token_ids=list(tok.eos_token_ids))
    compiler = xgrammar.GrammarCompiler(info)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    t0 = time.perf_counter()
    n = 0
    for t in tokens:
        matcher.fill_next_token_bitmask(mask)
        if not matcher.accept_token(t):
            break
        n += 1
    del torch
    out["xgrammar"] = {"tokenizer_setup_s": setup, "compile_ms": compile_s * 1e3,
                       "mask_ms": (time.perf_counter() - t0) / max(n, 1) * 1e3}
    return out


def run(args: argparse.Namespace) -> None:
    from kdaserve.bench import write_result
    from kdaserve.llm import LLM
    from kdaserve.request import Grammar, SamplingParams

    llm = LLM(args.model)
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                     grammar=grammar)
        _generate(llm, batch, plain)  # warm-up
        dt_p, n_p = _generate(llm, batch, plain)
        dt_c, n_c = _generate(llm, batch, constrained)
        rows.append({"batch": batch, "plain_tok_s": n_p / dt_p, "json_tok_s": n_c / dt_c,
                     "ratio": (n_c / dt_c) / (n_p / dt_p), "json_tokens": n_c})
        print(f"batch {batch:3d}: plain {n_p / dt_p:7.1f} tok/s, json schema "
              f"{n_c / dt_c:7.1f} tok/s ({rows[-1]['ratio']:.2f}x, {n_c} tokens)")
    recorded = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, grammar=grammar))[0].token_ids
    engines = _engines(llm, recorded)
    for name, e in engines.items():
        print(f"{name}: tokenizer setup {e['tokenizer_setup_s']:.2f} s, compile "
              f"{e['compile_ms']:.1f} ms, mask {e['mask_ms']:.3f} ms/token")
    write_result(args.out, {"model": str(llm.path), "vocab": llm.config.vocab_size,
                            "throughput": rows, "engines": engines})
