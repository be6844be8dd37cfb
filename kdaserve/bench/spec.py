"""`kdaserve bench spec`: speculative decoding per drafter, draft length and batch size, on
GSM8K test prompts.

For each batch size B, the prompts run in waves of B concurrent requests (greedy, fixed
length), first without speculation, then with each drafter at each draft length K: output
tokens/s, decode tokens/s (the tokens after each request's first over the time after the
wave's last first token: the part speculation speeds up) and the mean acceptance length
(tokens per verify, accepted drafts + the target's token), and per block position the share
of verifies that drafted it and kept it. Each row is the fastest of `--repeats` runs, and
every output is checked identical to the run without speculation. A drafter row's speed-ups
are against plain runs interleaved with its own (one before each), not against the first
plain row: this host's speed drifts more between minutes than some drafters differ.

Drafters: `ngram` (prompt lookup); `draft` (a small model with the target's tokenizer:
`--draft-model`, default `train-lm --size draft`'s); `block` (the final-hidden-only block
drafter, `--block-drafter`) and `dspark` (taps + Markov + confidence heads,
`--dspark-drafter`), both from `train-drafter`. Mechanism ceilings: `self`, the target's own
recorded greedy tokens as drafts (all accepted, drafting free); `self-half`, the same with the
drafts after the first ceil(K/2) corrupted (a rollback every verify); `draft-self`, the
target as its own draft model (all accepted, paying a real draft model). K3's published
formats (`k3-dspark-mla`, `k3-dspark-gqa`, `dflash`) come from `--k3-drafters DIR/NAME`, or
are written there with random weights (their drafts are never kept: rows that measure what a
draft step costs, and that speculation which does not pay is stopped); K is their drafts a
step (DSpark's gamma, DFlash's block less one).

Each row also gives the Speculator's cost split (`Speculator.seconds`): ms per step of
drafting (proposals and a context drafter's context writes, over all steps), of a verify
forward and of a plain one, and of bookkeeping (saves, acceptance, rollback, hooks), with the
share of steps that drafted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from kdaserve.bench import write_result
from kdaserve.bench.gsm8k import build_prompts, load_data
from kdaserve.speculative.drafter import TokenDrafter

K3_FORMATS = ("k3-dspark-mla", "k3-dspark-gqa", "dflash")  # K3's published drafters
DRAFTERS = ("ngram", "draft", "block", "dspark", "self", "self-half", "draft-self", *K3_FORMATS)


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


def timed(llm: Any, prompts: list[list[int]], params: Any,
          batch: int) -> tuple[float, float, list[list[int]]]:
    """The prompts in waves of `batch` concurrent requests: (output tok/s, decode tok/s,
    outputs in prompt order)."""
    outs: list[list[int]] = []
    total, decode_s, decoded = 0.0, 0.0, 0
    for w in range(0, len(prompts), batch):
        wave = prompts[w:w + batch]
        t0 = time.perf_counter()
        rids = [llm.engine.add_request(p, params) for p in wave]
        started: set[str] = set()
        first_all, final = None, {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.token_ids:
                    started.add(out.rid)
                if out.finished:
                    final[out.rid] = out.token_ids
            if first_all is None and len(started) == len(wave):
                first_all = time.perf_counter()
        t1 = time.perf_counter()
        outs.extend(final[r] for r in rids)
        total += t1 - t0
        decode_s += t1 - (first_all or t1)
        decoded += sum(len(final[r]) for r in rids) - len(wave)
    n = sum(map(len, outs))
    return n / total, decoded / max(decode_s, 1e-9), outs


def ngram_acceptance(prompts: list[list[int]], refs: list[list[int]], k: int,
                     max_n: int, min_n: int) -> tuple[float, float]:
    """Greedy n-gram speculation replayed offline on the target's recorded outputs (exactly
    what the engine would see: greedy outputs do not depend on the drafts): (mean acceptance
    length per verify, tokens per target forward, verifies and plain decodes alike). Each
    verify keeps the drafts that match the continuation, plus one token."""
    from kdaserve.speculative.ngram import NgramDrafter

    d = NgramDrafter(k, max_n, min_n)
    verifies, emitted, forwards = 0, 0, 0
    for prompt, out in zip(prompts, refs, strict=True):
        pos = 1  # the first token comes from the prefill
        while pos < len(out):
            forwards += 1
            drafts = d.propose_ids(prompt + out[:pos], min(k, len(out) - pos - 1))
            j = 0
            while j < len(drafts) and drafts[j] == out[pos + j]:
                j += 1
            if drafts:
                verifies += 1
                emitted += j + 1
            pos += j + 1
    decoded = sum(len(out) - 1 for out in refs)
    return (emitted / verifies if verifies else 1.0), decoded / max(forwards, 1)


def tune_ngram(prompts: list[list[int]], refs: list[list[int]],
               ks: list[int]) -> list[dict[str, Any]]:
    rows = []
    for k in ks:
        for max_n in (2, 3, 4, 6, 8):
            for min_n in range(1, min(max_n, 4) + 1):
                acc, per_forward = ngram_acceptance(prompts, refs, k, max_n, min_n)
                rows.append({"k": k, "max_n": max_n, "min_n": min_n,
                             "acceptance_length": acc, "tokens_per_forward": per_forward})
    return rows


def best_of(llm: Any, prompts: list[list[int]], params: Any, batch: int,
            repeats: int) -> tuple[float, float, list[list[int]]]:
    """`timed` `repeats` times, the fastest run (this machine's run-to-run noise is 10-20%,
    more than some of the differences measured); outputs must not change between runs."""
    runs = [timed(llm, prompts, params, batch) for _ in range(repeats)]
    if any(r[2] != runs[0][2] for r in runs):
        raise RuntimeError("greedy outputs changed between repeated runs")
    return max(runs, key=lambda r: r[1])


def best_of_paired(llm: Any, plain: Any, prompts: list[list[int]], params: Any, batch: int,
                   repeats: int) -> tuple[tuple[float, float, list[list[int]]],
                                          tuple[float, float], list[float]]:
    """`best_of` for llm, with a plain run before each of its runs: (llm's fastest run, the
    fastest plain (tok/s, decode tok/s) beside it, each pair's decode speed-up). This host's
    speed drifts by 10-60% within minutes, so a ratio against one baseline run at the start
    says more about the drift than about the drafter; the pairs' ratios show the spread."""
    runs, base = [], []
    for _ in range(repeats):
        base.append(timed(plain, prompts, params, batch))
        runs.append(timed(llm, prompts, params, batch))
    if any(r[2] != runs[0][2] for r in runs + base):
        raise RuntimeError("greedy outputs changed between repeated runs")
    best = max(base, key=lambda r: r[1])
    pairs = [r[1] / p[1] for r, p in zip(runs, base, strict=True)]
    return max(runs, key=lambda r: r[1]), (best[0], best[1]), pairs


def _k3_drafter_kwargs(name: str, k: int, args: argparse.Namespace,
                       target: Path) -> dict[str, Any]:
    """One of K3's published formats, from `--k3-drafters DIR`/NAME, or written there with
    random weights (for the cost of a draft step: random drafts are never kept); K drafts:
    DSpark's gamma, DFlash's block of K + 1."""
    from kdaserve.config import ModelConfig
    from kdaserve.speculative.context_drafter import make_context_drafter

    path = Path(args.k3_drafters or f"{target}.k3-drafters") / name
    if not (path / "config.json").is_file():
        make_context_drafter(path, ModelConfig.from_pretrained(target), name, seed=0,
                             num_layers=args.k3_drafter_layers)
    width = {"speculative_dspark_block_size": k} if name != "dflash" else \
        {"speculative_num_draft_tokens": k + 1}
    return {"speculative_algorithm": "dflash" if name == "dflash" else "dspark",
            "speculative_draft_model": str(path), **width}


def _drafter_kwargs(name: str, k: int, args: argparse.Namespace,
                    target: Path) -> dict[str, Any]:
    from kdaserve.training.lm import cached_path

    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r} ({', '.join(DRAFTERS)})")
    if name in K3_FORMATS:
        return _k3_drafter_kwargs(name, k, args, target)
    if name in ("ngram", "self", "self-half"):
        return {"speculative_algorithm": "ngram", "speculative_ngram_max": args.ngram_max,
                "speculative_ngram_min": args.ngram_min, "speculative_num_draft_tokens": k}
    if name == "draft-self":
        return {"speculative_algorithm": "draft", "speculative_draft_model": str(target),
                "speculative_num_draft_tokens": k}
    path = {"draft": args.draft_model or cached_path("draft"),
            "block": args.block_drafter or Path(f"{target}.block"),
            "dspark": args.dspark_drafter or Path(f"{target}.dspark")}[name]
    if not Path(path, "config.json").is_file():
        how = ("kdaserve train-lm --size draft" if name == "draft" else
               f"kdaserve train-drafter --kind {name} --target {target} --out {path}")
        raise ValueError(f"no {name} drafter at {path}: make it with `{how}` or pass its path")
    hot = {"speculative_token_map": args.token_map} \
        if args.token_map and name in ("block", "dspark") else {}
    return {"speculative_algorithm": "draft" if name == "draft" else name,
            "speculative_draft_model": str(path), "speculative_num_draft_tokens": k, **hot}


