"""`kdaserve bench serving`: an async load generator against an OpenAI-compatible server
(like `sglang.bench_serving`): Poisson arrivals at `--request-rate` or a fixed
`--max-concurrency`, streamed /v1/completions, and the latency distribution it sees."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from kdaserve.bench import write_result


@dataclass
class Sample:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class Outcome:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    sent: float = 0.0  # perf_counter when the request went out
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_samples(args: argparse.Namespace) -> list[Sample]:
    rng = random.Random(args.seed)
    if args.dataset == "random":
        out = []
        for _ in range(args.num_prompts):
            n_in = max(1, int(args.random_input_len * rng.uniform(args.random_range_ratio, 1)))
            n_out = max(1, int(args.random_output_len * rng.uniform(args.random_range_ratio, 1)))
            ids = [rng.randrange(256, args.max_token_id) for _ in range(n_in)]
            out.append(Sample(ids, n_in, n_out))
        return out
    from kdaserve.bench.gsm8k import build_prompts, load_data

    prompts, _ = build_prompts(load_data(args.data), args.num_shots, args.num_prompts)
    return [Sample(p, 0, args.random_output_len) for p in prompts]


async def one(client: Any, url: str, model: str | None, s: Sample,
              endpoint: str = "completions") -> Outcome:
    """One streamed request to /v1/completions or SGLang's /generate (which takes token ids
    through sglang-router; the router's /v1/completions takes text only)."""
    if endpoint == "generate":
        path = "/generate"
        body: dict[str, Any] = {
            ("text" if isinstance(s.prompt, str) else "input_ids"): s.prompt, "stream": True,
            "sampling_params": {"max_new_tokens": s.output_len, "temperature": 0.0,
                                "ignore_eos": True}}
    else:
        path = "/v1/completions"
        body = {"prompt": s.prompt, "max_tokens": s.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
    start = time.perf_counter()
    last = start
    out = Outcome(ok=False, prompt_len=s.prompt_len, sent=start)
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "meta_info" in data:  # /generate: one event per step, counts in meta_info
                    meta = data["meta_info"]
                    out.output_tokens = meta.get("completion_tokens", out.output_tokens)
                    out.prompt_len = meta.get("prompt_tokens", out.prompt_len)
                    data = {"choices": [{"text": "x"}]} if data.get("output_ids") else {}
                if data.get("usage"):
                    out.output_tokens = data["usage"].get("completion_tokens", out.output_tokens)
                    out.prompt_len = data["usage"].get("prompt_tokens", out.prompt_len)
                if not data.get("choices") or not data["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if out.ttft == 0.0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
        out.e2e = time.perf_counter() - start
        out.ok = True
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        out.error = f"{type(e).__name__}: {e}"
    return out


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean_ms": 1e3 * statistics.fmean(values),
            "median_ms": 1e3 * statistics.median(values), "p99_ms": 1e3 * p99}


async def run(args: argparse.Namespace, samples: list[Sample]) -> dict[str, Any]:
    import httpx

    url = args.url.rstrip("/")
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency or len(samples))
    async with httpx.AsyncClient(timeout=None) as client:
        async def limited(s: Sample) -> Outcome:
            async with sem:
                return await one(client, url, args.served_model, s,
                                 getattr(args, "endpoint", "completions"))

        start = time.perf_counter()
        tasks = []
        for s in samples:
            tasks.append(asyncio.create_task(limited(s)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.prompt_len for o in ok)
    tpot = [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "input_tok_s": in_tokens / duration, "output_tok_s": out_tokens / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft": stats([o.ttft for o in ok]), "tpot": stats(tpot),
        "itl": stats([x for o in ok for x in o.itl]), "e2e": stats([o.e2e for o in ok]),
        # each request (seconds from the run's start): when queueing or prefill decides TTFT
        "requests": [{"sent": o.sent - start, "ttft": o.ttft, "e2e": o.e2e,
                      "prompt_len": o.prompt_len, "output_tokens": o.output_tokens}
                     for o in ok],
    }


def main(args: argparse.Namespace) -> None:
    samples = make_samples(args)
    result = asyncio.run(run(args, samples))
    result.update({"url": args.url, "dataset": args.dataset, "num_prompts": len(samples),
                   "request_rate": args.request_rate, "max_concurrency": args.max_concurrency})
    print(f"completed {result['completed']}, failed {result['failed']} in "
          f"{result['duration_s']:.2f}s")
    print(f"request throughput {result['request_throughput']:.2f} req/s, input "
          f"{result['input_tok_s']:.1f} tok/s, output {result['output_tok_s']:.1f} tok/s")
    print(f"{'metric':>6} {'mean ms':>10} {'median ms':>10} {'p99 ms':>10}")
    for k in ("ttft", "tpot", "itl", "e2e"):
        s = result[k]
        print(f"{k.upper():>6} {s['mean_ms']:>10.1f} {s['median_ms']:>10.1f} {s['p99_ms']:>10.1f}")
    for e in result["errors"]:
        print("error:", e)
    write_result(args.out, result)
    print(f"wrote {args.out}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serving", help="async load generator against an OpenAI-compatible URL")
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--served-model", default=None)
    p.add_argument("--endpoint", default="completions", choices=["completions", "generate"])
    p.add_argument("--dataset", default="random", choices=["random", "gsm8k"])
    p.add_argument("--data", default=None, help="GSM8K JSONL for --dataset gsm8k")
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--max-token-id", type=int, default=3800,
                   help="random prompts use ids in [256, this): valid for every preset")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate (req/s); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/serving.json")
    p.set_defaults(func=main)
