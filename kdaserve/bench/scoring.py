"""`kdaserve bench scoring`: what prompt log-probabilities cost (lm-eval-style scoring).

Prefill-only requests (one generated token, as `echo` + `max_tokens` 0/1 sends) over random
prompts, with and without prompt logprobs, alternated in one run. Scoring adds the lm_head for
every prompt row (2 * hidden * vocab FLOPs each) plus a log-softmax and a top-k over the
vocabulary; the report gives both times, their ratio and the extra work's achieved GFLOP/s.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kdaserve.bench import write_result


def add_parser(sub: Any) -> None:
    p = sub.add_parser("scoring", help="prompt-logprob (scoring) cost vs plain prefill")
    p.add_argument("--model", default="bench")
    p.add_argument("--lengths", default="256,1024")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--top", type=int, default=1, help="top logprobs per prompt position")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_results/scoring.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import torch

    from kdaserve import LLM, SamplingParams

    llm = LLM(args.model, disable_prefix_cache=True)  # every prompt computed in full
    cfg = llm.config
    plain = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            prompt_logprobs=args.top)
    g = torch.Generator().manual_seed(0)
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        prompts = [torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
                   for _ in range(args.batch)]
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=scored)  # warm-up
        times: dict[str, list[float]] = {"plain": [], "scored": []}
        for _ in range(args.repeats):  # A/B alternated
            for name, params in (("plain", plain), ("scored", scored)):
                t0 = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                times[name].append(time.perf_counter() - t0)
                if name == "scored":
                    assert all(len(o.prompt_logprobs or []) == length for o in outs)
        t_plain, t_scored = min(times["plain"]), min(times["scored"])
        extra_flops = args.batch * (length - 1) * 2 * cfg.hidden_size * cfg.vocab_size
        row = {"length": length, "batch": args.batch, "plain_s": t_plain,
               "scored_s": t_scored, "plain_tok_s": args.batch * length / t_plain,
               "scored_tok_s": args.batch * length / t_scored,
               "scored_vs_plain": t_plain / t_scored, "extra_gflop": extra_flops / 1e9,
               "extra_gflop_s": extra_flops / 1e9 / max(t_scored - t_plain, 1e-9)}
        rows.append(row)
    print(f"model {args.model}: hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; "
          f"{args.batch} prompts per run, top {args.top}, best of {args.repeats}")
    print(f"{'length':>7} {'plain tok/s':>12} {'scored tok/s':>13} {'ratio':>6} "
          f"{'extra GFLOP':>12} {'extra GFLOP/s':>14}")
    for r in rows:
        print(f"{r['length']:>7} {r['plain_tok_s']:>12.0f} {r['scored_tok_s']:>13.0f} "
              f"{r['scored_vs_plain']:>6.2f} {r['extra_gflop']:>12.1f} "
              f"{r['extra_gflop_s']:>14.1f}")
    write_result(args.out, {"model": args.model, "top": args.top, "rows": rows})
