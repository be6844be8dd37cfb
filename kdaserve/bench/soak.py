"""`kdaserve bench soak`: many requests at once against a real server, with clients that go
away mid-request, then the checks an operator cares about.

1. Reference: each distinct request (greedy and seeded, completions and chat, some streamed)
   alone on the idle server.
2. Soak: `--requests` drawn from those at `--concurrency`, a share of the clients
   disconnecting early (streams closed after a few chunks, others given up on).
3. Checks: no 5xx; every completed output equals its reference; after the load, the server
   is idle with every block and state slot back (after a cache flush).

Starts its own `kdaserve serve` unless given `--url`; `--max-total-tokens` small forces
preemption under the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from typing import Any

from kdaserve.bench import write_result


def add_parser(sub: Any) -> None:
    p = sub.add_parser("soak", help="concurrent load with disconnects; outputs and pools checked")
    p.add_argument("--model", default="tiny")
    p.add_argument("--url", default=None, help="an already running server (else one is started)")
    p.add_argument("--api-key", default=None, help="the --url server's API key")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect-rate", type=float, default=0.2)
    p.add_argument("--distinct", type=int, default=24, help="distinct requests (references)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV cache of the started server (small: preemption under load)")
    p.add_argument("--port", type=int, default=30711)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/soak.json")
    p.set_defaults(func=run)


def distinct_requests(n: int, max_tokens: int, rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        sampling: dict[str, Any] = ({"temperature": 0.0} if i % 2 == 0
                                    else {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i})
        words = " ".join(rng.choice(["apple", "river", "seven", "blue", "walk", "count"])
                         for _ in range(rng.randint(3, 60)))
        body: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, **sampling}
        if i % 3 == 0:
            out.append({"path": "/v1/chat/completions",
                        "body": {**body, "messages": [{"role": "user", "content": words}]}})
        else:
            out.append({"path": "/v1/completions", "body": {**body, "prompt": words}})
        out[-1]["stream"] = i % 4 == 1
    return out


LEFT, BROKEN = 0, -1  # pseudo statuses: the client left on purpose; the connection failed


async def call(client: Any, req: dict[str, Any], give_up_after: int | None = None,
               ) -> tuple[int, str | None]:
    """(status, output text); text None when the client went away or the request failed.
    `give_up_after`: streams close after that many chunks, others time out quickly."""
    import httpx

    try:
        return await _call(client, req, give_up_after)
    except httpx.TimeoutException:
        return (LEFT if give_up_after is not None else BROKEN), None
    except httpx.TransportError:  # reset, refused, cut mid-stream: the server's fault
        return BROKEN, None


async def _call(client: Any, req: dict[str, Any],
                give_up_after: int | None) -> tuple[int, str | None]:
    body = {**req["body"], "stream": req["stream"]}
    if not req["stream"]:
        timeout = 0.05 if give_up_after is not None else 600
        r = await client.post(req["path"], json=body, timeout=timeout)
        if r.status_code != 200:
            return r.status_code, None
        c = r.json()["choices"][0]
        return 200, c["text"] if "text" in c else c["message"]["content"]
    text, chunks = [], 0
    async with client.stream("POST", req["path"], json=body, timeout=600) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return int(event["error"]["code"]), None
            chunks += 1
            if give_up_after is not None and chunks >= give_up_after:
                return LEFT, None  # closing the stream aborts the request
            for c in event["choices"]:
                text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return 200, "".join(text)


async def soak(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    rng = random.Random(args.seed)
    reqs = distinct_requests(args.distinct, args.max_tokens, rng)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:
        refs = [(await call(client, r))[1] for r in reqs]  # alone on an idle server
        sem = asyncio.Semaphore(args.concurrency)
        statuses: dict[int, int] = {}
        mismatches, completed, gone = 0, 0, 0
        latencies: list[float] = []

        async def one(i: int) -> None:
            nonlocal mismatches, completed, gone
            k = rng.randrange(len(reqs))
            leave = rng.randint(1, 4) if rng.random() < args.disconnect_rate else None
            async with sem:
                t0 = time.perf_counter()
                status, text = await call(client, reqs[k], leave)
                latencies.append(time.perf_counter() - t0)
            statuses[status] = statuses.get(status, 0) + 1
            if text is None:
                gone += status == LEFT
                return
            completed += 1
            mismatches += text != refs[k]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
        await asyncio.sleep(0.5)  # the last aborts reach the engine
        await client.post("/flush_cache")
        metrics = await client.get("/metrics")
    values = {}
    for line in metrics.text.splitlines():
        if line.startswith("kdaserve_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    pools_ok = (values.get("kdaserve_num_running") == 0
                and values.get("kdaserve_free_blocks") == values.get("kdaserve_total_blocks")
                and values.get("kdaserve_free_state_slots")
                == values.get("kdaserve_total_state_slots"))
    latencies.sort()
    return {"requests": args.requests, "concurrency": args.concurrency, "wall_s": wall,
            "statuses": statuses, "completed": completed, "disconnected": gone,
            "server_errors": sum(v for k, v in statuses.items() if k >= 500),
            # anything but a 200 or a client that left on purpose: 4xx, 5xx, broken connections
            "failures": sum(v for k, v in statuses.items() if k not in (200, LEFT)),
            "mismatches": mismatches, "pools_back": pools_ok,
            "preemptions": values.get("kdaserve_num_preemptions", 0.0),
            "p50_s": latencies[len(latencies) // 2], "p99_s": latencies[int(len(latencies) * .99)]}


def run(args: argparse.Namespace) -> None:
    import httpx

    proc = None
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        cmd = [sys.executable, "-m", "kdaserve.cli", "serve", "--model", args.model,
               "--port", str(args.port)]
        if args.max_total_tokens:
            cmd += ["--max-total-tokens", str(args.max_total_tokens)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.3)
    try:
        result = asyncio.run(soak(url, args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"{result['requests']} requests at concurrency {result['concurrency']} in "
          f"{result['wall_s']:.1f} s: {result['completed']} completed, "
          f"{result['disconnected']} disconnected on purpose, statuses {result['statuses']}")
    print(f"failures {result['failures']} (5xx {result['server_errors']}), outputs "
          f"differing from an idle run {result['mismatches']}, pools back to full "
          f"{result['pools_back']}, "
          f"preemptions {result['preemptions']:.0f}, latency p50 {result['p50_s']:.2f} s "
          f"p99 {result['p99_s']:.2f} s")
    write_result(args.out, result)
