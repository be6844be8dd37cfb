"""`kdaserve bench gsm8k`: GSM8K k-shot accuracy and throughput, prompts exactly as SGLang's
`benchmark/gsm8k/bench_sglang.py`, against one or more backends in one run.

Backends: `kdaserve` (in-process engine), `openai` (any OpenAI-compatible server by URL: our
`kdaserve serve`, llama.cpp's `llama-server`, SGLang, vLLM) and `hf` (transformers'
`KimiLinearForCausalLM.generate`, static batches, same checkpoint). With `--compare` the
backends alternate per parallelism level (A/B/A/B) and the machine's fp32 GEMM peak and read
bandwidth are measured in the same run; `--ignore-eos --max-tokens N` is the fixed-length mode
for comparing engines on random-weight checkpoints.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kdaserve.bench import roofline, write_result
from kdaserve.datasets import gsm8k_file, read_jsonl

STOP = ["Question", "Assistant:", "<|separator|>"]
INVALID = -9999999


def load_data(path: str | None) -> list[dict[str, str]]:
    """The GSM8K test rows: the file `path` names, else as kdaserve.datasets finds them."""
    return read_jsonl(path if path is not None else gsm8k_file("test"))


def answer_value(text: str) -> int | float:
    """The last number in the text (as bench_sglang.py scores it)."""
    numbers = re.findall(r"\d+", text.replace(",", ""))
    if not numbers:
        return INVALID
    try:
        return ast.literal_eval(numbers[-1])
    except (SyntaxError, ValueError):
        return INVALID


def build_prompts(rows: list[dict[str, str]], shots: int, n: int) -> tuple[list[str], list[Any]]:
    """k-shot prefix of the first `shots` items with answers, then each question (SGLang takes
    the questions from the start of the same file)."""
    def one(i: int, with_answer: bool) -> str:
        s = "Question: " + rows[i]["question"] + "\nAnswer:"
        return s + " " + rows[i]["answer"] if with_answer else s

    prefix = "".join(one(i, True) + "\n\n" for i in range(shots))
    n = min(n, len(rows))
    return [prefix + one(i, False) for i in range(n)], [answer_value(rows[i]["answer"])
                                                        for i in range(n)]


@dataclass
class RunResult:
    backend: str
    parallel: int
    questions: int
    accuracy: float
    invalid: float
    latency_s: float
    prompt_tokens: int
    prompt_tokens_computed: int
    output_tokens: int
    output_tok_s: float


class KdaserveBackend:
    name = "kdaserve"

    def __init__(self, model: str, max_parallel: int, **engine: Any) -> None:
        from kdaserve import LLM

        self.llm = LLM(model, max_num_seqs=max_parallel, **engine)
        self.tokenizer = self.llm.tokenizer

    def run(self, prompts: list[str], params: dict[str, Any], parallel: int,
            progress: Any) -> tuple[list[str], list[int], int]:
        from kdaserve import SamplingParams

        engine = self.llm.engine
        engine.scheduler.max_num_seqs = parallel  # concurrency of this run
        engine.flush_cache()  # every run starts cold; sharing within a run is what counts
        sp = SamplingParams(temperature=0.0, max_tokens=params["max_tokens"],
                            ignore_eos=params["ignore_eos"], stop=params["stop"])
        m0 = engine.get_metrics()
        start = time.perf_counter()
        rids = [engine.add_request(p, sp) for p in prompts]
        done: dict[str, Any] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.rid] = out
                    progress.update(1)
        wall = time.perf_counter() - start
        m1 = engine.get_metrics()
        computed = m1["prompt_tokens"] - m0["prompt_tokens"]
        if "tp_all_reduce_ms" in m1:  # tensor parallel: a step's time, compute vs collectives
            steps = max(m1["num_steps"] - m0["num_steps"], 1)
            ar = (m1["tp_all_reduce_ms"] - m0["tp_all_reduce_ms"]) / steps
            bc = (m1["tp_broadcast_ms"] - m0["tp_broadcast_ms"]) / steps
            mb = (m1["tp_all_reduce_bytes"] - m0["tp_all_reduce_bytes"]) / steps / 2**20
            print(f"tensor parallel: {steps} steps, {wall * 1e3 / steps:.1f} ms/step: "
                  f"all-reduce {ar:.1f} ms ({mb:.2f} MiB), batch broadcast {bc:.1f} ms, "
                  f"the rest {wall * 1e3 / steps - ar - bc:.1f} ms")
        return ([done[r].text or "" for r in rids], [len(done[r].token_ids) for r in rids],
                computed)


class OpenAIBackend:
    def __init__(self, url: str, model: str | None, tokenizer: Any,
                 name: str = "openai") -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name

    def run(self, prompts: list[str], params: dict[str, Any], parallel: int,
            progress: Any) -> tuple[list[str], list[int], int]:
        return asyncio.run(self._run(prompts, params, parallel, progress))

    async def _run(self, prompts: list[str], params: dict[str, Any], parallel: int,
                   progress: Any) -> tuple[list[str], list[int], int]:
        import httpx

        sem = asyncio.Semaphore(parallel)
        body = {"temperature": 0.0, "max_tokens": params["max_tokens"],
                "ignore_eos": params["ignore_eos"], "stop": params["stop"] or None}
        if self.model:
            body["model"] = self.model
        async with httpx.AsyncClient(timeout=None) as client:
            await self._cold_start(client)
            before = await self._computed(client)

            async def one(p: str) -> tuple[str, int, int]:
                async with sem:
                    r = await client.post(f"{self.url}/v1/completions", json={**body, "prompt": p})
                    r.raise_for_status()
                    data = r.json()
                progress.update(1)
                usage = data.get("usage") or {}
                # llama-server counts its prompt-cache hits in prompt_tokens
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                return (data["choices"][0]["text"], usage.get("completion_tokens", 0),
                        usage.get("prompt_tokens", 0) - cached)

            res = await asyncio.gather(*(one(p) for p in prompts))
            after = await self._computed(client)
        # a kdaserve server reports the prompt tokens it actually computed (prefix-cache hits
        # excluded); for other servers all prompt tokens count
        computed = after - before if before is not None and after is not None \
            else sum(r[2] for r in res)
        return [r[0] for r in res], [r[1] for r in res], computed

    async def _cold_start(self, client: Any) -> None:
        """Empty the server's prompt cache so every run starts cold: kdaserve and SGLang have
        /flush_cache; llama-server erases its slots (started with --slot-save-path), and keeps
        no other copy only when started with --cache-ram 0 (its host-memory prompt cache
        survives an erase: a second run then computed 64 of 11,699 prompt tokens)."""
        if (await client.post(f"{self.url}/flush_cache")).status_code == 200:
            return
        props = await client.get(f"{self.url}/props")
        slots = props.json().get("total_slots", 0) if props.status_code == 200 else 0
        ok = slots > 0
        for i in range(slots):
            r = await client.post(f"{self.url}/slots/{i}", params={"action": "erase"})
            ok = ok and r.status_code == 200
        if not ok:
            print(f"warning: could not empty {self.url}'s prompt cache; this run may start warm "
                  "(llama-server: start it with --slot-save-path DIR --cache-ram 0)")

    async def _computed(self, client: Any) -> int | None:
        try:
            r = await client.get(f"{self.url}/metrics")
        except Exception:  # noqa: BLE001 - not every server has /metrics
            return None
        for line in r.text.splitlines() if r.status_code == 200 else []:
            if line.startswith("kdaserve_prompt_tokens "):
                return int(float(line.split()[1]))
        return None


class HFBackend:
    name = "hf"

    def __init__(self, path: str, tokenizer: Any) -> None:
        import torch
        from transformers import KimiLinearForCausalLM

        self.model = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.tokenizer = tokenizer

    def run(self, prompts: list[str], params: dict[str, Any], parallel: int,
            progress: Any) -> tuple[list[str], list[int], int]:
        import torch

        tok = self.tokenizer
        eos = None if params["ignore_eos"] else tok.eos_token_ids
        pad = tok.special_tokens.get("[PAD]", 0)
        texts, counts, total = [], [], 0
        for s in range(0, len(prompts), parallel):
            enc = [tok.encode(p) for p in prompts[s:s + parallel]]
            total += sum(map(len, enc))
            width = max(map(len, enc))
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])  # left padding
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=mask, do_sample=False,
                                          max_new_tokens=params["max_tokens"], eos_token_id=eos,
                                          pad_token_id=pad)
            for row in out[:, width:].tolist():
                if eos is not None:
                    row = row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))]
                text = tok.decode(row, skip_special_tokens=True)
                for stop in params["stop"]:  # stop strings, cut after generation
                    if stop in text:
                        text = text[: text.index(stop)]
                texts.append(text)
                counts.append(len(row))
            progress.update(len(enc))
        return texts, counts, total


def score(backend: str, parallel: int, texts: list[str], counts: list[int], computed: int,
          labels: list[Any], prompt_tokens: int, latency: float) -> RunResult:
    preds = [answer_value(t) for t in texts]
    n = len(labels)
    return RunResult(backend, parallel, n,
                     sum(p == lab for p, lab in zip(preds, labels, strict=True)) / n,
                     sum(p == INVALID for p in preds) / n, latency, prompt_tokens, computed,
                     sum(counts), sum(counts) / latency)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["backend"] for r in rows):
        pts = sorted((r["parallel"], r["output_tok_s"]) for r in rows if r["backend"] == name)
        ax.plot([p for p, _ in pts], [t for _, t in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("parallel requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("GSM8K throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_urls(spec: str) -> list[tuple[str, str]]:
    """`URL` or a comma list of `LABEL=URL` (one `openai` backend per server, named by its
    label in the table): `server=http://127.0.0.1:30000,llama.cpp=http://127.0.0.1:30300`."""
    out = []
    for item in spec.split(","):
        label, sep, url = item.partition("=")
        out.append((label, url) if sep and "://" not in label else ("openai", item))
    return out


def main(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from kdaserve.checkpoint import resolve_model_path
    from kdaserve.config import ModelConfig
    from kdaserve.tokenizer import Tokenizer

    rows = load_data(args.data)
    prompts, labels = build_prompts(rows, args.num_shots, args.num_questions)
    params = {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
              "stop": [] if args.ignore_eos else STOP}
    path = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_pretrained(path)
    parallels = [int(p) for p in str(args.parallel).split(",")]
    backends: list[Any] = []
    for name in args.backend.split(","):
        if name == "kdaserve":
            backends.append(KdaserveBackend(str(path), max(parallels),
                                            disable_prefix_cache=args.disable_prefix_cache,
                                            tp_size=args.tp_size))
        elif name == "openai":
            if not args.url:
                raise ValueError("--backend openai needs --url")
            for label, url in parse_urls(args.url):
                backends.append(OpenAIBackend(url, args.served_model, tokenizer, label))
        elif name == "hf":
            backends.append(HFBackend(str(path), tokenizer))
        else:
            raise ValueError(f"unknown backend {name!r} (kdaserve, openai, hf)")
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    machine = roofline.limits() if args.compare else None
    results: list[RunResult] = []
    for parallel in parallels:
        for _ in range(args.repeats):
            for b in backends:  # alternate backends: machine drift hits all alike
                with tqdm(total=len(prompts), desc=f"{b.name} p={parallel}", leave=False) as bar:
                    t0 = time.perf_counter()
                    texts, counts, computed = b.run(prompts, params, parallel, bar)
                    latency = time.perf_counter() - t0
                results.append(score(b.name, parallel, texts, counts,
                                     computed or prompt_tokens, labels, prompt_tokens, latency))
    if args.compare:
        machine = {k: (v + roofline.limits()[k]) / 2 if k != "threads" else v
                   for k, v in (machine or {}).items()}  # measured before and after
    table = [asdict(r) for r in results]
    cfg = ModelConfig.from_pretrained(path)
    costs = roofline.model_costs(cfg)
    base = {r["parallel"]: r["output_tok_s"] for r in table if r["backend"] == backends[0].name}
    for r in table:
        r["vs_" + backends[0].name] = round(r["output_tok_s"] / base[r["parallel"]], 3)
        if machine:
            # every computed row pays the row weights and its routed experts; only the rows
            # that sample (one per output token) pay the lm_head; attention is left out
            flops = roofline.flops(costs, r["prompt_tokens_computed"] + r["output_tokens"],
                                   r["output_tokens"])
            r["gflops"] = flops / r["latency_s"] / 1e9
            r["gemm_peak_fraction"] = r["gflops"] / machine["gemm_gflops"]
            steps = r["output_tokens"] / r["parallel"]
            bw = steps * roofline.decode_step_bytes(costs, r["parallel"]) / r["latency_s"]
            r["decode_read_gbps"] = bw / 1e9
            r["bandwidth_fraction"] = r["decode_read_gbps"] / machine["read_gbps"]
    _print(table, backends[0].name, machine)
    out = Path(args.out)
    write_result(out, {"model": str(path), "num_shots": args.num_shots,
                       "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
                       "machine": machine, "model_costs": asdict(costs), "rows": table})
    plot(table, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _print(table: list[dict[str, Any]], base: str, machine: dict[str, Any] | None) -> None:
    if machine:
        print(f"machine: fp32 GEMM {machine['gemm_gflops']:.1f} GFLOP/s, read "
              f"{machine['read_gbps']:.2f} GB/s, {machine['threads']} threads")
    head = (f"{'backend':>9} {'par':>4} {'acc':>6} {'inv':>6} {'latency':>8} {'out tok':>8} "
            f"{'tok/s':>8} {'vs ' + base:>12}")
    if machine:
        head += f" {'GFLOP/s':>8} {'%peak':>6} {'%bw':>6}"
    print(head)
    for r in table:
        line = (f"{r['backend']:>9} {r['parallel']:>4} {r['accuracy']:>6.3f} {r['invalid']:>6.3f} "
                f"{r['latency_s']:>8.2f} {r['output_tokens']:>8} {r['output_tok_s']:>8.1f} "
                f"{r['vs_' + base]:>11.2f}x")
        if machine:
            line += (f" {r['gflops']:>8.2f} {100 * r['gemm_peak_fraction']:>5.1f}% "
                     f"{100 * r['bandwidth_fraction']:>5.1f}%")
        print(line)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("gsm8k", help="GSM8K k-shot accuracy and throughput (bench_sglang.py)")
    p.add_argument("--model", default="bench", help="checkpoint (tokenizer, hf and kdaserve)")
    p.add_argument("--backend", default="kdaserve", help="comma list: kdaserve,openai,hf")
    p.add_argument("--url", default=None,
                   help="server URL for the openai backend, or LABEL=URL,LABEL=URL,...")
    p.add_argument("--served-model", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-questions", type=int, default=200)
    p.add_argument("--parallel", default="64", help="one or a comma list, e.g. 1,16,64")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--ignore-eos", action="store_true", help="fixed-length mode (no stops)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--compare", action="store_true",
                   help="measure GEMM peak and bandwidth in the same run; report fractions")
    p.add_argument("--disable-prefix-cache", action="store_true")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks of the in-process engine (each with "
                        "OMP_NUM_THREADS threads)")
    p.add_argument("--out", default="bench_results/gsm8k.json")
    p.set_defaults(func=main)
