"""`kdaserve bench accuracy`: what weight-only bf16 and int8 cost in accuracy, against fp32 on
the same checkpoint, side by side with llama.cpp's bf16 and q8_0 GGUFs against its own f32.

Each engine is compared only with itself in full precision (the two engines' f32 logits differ
a little on their own: llama.cpp keeps its KV cache in f16), on the same token ids:
- teacher-forced positions (GSM8K text, windows of `--window` tokens): the largest and mean
  |delta logit|, top-1 agreement and the mean KL(f32 || variant);
- greedy continuations of GSM8K questions: the share of generated tokens before the first
  difference, and the share of continuations identical to the end.

llama.cpp runs through llama-cpp-python (`llama_cpp`), imported only when a GGUF is given.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kdaserve.bench import write_result

Logits = Callable[[list[int]], torch.Tensor]  # token ids -> fp32 logits [T, vocab]
Greedy = Callable[[list[list[int]], int], list[list[int]]]  # prompts, n -> continuations


@dataclass
class Agreement:
    engine: str
    weights: str
    positions: int
    max_abs_dlogit: float
    mean_abs_dlogit: float
    top1_agreement: float
    mean_kl: float  # nats, KL(reference || variant) per position
    greedy_prefix_share: float  # generated tokens before the first difference / all
    greedy_identical: float  # continuations equal to the end / all


def logit_stats(ref: torch.Tensor, var: torch.Tensor) -> dict[str, float]:
    """Sums over the rows of [T, vocab] logits (sums, so windows add up)."""
    ref, var = ref.double(), var.double()
    d = (var - ref).abs()
    lp_ref, lp_var = ref.log_softmax(-1), var.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_var)).sum(-1)
    return {"max": float(d.max()), "abs_sum": float(d.mean(-1).sum()),
            "top1": float((ref.argmax(-1) == var.argmax(-1)).sum()),
            "kl_sum": float(kl.sum()), "rows": float(ref.shape[0])}


def greedy_stats(ref: Sequence[Sequence[int]], var: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(share of tokens before the first difference, share of identical continuations)."""
    prefix = total = same = 0
    for a, b in zip(ref, var, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix += n
        total += len(a)
        same += list(a) == list(b)
    return prefix / max(total, 1), same / max(len(ref), 1)


def compare(engine: str, weights: str, windows: list[list[int]], prompts: list[list[int]],
            n: int, ref: tuple[Logits, Greedy], var: tuple[Logits, Greedy]) -> Agreement:
    acc = {"max": 0.0, "abs_sum": 0.0, "top1": 0.0, "kl_sum": 0.0, "rows": 0.0}
    for w in windows:
        s = logit_stats(ref[0](w), var[0](w))
        acc["max"] = max(acc["max"], s.pop("max"))
        for k, v in s.items():
            acc[k] += v
    prefix, same = greedy_stats(ref[1](prompts, n), var[1](prompts, n))
    rows = max(acc["rows"], 1.0)
    return Agreement(engine, weights, int(acc["rows"]), acc["max"], acc["abs_sum"] / rows,
                     acc["top1"] / rows, acc["kl_sum"] / rows, prefix, same)


def _kdaserve(llm: Any) -> tuple[Logits, Greedy]:
    from kdaserve import SamplingParams

    def greedy(prompts: list[list[int]], n: int) -> list[list[int]]:
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=p)]

    return (lambda ids: llm.prefill_logits(ids).float()), greedy


def _llama_cpp(gguf: str, n_ctx: int) -> tuple[Logits, Greedy]:
    try:
        import llama_cpp
    except ImportError as e:
        raise ValueError("--gguf needs llama-cpp-python (`llama_cpp`) importable") from e
    # llama.cpp's CPU weight repacking aborts in ggml's scheduler for this architecture's
    # q8_0 tensors (0.3.36); the llama-bench runs in docs/benchmarks_log.md use --repack 0 too.
    default = llama_cpp.llama_cpp.llama_model_default_params

    def no_repack() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = no_repack
    try:
        m = llama_cpp.Llama(model_path=gguf, logits_all=True, n_ctx=n_ctx, n_batch=n_ctx,
                            n_threads=torch.get_num_threads(), verbose=False)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default

    def logits(ids: list[int]) -> torch.Tensor:
        m.reset()
        m.eval(ids)
        return torch.from_numpy(m.scores[:len(ids)].copy()).float()

    def greedy(prompts: list[list[int]], n: int) -> list[list[int]]:
        outs = []
        for p in prompts:
            m.reset()
            m.eval(p)
            out: list[int] = []
            while len(out) < n:
                out.append(int(m.scores[m.n_tokens - 1].argmax()))
                if len(out) < n:
                    m.eval(out[-1:])
            outs.append(out)
        return outs

    return logits, greedy


