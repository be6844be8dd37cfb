"""`kdaserve bench spec`: single-stream speculative decoding on GSM8K-style prompts.

For each prompt and draft length K: tokens/s and mean acceptance length without speculation,
with the n-gram drafter, and with a self-draft (the drafts are the target's own greedy tokens,
recorded from the plain run): the ceiling of the verify-and-rollback mechanism, since random
weights give the n-gram drafter few acceptances.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kdaserve.bench.gsm8k import build_prompts, load_data
from kdaserve.spec.drafter import TokenDrafter


class SelfDrafter(TokenDrafter):
    """Proposes the target's recorded greedy continuation of each prompt."""

    def __init__(self, k: int, futures: dict[tuple[int, ...], list[int]]) -> None:
        self.k, self.futures = k, futures

    def propose_ids(self, ids: list[int], k: int | None = None) -> list[int]:
        k = self.k if k is None else k
        for prompt, future in self.futures.items():
            if tuple(ids[:len(prompt)]) == prompt:
                done = len(ids) - len(prompt)
                return future[done:done + k]
        return []


def _timed(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, list[list[int]]]:
    outs, total = [], 0.0
    for p in prompts:  # single stream: one request at a time
        t0 = time.perf_counter()
        outs.append(llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids)
        total += time.perf_counter() - t0
    return sum(map(len, outs)) / total, outs


def main(args: argparse.Namespace) -> None:
    from kdaserve import LLM, SamplingParams

    rows = load_data(args.data)
    texts, _ = build_prompts(rows, args.num_shots, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM(args.model, disable_prefix_cache=True)
    prompts = [plain.tokenizer.encode(t) for t in texts]
    _timed(plain, prompts[:1], params)  # warm-up
    base_tps, refs = _timed(plain, prompts, params)
    futures = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
    results: list[dict[str, Any]] = [{"drafter": "none", "k": 0, "tok_s": base_tps,
                                      "acceptance_length": 1.0, "speedup": 1.0}]
    print(f"{'drafter':>10} {'K':>3} {'tok/s':>8} {'accept len':>11} {'speedup':>8}")
    print(f"{'none':>10} {0:>3} {base_tps:>8.1f} {1.0:>11.2f} {1.0:>7.2f}x", flush=True)
    for k in [int(x) for x in args.k.split(",")]:
        for name in args.drafters.split(","):
            llm = LLM(args.model, disable_prefix_cache=True, speculative_algorithm="ngram",
                      speculative_num_draft_tokens=k)
            if name == "self":
                llm.engine.spec.drafter = SelfDrafter(k, futures)  # type: ignore[union-attr]
            tps, outs = _timed(llm, prompts, params)
            if outs != refs:
                raise RuntimeError(f"speculation ({name}, K={k}) changed greedy outputs")
            acc = llm.get_metrics()["spec_mean_acceptance_length"] or 1.0
            results.append({"drafter": name, "k": k, "tok_s": tps, "acceptance_length": acc,
                            "speedup": tps / base_tps})
            print(f"{name:>10} {k:>3} {tps:>8.1f} {acc:>11.2f} {tps / base_tps:>7.2f}x",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                                          "num_prompts": len(prompts), "rows": results},
                                         indent=2))
    print(f"wrote {args.out}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("spec", help="single-stream speculative decoding: n-gram and self-draft")
    p.add_argument("--model", default="bench")
    p.add_argument("--data", default=None)
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", default="2,4,8", help="draft lengths")
    p.add_argument("--drafters", default="ngram,self")
    p.add_argument("--out", default="bench_results/spec.json")
    p.set_defaults(func=main)
