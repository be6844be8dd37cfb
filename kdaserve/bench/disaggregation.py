"""`kdaserve bench pd`: the same load through sglang-router in front of (a) one unified
server and (b) a prefill and a decode server (`--pd-disaggregation`), each server on its own
threads. Reports TTFT, TPOT and ITL (p50/p99) per topology, and what the prefill server
shipped per request (MLA latent bytes, KDA state bytes, milliseconds of writes).

A mixed load (long prompts arriving while others decode) shows the point of disaggregation:
on one server every prefill chunk lands in some decode step and stretches its inter-token
gap; the decode server never prefills."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kdaserve.bench import serving, write_result


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[bytes], path: str = "/health") -> None:
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode} during start-up")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not start")


class Topology:
    """Servers and a router, started and stopped together."""

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args, self.logs, self.procs = args, logs, []  # type: ignore[var-annotated]
        self.servers: dict[str, str] = {}

    def serve(self, name: str, *extra: str) -> str:
        port = _port()
        a = self.args
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        cmd = [sys.executable, "-m", "kdaserve.cli", "serve", "--model", a.model,
               "--port", str(port), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
               *extra]
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        _wait(url, proc)
        self.servers[name] = url
        return url

    def route(self, *router_args: str) -> str:
        port = _port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *router_args,
               "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(_port()),
               "--log-level", "warn", "--disable-retries"]
        with open(self.logs / "router.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        _wait(url, proc)
        return url

    def metrics(self, name: str) -> dict[str, float]:
        import httpx

        info = httpx.get(self.servers[name] + "/get_server_info", timeout=30).json()
        return dict(info["internal_states"][0])

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _load(args: argparse.Namespace, url: str) -> dict[str, Any]:
    load = argparse.Namespace(
        dataset="random", num_prompts=args.num_prompts, random_input_len=args.input_len,
        random_output_len=args.output_len, random_range_ratio=args.range_ratio,
        max_token_id=args.max_token_id, seed=args.seed, url=url, served_model=None,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        endpoint="generate")
    return asyncio.run(serving.run(load, serving.make_samples(load)))


def main(args: argparse.Namespace) -> None:
    logs = Path(args.out).with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"config": vars(args).copy()}
    results["config"].pop("func", None)
    # unified: one server behind the router's regular mode
    top = Topology(args, logs)
    try:
        url = top.route("--worker-urls", top.serve("unified"), "--policy", "round_robin")
        _load(argparse.Namespace(**{**vars(args), "num_prompts": 2}), url)  # warm-up
        results["unified"] = _load(args, url)
    finally:
        top.stop()
    # disaggregated: a prefill and a decode server behind the PD router
    top = Topology(args, logs)
    try:
        bport = _port()
        prefill = top.serve("prefill", "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(bport))
        decode = top.serve("decode", "--disaggregation-mode", "decode")
        url = top.route("--pd-disaggregation", "--prefill", prefill, str(bport),
                        "--decode", decode)
        _load(argparse.Namespace(**{**vars(args), "num_prompts": 2}), url)
        before = top.metrics("prefill")
        results["pd"] = _load(args, url)
        after = top.metrics("prefill")
        n = max(after["pd_transfers"] - before["pd_transfers"], 1)
        results["pd"]["transfer"] = {
            "requests": n,
            "kv_bytes_per_request": (after["pd_kv_bytes"] - before["pd_kv_bytes"]) / n,
            "state_bytes_per_request": (after["pd_state_bytes"] - before["pd_state_bytes"]) / n,
            "ms_per_request": (after["pd_transfer_ms"] - before["pd_transfer_ms"]) / n,
            "writes_per_request": (after["pd_writes"] - before["pd_writes"]) / n}
        results["pd"]["decode_prompt_tokens"] = top.metrics("decode")["prompt_tokens"]
    finally:
        top.stop()
    print(f"{'topology':>9} {'done':>5} {'out tok/s':>9} {'TTFT p50':>9} {'p99':>8} "
          f"{'TPOT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}  (ms)")
    for name in ("unified", "pd"):
        r = results[name]
        print(f"{name:>9} {r['completed']:>5} {r['output_tok_s']:>9.1f} "
              f"{r['ttft']['median_ms']:>9.0f} {r['ttft']['p99_ms']:>8.0f} "
              f"{r['tpot']['median_ms']:>9.1f} {r['tpot']['p99_ms']:>8.1f} "
              f"{r['itl']['median_ms']:>8.1f} {r['itl']['p99_ms']:>8.1f}")
    t = results["pd"]["transfer"]
    print(f"per request shipped: {t['kv_bytes_per_request'] / 2**20:.2f} MiB MLA latents + "
          f"{t['state_bytes_per_request'] / 2**20:.2f} MiB KDA state in "
          f"{t['writes_per_request']:.1f} writes, {t['ms_per_request']:.1f} ms; decode server "
          f"prompt tokens computed: {results['pd']['decode_prompt_tokens']:.0f}")
    write_result(args.out, results)
    print(f"wrote {args.out} (server logs in {logs})")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("pd", help="unified vs prefill/decode disaggregated behind sglang-router")
    p.add_argument("--model", default="bench")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per server")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--max-token-id", type=int, default=3800)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/pd.json")
    p.set_defaults(func=main)