def main(args: argparse.Namespace) -> None:
    from kdaserve import LLM, SamplingParams
    from kdaserve.training.lm import trained_model

    target = Path(args.model) if args.model else trained_model("target")
    rows = load_data(args.data)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    texts, _ = build_prompts(rows, args.num_shots, max(args.num_prompts, *batches))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM(target, disable_prefix_cache=True)
    prompts = [plain.tokenizer.encode(t) for t in texts]
    timed(plain, prompts[:1], params, 1)  # warm-up
    results: list[dict[str, Any]] = []
    ngram_rows: list[dict[str, Any]] = []
    print(f"{'B':>3} {'drafter':>10} {'K':>2} {'tok/s':>7} {'speedup':>8} {'decode tok/s':>13}"
          f" {'speedup':>8} {'accept len':>11}  kept by position")
    for b in batches:
        wave = prompts[:max(args.num_prompts, b)]
        tps, dec, refs = best_of(plain, wave, params, b, args.repeats)
        base = {"batch": b, "drafter": "none", "k": 0, "tok_s": tps, "decode_tok_s": dec,
                "acceptance_length": 1.0, "speedup": 1.0, "decode_speedup": 1.0,
                "kept_by_position": []}
        results.append(base)
        _row(base)
        futures = {tuple(p): r for p, r in zip(wave, refs, strict=True)}
        if args.tune_ngram and b == batches[0]:
            tuned = tune_ngram(wave, refs, [int(x) for x in args.k.split(",")])
            for r in sorted(tuned, key=lambda r: -r["tokens_per_forward"])[:5]:
                print(f"n-gram K={r['k']} max_n={r['max_n']} min_n={r['min_n']}: "
                      f"{r['tokens_per_forward']:.2f} tokens per target forward, acceptance "
                      f"length {r['acceptance_length']:.2f} (offline)")
            ngram_rows = tuned
        for k in [int(x) for x in args.k.split(",")]:
            for name in args.drafters.split(","):
                llm = LLM(target, disable_prefix_cache=True,
                          speculative_disable_by_batch_size=args.disable_by_batch_size,
                          speculative_min_acceptance_rate=args.min_acceptance_rate,
                          **_drafter_kwargs(name, k, args, target))
                spec = llm.engine.spec
                assert spec is not None
                if args.force_drafts:  # every draft verified: the cost of a drafted step
                    from kdaserve.speculative.schedule import StepCost

                    spec.cost = StepCost(fitted=False, prior_tokens=float("inf"))
                if name in ("self", "self-half"):
                    accept = -(-k // 2) if name == "self-half" else None
                    spec.drafter = SelfDrafter(k, futures, accept, plain.config.vocab_size)
                (tps, dec, outs), (base_tps, base_dec), pairs = best_of_paired(
                    llm, plain, wave, params, b, args.repeats)
                if outs != refs:
                    raise RuntimeError(f"speculation ({name}, K={k}, batch {b}) changed "
                                       "greedy outputs")
                m = llm.get_metrics()
                record = spec.survival  # verifies by draft position
                results.append({
                    "batch": b, "drafter": name, "k": k, "tok_s": tps, "decode_tok_s": dec,
                    "acceptance_length": m["spec_mean_acceptance_length"] or 1.0,
                    # against the plain runs interleaved with this row's, not the first
                    "speedup": tps / base_tps, "decode_speedup": dec / base_dec,
                    "baseline_tok_s": base_tps, "baseline_decode_tok_s": base_dec,
                    # each run's decode speed-up against the plain run just before it
                    "paired_decode_speedups": pairs,
                    "verifies": m["spec_num_verifies"],
                    # drafts the schedule kept per proposal (speculative/schedule.py)
                    "mean_verify_length": sum(n * c for n, c in spec.lengths.items())
                    / max(spec.lengths.total(), 1),
                    "kept_by_position": [a / d if d else 0.0 for a, d in
                                         zip(record.accepted_at, record.drafted_at,
                                             strict=True)],
                    "drafted_by_position": list(record.drafted_at),
                    # the cost split: ms per step of each kind (draft and bookkeeping per
                    # step of either kind), and how many steps drafted
                    "ms_per_step": cost_split(m)})
                if args.force_drafts:  # what acceptance such a step needs to pay
                    c, plain_ms = results[-1]["ms_per_step"], 1e3 * b / base_dec
                    step = c["draft_per_verify"] + c["verify"] + c["bookkeeping"]
                    results[-1]["plain_decode_step_ms"] = plain_ms
                    results[-1]["break_even_acceptance_length"] = step / plain_ms
                _row(results[-1])
    write_result(args.out, {"model": str(target), "max_tokens": args.max_tokens,
                            "token_map": args.token_map,
                            "num_shots": args.num_shots, "rows": results,
                            "ngram_offline": ngram_rows})
    print(f"wrote {args.out}")
    if args.plot:
        plot(results, Path(args.plot))


def cost_split(m: dict[str, float]) -> dict[str, float]:
    """The Speculator's time split (its metrics) as ms per step."""
    steps = m["spec_steps_verify"] + m["spec_steps_plain"]
    return {"draft": 1e3 * m["spec_seconds_draft"] / max(steps, 1),
            "verify": 1e3 * m["spec_seconds_verify"] / max(m["spec_steps_verify"], 1),
            "plain": 1e3 * m["spec_seconds_plain"] / max(m["spec_steps_plain"], 1),
            "bookkeeping": 1e3 * m["spec_seconds_bookkeeping"] / max(steps, 1),
            "draft_per_verify": 1e3 * m["spec_seconds_draft"] / max(m["spec_steps_verify"], 1),
            "drafted_share": m["spec_steps_verify"] / max(steps, 1)}


def _row(r: dict[str, Any]) -> None:
    kept = " ".join(f"{x:.2f}" for x in r["kept_by_position"])
    pairs = sorted(r.get("paired_decode_speedups", []))
    spread = f"  pairs {pairs[0]:.2f}-{pairs[-1]:.2f}x, median " \
        f"{statistics.median(pairs):.2f}x" if len(pairs) > 1 else ""
    c = r.get("ms_per_step")
    cost = f"  ms/step: draft {c['draft']:.2f}, verify {c['verify']:.2f}, plain " \
        f"{c['plain']:.2f}, bookkeeping {c['bookkeeping']:.2f}; drafted " \
        f"{100 * c['drafted_share']:.0f}% of steps" if c else ""
    if "break_even_acceptance_length" in r:
        cost += f"; a drafted step is {r['break_even_acceptance_length']:.2f} plain decode " \
            f"steps ({r['plain_decode_step_ms']:.1f} ms): the acceptance length it needs"
    print(f"{r['batch']:>3} {r['drafter']:>10} {r['k']:>2} {r['tok_s']:>7.1f} "
          f"{r['speedup']:>7.2f}x {r['decode_tok_s']:>13.1f} {r['decode_speedup']:>7.2f}x "
          f"{r['acceptance_length']:>11.2f}  {kept}{spread}{cost}", flush=True)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Kept share by block position (batch 1, the longest K per drafter), and decode
    speed-up against batch size (each drafter at its best K)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    first = min(r["batch"] for r in results)
    for name in dict.fromkeys(r["drafter"] for r in results if r["drafter"] != "none"):
        mine = [r for r in results if r["drafter"] == name]
        longest = max((r for r in mine if r["batch"] == first), key=lambda r: r["k"],
                      default=None)
        if longest and longest["kept_by_position"]:
            xs = range(1, len(longest["kept_by_position"]) + 1)
            a.plot(xs, longest["kept_by_position"], marker="o",
                   label=f"{name} (K={longest['k']})")
        per_batch: dict[int, float] = {}
        for r in mine:
            per_batch[r["batch"]] = max(per_batch.get(r["batch"], 0.0), r["decode_speedup"])
        b.plot(list(per_batch), list(per_batch.values()), marker="o", label=name)
    a.set_xlabel("position in the drafted block")
    a.set_ylabel("verifies that kept it (and all before)")
    a.set_title(f"acceptance by position, batch {first}")
    a.legend(fontsize=8)
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xscale("log", base=2)
    b.set_xlabel("batch size")
    b.set_ylabel("decode speed-up (best K)")
    b.set_title("speculation under load")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("spec", help="speculative decoding per drafter, K and batch size")
    p.add_argument("--model", default=None,
                   help="target checkpoint (default: train-lm's trained target)")
    p.add_argument("--data", default=None)
    p.add_argument("--num-shots", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=4,
                   help="prompts per batch size (at least the batch size)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", default="2,4,7", help="draft lengths")
    p.add_argument("--batch-sizes", default="1", help="concurrent requests, e.g. 1,4,16")
    p.add_argument("--repeats", type=int, default=2, help="runs per row, the fastest kept")
    p.add_argument("--k3-drafters", default=None,
                   help="folder of K3-format drafters by format name (default: TARGET."
                        "k3-drafters, random ones written there when missing)")
    p.add_argument("--k3-drafter-layers", type=int, default=1,
                   help="layers of the random K3-format drafters written (K3's: 5)")
    p.add_argument("--drafters", default="ngram,draft,block,dspark",
                   help=f"comma-separated, from {','.join(DRAFTERS)}")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="the engine's speculative_disable_by_batch_size for every drafter")
    p.add_argument("--force-drafts", action="store_true",
                   help="verify every draft (no schedule; pair with --min-acceptance-rate 0): "
                        "rows then give what a drafted step costs and the acceptance length "
                        "it needs to pay")
    p.add_argument("--min-acceptance-rate", type=float, default=0.1,
                   help="the engine's speculative_min_acceptance_rate (0: never switch off)")
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--tune-ngram", action="store_true",
                   help="also replay n-gram speculation offline for a grid of n-gram sizes")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--block-drafter", default=None, help="default: TARGET.block")
    p.add_argument("--dspark-drafter", default=None, help="default: TARGET.dspark")
    p.add_argument("--token-map", default=None,
                   help="hot-token map for the block and dspark drafters (kdaserve token-map)")
    p.add_argument("--out", default="bench_results/spec.json")
    p.add_argument("--plot", default=None, help="write the acceptance / load PNG here")
    p.set_defaults(func=main)
