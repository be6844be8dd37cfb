"""`kdaserve bench spec`: single-stream speculative decoding on GSM8K-style prompts.

For each draft length K: tokens/s and mean acceptance length without speculation and with each
drafter: `ngram`; `self`, the target's own greedy tokens recorded from the plain run (the
ceiling of the verify-and-rollback mechanism, drafting free); `self-half`, the same with the
drafts after the first ceil(K/2) corrupted (a fixed partial acceptance: every verify rolls
back, which prices the KDA state rollback); `draft-self`, the draft-model
drafter with the target itself as draft (full acceptance, paying a real draft model);
`draft-small`, a 2-layer random draft with the target's vocabulary; `block`, a random block
drafter (random weights: acceptance near 0, the cost of the mechanism). Outputs are checked
identical to the plain run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kdaserve.bench import write_result
from kdaserve.bench.gsm8k import build_prompts, load_data
from kdaserve.speculative.drafter import TokenDrafter

DRAFTERS = ("ngram", "self", "self-half", "draft-self", "draft-small", "block")


class SelfDrafter(TokenDrafter):
    """Proposes the target's recorded greedy continuation of each prompt; with `accept`, the
    drafts after the first `accept` are corrupted (shifted by one in the vocabulary)."""

    def __init__(self, k: int, futures: dict[tuple[int, ...], list[int]],
                 accept: int | None = None, vocab: int = 1) -> None:
        self.k, self.futures, self.accept, self.vocab = k, futures, accept, vocab

    def propose_ids(self, ids: list[int], k: int | None = None) -> list[int]:
        k = self.k if k is None else k
        for prompt, future in self.futures.items():
            if tuple(ids[:len(prompt)]) == prompt:
                done = len(ids) - len(prompt)
                drafts = future[done:done + k]
                if self.accept is None:
                    return drafts
                return drafts[:self.accept] + [(t + 1) % self.vocab
                                               for t in drafts[self.accept:]]
        return []


def _timed(llm: Any, prompts: list[list[int]],
           params: Any) -> tuple[float, float, list[list[int]]]:
    """Single stream, one request at a time: (end-to-end tok/s, decode tok/s, outputs).
    Decode tok/s counts the tokens after the first over the time after the first: the part
    speculation speeds up, without the prompt's prefill (which dominates short outputs)."""
    outs, total, decode_s = [], 0.0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        llm.engine.add_request(p, params)
        first, final = None, None
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if first is None and out.token_ids:
                    first = time.perf_counter()
                final = out if out.finished else final
        t1 = time.perf_counter()
        outs.append(final.token_ids)
        total += t1 - t0
        decode_s += t1 - (first or t1)
    n = sum(map(len, outs))
    return n / total, (n - len(outs)) / max(decode_s, 1e-9), outs


def _drafter_kwargs(name: str, plain: Any, k: int, workdir: Path) -> dict[str, Any]:
    """EngineConfig fields for one drafter; random draft checkpoints are written to workdir
    (once) with the target's vocabulary and hidden size."""
    from kdaserve.checkpoint import make_checkpoint
    from kdaserve.config import DENSE, KDA, MLA, MOE
    from kdaserve.speculative.block import make_block_drafter

    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r} ({', '.join(DRAFTERS)})")
    if name in ("ngram", "self", "self-half"):
        return {"speculative_algorithm": "ngram"}
    if name == "draft-self":
        return {"speculative_algorithm": "draft", "speculative_draft_model": str(plain.path)}
    path = workdir / f"{name}-{k}"
    if name == "draft-small" and not path.is_dir():
        config = replace(plain.config, num_hidden_layers=2, layer_types=(KDA, MLA),
                         mlp_types=(DENSE, MOE))
        make_checkpoint(path, config, seed=1, with_tokenizer=False)
    if name == "block" and not path.is_dir():
        make_block_drafter(path, plain.config, block_size=k, seed=1)
    return {"speculative_algorithm": "draft" if name == "draft-small" else "block",
            "speculative_draft_model": str(path)}


def main(args: argparse.Namespace) -> None:
    from kdaserve import LLM, SamplingParams

    rows = load_data(args.data)
    texts, _ = build_prompts(rows, args.num_shots, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM(args.model, disable_prefix_cache=True)
    prompts = [plain.tokenizer.encode(t) for t in texts]
    _timed(plain, prompts[:1], params)  # warm-up
    base_tps, base_dec, refs = _timed(plain, prompts, params)
    results: list[dict[str, Any]] = [{"drafter": "none", "k": 0, "tok_s": base_tps,
                                      "decode_tok_s": base_dec, "acceptance_length": 1.0,
                                      "speedup": 1.0, "decode_speedup": 1.0}]
    print(f"{'drafter':>11} {'K':>3} {'tok/s':>8} {'speedup':>8} {'decode tok/s':>13} "
          f"{'speedup':>8} {'accept len':>11}")
    _row(results[0])
    workdir = Path(tempfile.mkdtemp(prefix="kdaserve-spec-"))  # random draft checkpoints
    try:
        _run_drafters(args, plain, prompts, params, refs, results, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    write_result(args.out, {"model": args.model, "max_tokens": args.max_tokens,
                            "num_prompts": len(prompts), "rows": results})
    print(f"wrote {args.out}")


def _run_drafters(args: argparse.Namespace, plain: Any, prompts: list[list[int]], params: Any,
                  refs: list[list[int]], results: list[dict[str, Any]],
                  workdir: Path) -> None:
    from kdaserve import LLM

    futures = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
    for k in [int(x) for x in args.k.split(",")]:
        for name in args.drafters.split(","):
            llm = LLM(args.model, disable_prefix_cache=True, speculative_num_draft_tokens=k,
                      **_drafter_kwargs(name, plain, k, workdir))
            if name in ("self", "self-half"):
                accept = -(-k // 2) if name == "self-half" else None
                llm.engine.spec.drafter = SelfDrafter(  # type: ignore[union-attr]
                    k, futures, accept, plain.config.vocab_size)
            tps, dec, outs = _timed(llm, prompts, params)
            if outs != refs:
                raise RuntimeError(f"speculation ({name}, K={k}) changed greedy outputs")
            acc = llm.get_metrics()["spec_mean_acceptance_length"] or 1.0
            results.append({"drafter": name, "k": k, "tok_s": tps, "decode_tok_s": dec,
                            "acceptance_length": acc, "speedup": tps / results[0]["tok_s"],
                            "decode_speedup": dec / results[0]["decode_tok_s"]})
            _row(results[-1])


def _row(r: dict[str, Any]) -> None:
    print(f"{r['drafter']:>11} {r['k']:>3} {r['tok_s']:>8.1f} {r['speedup']:>7.2f}x "
          f"{r['decode_tok_s']:>13.1f} {r['decode_speedup']:>7.2f}x "
          f"{r['acceptance_length']:>11.2f}", flush=True)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("spec", help="single-stream speculative decoding, per drafter")
    p.add_argument("--model", default="bench")
    p.add_argument("--data", default=None)
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", default="2,4,8", help="draft lengths")
    p.add_argument("--drafters", default="ngram,self",
                   help=f"comma-separated, from {','.join(DRAFTERS)}")
    p.add_argument("--out", default="bench_results/spec.json")
    p.set_defaults(func=main)
