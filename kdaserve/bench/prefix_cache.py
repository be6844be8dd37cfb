"""`kdaserve bench prefix-cache`: what the KDA-aware prefix cache saves.

1. 8-shot GSM8K prompts (shared examples), `--parallel` at a time, with the cache off and on:
   prompt tokens actually computed, wall time, output tok/s.
2. TTFT of one such prompt alone on a warm cache (hit) vs an empty one (miss).
3. A multi-turn chat (`--turns` turns, each turn = history + answer + a new message): TTFT
   per turn with and without the cache; with it, TTFT should stay flat as the history grows.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from kdaserve.bench import write_result
from kdaserve.datasets import gsm8k_file, read_jsonl
from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.engine_config import EngineConfig
from kdaserve.request import SamplingParams


def gsm8k_prompts(path: Path, n: int, shots: int) -> list[str]:
    rows = read_jsonl(path)[: shots + n]
    prefix = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:shots])
    return [prefix + f"Question: {r['question']}\nAnswer:" for r in rows[shots:]]


def run(engine: LLMEngine, prompts: list[Any], params: SamplingParams) -> dict[str, Any]:
    """All prompts through the engine; returns wall time, TTFT per request, tokens."""
    before = engine.get_metrics()
    start = time.perf_counter()
    arrival: dict[str, float] = {}
    ttft: dict[str, float] = {}
    for i, p in enumerate(prompts):
        rid = engine.add_request(p, params, rid=f"b{i}-{time.monotonic_ns()}")
        arrival[rid] = time.perf_counter()
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            ttft.setdefault(out.rid, now - arrival[out.rid])
            if out.finished:
                finals[out.rid] = out.token_ids
    wall = time.perf_counter() - start
    after = engine.get_metrics()
    outputs = sum(len(t) for t in finals.values())
    return {"wall_s": wall, "output_tokens": outputs, "output_tok_s": outputs / wall,
            "prompt_tokens_computed": after["prompt_tokens"] - before["prompt_tokens"],
            "hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
            "ttft_s": [ttft[r] for r in arrival], "outputs": [finals[r] for r in arrival]}


def main(args: argparse.Namespace) -> None:
    prompts = gsm8k_prompts(Path(args.data) if args.data else gsm8k_file("test"),
                            args.num_questions + 1, args.num_shots)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    result: dict[str, Any] = {"model": args.model, "num_questions": args.num_questions,
                              "parallel": args.parallel, "threads": torch.get_num_threads()}
    engines = {}
    for mode in ("off", "on"):
        engines[mode] = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.parallel,
                                               disable_prefix_cache=mode == "off"))
    # 1. GSM8K throughput, cache off then on
    for mode, engine in engines.items():
        r = run(engine, prompts[:-1], params)
        result[f"gsm8k_cache_{mode}"] = {k: v for k, v in r.items()
                                          if k not in ("ttft_s", "outputs")}
        print(f"gsm8k cache {mode:>3}: {r['wall_s']:7.2f}s  {r['output_tok_s']:7.1f} out tok/s  "
              f"prompt tokens computed {r['prompt_tokens_computed']}  hit {r['hit_tokens']}",
              flush=True)
    off, on = result["gsm8k_cache_off"], result["gsm8k_cache_on"]
    saved = 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"]
    result["prefill_tokens_saved"] = saved
    result["throughput_gain"] = on["output_tok_s"] / off["output_tok_s"]
    # 2. TTFT of one new question: warm cache (hit) vs no cache (miss), alternated
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    hits, misses = [], []
    for _ in range(args.repeats):
        misses.append(run(engines["off"], [prompts[-1]], one)["ttft_s"][0])
        hits.append(run(engines["on"], [prompts[-1]], one)["ttft_s"][0])
    result["ttft_miss_s"], result["ttft_hit_s"] = min(misses), min(hits)
    result["ttft_speedup"] = min(misses) / min(hits)
    print(f"TTFT of a new question: miss {min(misses) * 1e3:.1f} ms, hit {min(hits) * 1e3:.1f} ms "
          f"({result['ttft_speedup']:.1f}x)", flush=True)
    # 3. multi-turn chat
    g = torch.Generator().manual_seed(0)
    vocab = engines["on"].model_config.vocab_size - 256
    turn_params = SamplingParams(temperature=0.0, max_tokens=args.turn_tokens, ignore_eos=True)
    for mode, engine in engines.items():
        convo: list[int] = []
        ttfts = []
        g.manual_seed(0)
        for _ in range(args.turns):
            prompt = convo + torch.randint(0, vocab, (args.message_tokens,), generator=g).tolist()
            r = run(engine, [prompt], turn_params)
            ttfts.append(r["ttft_s"][0])
            convo = prompt + r["outputs"][0]
        result[f"chat_ttft_cache_{mode}_s"] = ttfts
        print(f"chat cache {mode:>3}: TTFT per turn (ms) "
              + " ".join(f"{t * 1e3:.0f}" for t in ttfts), flush=True)
    write_result(args.out, result)
    print(f"prefill tokens saved {result['prefill_tokens_saved']:.1%}, throughput gain "
          f"{result['throughput_gain']:.2f}x; wrote {args.out}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("prefix-cache", help="prefix-cache savings: GSM8K 8-shot, TTFT, chat")
    p.add_argument("--model", default="bench")
    p.add_argument("--data", default=None, help="GSM8K test.jsonl (default: kdaserve.datasets)")
    p.add_argument("--num-questions", type=int, default=32)
    p.add_argument("--num-shots", type=int, default=8)
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--message-tokens", type=int, default=48)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--out", default="bench_results/prefix_cache.json")
    p.set_defaults(func=main)
