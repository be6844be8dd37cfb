"""`kdaserve bench throughput`: fixed-length generation through `LLM.generate` vs transformers.

N random prompts of `--input-len` tokens each generate exactly `--output-len` tokens (EOS
ignored) for each batch size; the same prompts go through transformers' `generate` (static
batch, same checkpoint) when the `hf` backend is asked for, and through an engine with
deterministic inference (batch-invariant kernels) for the `deterministic` backend, and with
weight-only bf16 (`dtype="bfloat16"` on a CPU) for `bf16`, weight-only int8 for `int8`, and
with the prefix cache off for `nocache` (random prompts share nothing, so this is what the
cache costs when it cannot help). Backends alternate per batch size, and `--rounds` repeats
the whole alternation with fresh prompts, in reverse order every other round, so drift on a
shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from kdaserve.bench import write_result


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 256, (n, length), generator=g).tolist()


def run_kdaserve(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    from kdaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == output_len for o in outs)
    return dt


def run_hf(hf: Any, prompts: list[list[int]], output_len: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                          do_sample=False)
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + output_len
    return dt


def main(args: argparse.Namespace) -> None:
    from kdaserve import LLM
    from kdaserve.kernels import OPS

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    backends = args.backends.split(",")
    llm = LLM(args.model, max_num_seqs=max(batch_sizes),
              max_num_batched_tokens=args.max_num_batched_tokens)
    engines = {"kdaserve": llm}
    variants = {"deterministic": {"enable_deterministic_inference": True},
                "bf16": {"dtype": "bfloat16"},  # weight-only bf16 on a CPU
                "int8": {"quantization": "int8"},  # weight-only int8
                "nocache": {"disable_prefix_cache": True}}
    for name, kw in variants.items():
        if name in backends:
            engines[name] = LLM(args.model, max_num_seqs=max(batch_sizes),
                                max_num_batched_tokens=args.max_num_batched_tokens, **kw)
    hf = None
    if "hf" in backends:
        from transformers import KimiLinearForCausalLM

        hf = KimiLinearForCausalLM.from_pretrained(str(llm.path), dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # fixed length, like ignore_eos
    vocab = llm.config.vocab_size
    warm = _prompts(2, 8, vocab, 0)
    for engine in engines.values():
        run_kdaserve(engine, warm, 2)
    if hf is not None:
        run_hf(hf, warm, 2)
    rows = []
    for rnd, bs in ((r, b) for r in range(args.rounds) for b in batch_sizes):
        # fresh prompts each round: a repeated one would hit the prefix cache
        prompts = _prompts(bs, args.input_len, vocab, seed=bs + 1000 * rnd)
        # each round reverses the order: the second engine of a pair runs on what the
        # first left in the caches and on a machine that has warmed (or throttled) for it
        for backend in (backends if rnd % 2 == 0 else backends[::-1]):
            dt = (run_hf(hf, prompts, args.output_len) if backend == "hf"
                  else run_kdaserve(engines[backend], prompts, args.output_len))
            rows.append({"backend": backend, "batch": bs, "round": rnd,
                         "prompt_tokens": bs * args.input_len,
                         "output_tokens": bs * args.output_len, "seconds": round(dt, 3),
                         "output_tok_s": round(bs * args.output_len / dt, 2)})
            print(f"{backend:>9} batch {bs:>3}: {rows[-1]['output_tok_s']:>8.1f} output tok/s "
                  f"({dt:.2f}s)", flush=True)
    print()
    print(f"{'backend':>9} {'batch':>5} {'prompt':>7} {'output':>7} {'seconds':>8} "
          f"{'tok/s':>8} {'vs hf':>6} {'vs plain':>8}")

    def rates(backend: str) -> dict[tuple[int, int], float]:
        return {(r["round"], r["batch"]): r["output_tok_s"] for r in rows
                if r["backend"] == backend}

    hf_rate, plain_rate = rates("hf"), rates("kdaserve")
    for r in rows:
        key = (r["round"], r["batch"])
        if r["backend"] in variants and key in plain_rate:
            r["vs_plain"] = round(r["output_tok_s"] / plain_rate[key], 3)
        ratio = r["output_tok_s"] / hf_rate[key] if key in hf_rate else None
        r["vs_hf"] = round(ratio, 2) if ratio else None
        print(f"{r['backend']:>9} {r['batch']:>5} {r['prompt_tokens']:>7} {r['output_tokens']:>7} "
              f"{r['seconds']:>8.2f} {r['output_tok_s']:>8.1f} "
              f"{(f'{ratio:.2f}x' if ratio else '-'):>6} {r.get('vs_plain', '-'):>8}")
    result = {"model": str(llm.path), "input_len": args.input_len,
              "output_len": args.output_len, "threads": torch.get_num_threads(),
              "kernels": {op: getattr(llm.engine.kernels, op).__name__ for op in OPS},
              "rows": rows}
    write_result(args.out, result)
    print(f"\nwrote {args.out}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("throughput", help="fixed-length generation throughput vs transformers")
    p.add_argument("--model", default="bench")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--backends", default="kdaserve,hf",
                   help="comma-separated: kdaserve, hf, deterministic, bf16, int8, nocache")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--out", default="bench_results/throughput.json")
    p.set_defaults(func=main)