def _token_data(tok: Any, data: str | None, positions: int, window: int,
                n_prompts: int) -> tuple[list[list[int]], list[list[int]]]:
    from kdaserve.bench.gsm8k import load_data

    if tok is None:
        raise ValueError("the checkpoint has no tokenizer: the comparison runs on GSM8K text")
    rows = load_data(data)
    stream: list[int] = []
    for r in rows:
        if len(stream) >= positions:
            break
        stream += tok.encode(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n")
    stream = stream[:positions]
    windows = [stream[i:i + window] for i in range(0, len(stream), window)]
    prompts = [tok.encode(f"Question: {r['question']}\nAnswer:") for r in rows[:n_prompts]]
    return windows, prompts


def run(args: argparse.Namespace) -> None:
    from kdaserve import LLM

    def load(**kwargs: Any) -> LLM:
        return LLM(args.model, disable_prefix_cache=True, **kwargs)

    reference = load()
    windows, prompts = _token_data(reference.tokenizer, args.data, args.positions,
                                   args.window, args.greedy_prompts)
    n = args.greedy_tokens
    rows: list[Agreement] = []
    ours = _kdaserve(reference)
    variants = {"bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"},
                "fp32": {}}  # fp32 against itself: the check that the metrics read zero
    for name in [v for v in args.variants.split(",") if v]:
        if name not in variants:
            raise ValueError(f"unknown variant {name!r} (bf16, int8, fp32)")
        rows.append(compare("kdaserve", name, windows, prompts, n, ours,
                            _kdaserve(load(**variants[name]))))
    ggufs = dict(kv.split("=", 1) for kv in args.gguf.split(",") if kv)
    if ggufs:
        if "f32" not in ggufs:
            raise ValueError("--gguf needs f32=PATH, the reference the others are compared with")
        n_ctx = max(args.window, max((len(p) for p in prompts), default=0) + n)
        ref = _llama_cpp(ggufs.pop("f32"), n_ctx)
        rows.append(compare("llama.cpp f32", "kdaserve fp32", windows, prompts, n, ours, ref))
        for name, path in ggufs.items():
            rows.append(compare("llama.cpp", name, windows, prompts, n, ref,
                                _llama_cpp(path, n_ctx)))
    print(f"{args.model}: {sum(map(len, windows))} GSM8K positions in windows of "
          f"{args.window}; greedy: {len(prompts)} questions x {n} tokens")
    print(f"{'engine':14s} {'weights vs f32':15s} {'max|dl|':>8s} {'mean|dl|':>9s} "
          f"{'top-1':>7s} {'KL':>9s} {'greedy prefix':>14s} {'identical':>10s}")
    for r in rows:
        print(f"{r.engine:14s} {r.weights:15s} {r.max_abs_dlogit:8.3f} {r.mean_abs_dlogit:9.4f} "
              f"{r.top1_agreement:7.1%} {r.mean_kl:9.5f} {r.greedy_prefix_share:14.1%} "
              f"{r.greedy_identical:10.1%}")
    write_result(args.out, {"model": args.model, "window": args.window,
                            "greedy_tokens": n, "rows": [asdict(r) for r in rows]})


def add_parser(sub: Any) -> None:
    p = sub.add_parser("accuracy", help="bf16 / int8 weights against fp32 (and llama.cpp's)")
    p.add_argument("--model", default="bench")
    p.add_argument("--variants", default="bf16,int8", help="of bf16, int8, fp32")
    p.add_argument("--data", default=None,
                   help="GSM8K JSONL (default: $KDASERVE_GSM8K_DIR or the cache)")
    p.add_argument("--positions", type=int, default=1000)
    p.add_argument("--window", type=int, default=250)
    p.add_argument("--greedy-prompts", type=int, default=16)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--gguf", default="", help="llama.cpp GGUFs of the same checkpoint: "
                   "f32=PATH[,bf16=PATH][,q8_0=PATH]")
    p.add_argument("--out", default="bench_results/accuracy.json")
    p.set_defaults(func=run)
