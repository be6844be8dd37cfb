"""Throughput smoke on CUDA with the triton kernels: decode time per step (TPOT, prefill
taken out) at batch 1, 16 and 64 after 64-token random prompts, on the `bench` preset in bf16
with and without CUDA graphs, without overlap scheduling, and in fp32, and on the Kimi-shaped
preset in bf16 with and without graphs; the fp32 CUDA tokens against the CPU reference
backend at batch 1; the share of a decode step spent in its graph; GSM8K fixed-length
output at parallel 64; verify steps from graphs against eager ones; then the fused MoE, the
paged MLA and the fused KDA decode kernels alone, each against the H200's 4.8 TB/s."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import make_checkpoint
from kdaserve.engine.cuda_graph import GraphKey

path = tempfile.mkdtemp()
make_checkpoint(path, "bench", seed=0)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(1000, 50000, (64,), generator=g).tolist() for _ in range(64)]
params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def timed(llm: LLM, batch: int, tokens: int) -> tuple[float, list[int]]:
    p = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts[:batch], sampling_params=p)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, outs[0].token_ids


def decode_speed(llm: LLM, batch: int) -> tuple[float, list[int]]:
    """Seconds per decode step, the prefill taken out: (65 tokens - 1 token) / 64."""
    timed(llm, batch, 65)  # warm-up: compiles, autotunes, captures this bucket's graph
    one, _ = timed(llm, batch, 1)
    many, ids = timed(llm, batch, 65)
    return (many - one) / 64, ids


H200_TBPS = 4.8  # HBM3e read bandwidth, the kernels' roofline at decode shapes


def peak(tbps: float) -> str:
    return f"{tbps:.2f} TB/s, {tbps / H200_TBPS:.0%} of the H200's"


def graph_share(llm: LLM, batch: int, step: float) -> str:
    """The decode step's graph replayed alone (its GPU time, the host's work taken out)
    against the whole step: the share of a step spent in the graph. The buffers are made all
    padding first, so the replays touch only the scratch rows, never a cached block."""
    runner = llm.engine.runner.graphs
    key = GraphKey(runner.bucket(batch), 1, None)
    if key not in runner.graphs:
        return ", no graph"
    runner.pad(0, runner.max_bs, 1)
    runner.filled = 0
    graph = runner.graphs[key]
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    replay = (time.perf_counter() - t0) / 50
    return f", graph replay {replay * 1e3:.2f} ms = {replay / step:.0%} of the step"


first: dict[str, list[int]] = {}
made = {"bench": path}
# decode steps from CUDA graphs (the default) against eager steps, same tokens expected; and
# the host's step not overlapped with the GPU's (engine/overlap.py)
for preset, dtype, graphs, overlap in (
        ("bench", "bfloat16", True, True), ("bench", "bfloat16", False, True),
        ("bench", "bfloat16", True, False), ("bench", "float32", True, True),
        ("kimi-shaped", "bfloat16", True, True), ("kimi-shaped", "bfloat16", False, True)):
    try:
        if preset not in made:  # (the Kimi-shaped one is 12 GB: written once)
            made[preset] = make_checkpoint(tempfile.mkdtemp(), preset, seed=0)
        llm = LLM(made[preset], device="cuda", dtype=dtype, disable_cuda_graph=not graphs,
                  disable_overlap_schedule=not overlap)
        assert llm.engine.overlap == overlap
        mode = ("graphs" if graphs else "eager") + ("" if overlap else " no-overlap")
        for batch in (1, 16, 64):
            step, ids = decode_speed(llm, batch)
            print(f"cuda {preset} {dtype} {mode} batch {batch}: "
                  f"TPOT {step * 1e3:.2f} ms, {batch / step:.0f} decode tok/s"
                  f"{graph_share(llm, batch, step) if graphs else ''}", flush=True)
            first.setdefault(f"{preset} {dtype} {mode}", ids)
        llm.check_integrity()
        del llm
    except Exception as e:  # noqa: BLE001 - the other rows still print
        print(f"cuda {preset} {dtype} graphs={graphs} overlap={overlap}: FAILED "
              f"{type(e).__name__}: {e}")
for preset, other in (("bench", "eager"), ("bench", "graphs no-overlap"),
                      ("kimi-shaped", "eager")):
    a, b = first.get(f"{preset} bfloat16 graphs"), first.get(f"{preset} bfloat16 {other}")
    if a and b:
        same = sum(x == y for x, y in zip(a, b, strict=True))
        print(f"{preset} bf16 graphs vs {other}: {same}/{len(a)} greedy tokens equal")
first["float32"] = first.get("bench float32 graphs", [])[:32]
if first["float32"]:
    cpu = LLM(path, kernel_backend="ref").generate(prompt_token_ids=prompts[:1],
                                                   sampling_params=params)[0].token_ids
    same = sum(a == b for a, b in zip(first["float32"], cpu, strict=True))
    print(f"fp32 cuda vs cpu ref: {same}/32 greedy tokens equal (first {first['float32'][:8]})")
else:
    print("fp32 cuda vs cpu ref: no fp32 CUDA run to compare")

# GSM8K 5-shot prompts, fixed-length output (256 tokens, no stops) at parallel 64: output
# tok/s on both presets in bf16 with graphs (the data: GSM8K_DATA or ../shared's copy)
from kdaserve.bench.gsm8k import build_prompts, load_data  # noqa: E402

data = os.environ.get("GSM8K_DATA", "../shared/data/gsm8k/test.jsonl")
for preset in ("bench", "kimi-shaped"):
    if not os.path.isfile(data) or preset not in made:
        print(f"gsm8k {preset}: no data at {data} (set GSM8K_DATA) or no checkpoint")
        continue
    try:
        texts, _ = build_prompts(load_data(data), 5, 64)
        llm = LLM(made[preset], device="cuda", dtype="bfloat16", max_num_seqs=64)
        p = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
        llm.generate(texts[:8], p)  # warm-up: compiles, captures, fills the prefix cache
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(texts, p)
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        print(f"gsm8k 5-shot {preset} bf16 parallel 64, 256 tokens each: {n / took:.0f} "
              f"output tok/s ({took:.2f} s)", flush=True)
        del llm
    except Exception as e:  # noqa: BLE001 - the other rows still print
        print(f"gsm8k {preset}: FAILED {type(e).__name__}: {e}")

# Verify steps from CUDA graphs against eager ones (bench, bf16, batch 16): every request
# drafts the plain engine's own next 3 tokens corrupted at the third (each verify of 4 tokens
# a sequence keeps 2 and rolls back), so both runs verify alike; tokens must be the plain
# engine's.
import math  # noqa: E402

from kdaserve.speculative.schedule import StepCost  # noqa: E402
from kdaserve.speculative.scripted import ScriptedDrafter  # noqa: E402

try:
    p = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = LLM(path, device="cuda", dtype="bfloat16", disable_prefix_cache=True)
    refs = [o.token_ids for o in plain.generate(prompt_token_ids=prompts[:16],
                                                sampling_params=p)]
    del plain
    futures = {tuple(q): r for q, r in zip(prompts[:16], refs, strict=True)}
    for graphs in (True, False):
        llm = LLM(path, device="cuda", dtype="bfloat16", disable_prefix_cache=True,
                  disable_cuda_graph=not graphs, speculative_algorithm="ngram",
                  speculative_num_draft_tokens=3)
        llm.engine.spec.cost = StepCost(fitted=False, prior_tokens=math.inf)
        llm.engine.spec.drafter = ScriptedDrafter(None, 3, llm.config.vocab_size, futures, {2})
        for _ in range(2):  # the first run captures
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts[:16], sampling_params=p)
            torch.cuda.synchronize()
            took = time.perf_counter() - t0
        same = sum(o.token_ids == r for o, r in zip(outs, refs, strict=True))
        verifies = llm.get_metrics()["spec_num_verifies"] / 2
        print(f"verify bench bf16 batch 16 {'graphs' if graphs else 'eager'}: {took:.2f} s "
              f"for 16 x 64 tokens ({16 * 64 / took:.0f} tok/s, {verifies:.0f} request "
              f"verifies a run), {same}/16 outputs equal the plain engine's", flush=True)
        del llm
except Exception as e:  # noqa: BLE001 - the kernel rows still print
    print(f"verify graphs: FAILED {type(e).__name__}: {e}")

# The fused MoE (kdaserve/kernels/triton/moe.py) alone, on Kimi Linear's expert shapes (256
# experts top-8, hidden 2304, expert width 1024), bf16: time per call against the reference's
# expert loop, and the bandwidth of the distinct experts' weights it must read (H200: 4.8 TB/s).
from kdaserve.kernels.ref.moe import moe_experts_ref  # noqa: E402
from kdaserve.kernels.triton.moe import moe_experts_triton  # noqa: E402

E, D, inter, k = 256, 2304, 1024, 8
w13 = torch.randn(E, 2 * inter, D, device="cuda", dtype=torch.bfloat16) / D ** 0.5
w2 = torch.randn(E, D, inter, device="cuda", dtype=torch.bfloat16) / inter ** 0.5
for T in (1, 16, 64, 256):
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    weights = torch.rand(T, k, device="cuda")
    times = {}
    for name, fn in (("triton", moe_experts_triton), ("ref", moe_experts_ref)):
        fn(x, weights, ids, w13, w2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn(x, weights, ids, w13, w2)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 10
    touched = ids.unique().numel() * 3 * inter * D * 2  # bytes of the experts read
    tbps = touched / times["triton"] / 1e12
    print(f"moe T={T}: triton {times['triton'] * 1e6:.0f} us ({peak(tbps)} of "
          f"{touched / 1e6:.0f} MB), ref loop {times['ref'] * 1e6:.0f} us")

# The same kernel on MXFP4 experts (W4A16, K3's format) at K3's expert shapes (latent 3584,
# expert width 3072, top-16 of 896; 32 experts held here): against the reference on the
# dequantized weights, and the bandwidth of the packed bytes (codes and scales) it must read.
from kdaserve.kernels.ref.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402

try:
    E, D, inter, k = 32, 3584, 3072, 16
    situ = (4.0, 25.0)
    w13 = torch.randn(E, 2 * inter, D, device="cuda") / D ** 0.5
    w2 = torch.randn(E, D, inter, device="cuda") / inter ** 0.5
    (q13, s13), (q2, s2) = quantize_mxfp4(w13.cpu()), quantize_mxfp4(w2.cpu())
    q13, s13, q2, s2 = (t.cuda() for t in (q13, s13, q2, s2))
    d13, d2 = (dequantize_mxfp4(q, s).cuda().bfloat16() for q, s in ((q13.cpu(), s13.cpu()),
                                                                     (q2.cpu(), s2.cpu())))
    del w13, w2
    for T in (1, 16, 64):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        weights = torch.rand(T, k, device="cuda")
        got = moe_experts_triton(x, weights, ids, q13, q2, s13, s2, situ=situ)
        want = moe_experts_triton(x, weights, ids, d13, d2, situ=situ)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            moe_experts_triton(x, weights, ids, q13, q2, s13, s2, situ=situ)
        torch.cuda.synchronize()
        took = (time.perf_counter() - t0) / 10
        t0 = time.perf_counter()
        for _ in range(10):
            moe_experts_triton(x, weights, ids, d13, d2, situ=situ)
        torch.cuda.synchronize()
        dense = (time.perf_counter() - t0) / 10
        touched = ids.unique().numel() * 3 * inter * D * (0.5 + 1 / 32)
        print(f"moe mxfp4 T={T}: {took * 1e6:.0f} us ({peak(touched / took / 1e12)} of "
              f"{touched / 1e6:.0f} MB packed), bf16 experts {dense * 1e6:.0f} us, max err "
              f"{err:.1e} of the bf16 kernel's largest output", flush=True)
except Exception as e:  # noqa: BLE001 - the other rows still print
    print(f"moe mxfp4: FAILED {type(e).__name__}: {e}")

# The paged MLA kernel (kdaserve/kernels/triton/mla.py) alone, decodes on Kimi's latent shapes
# (32 heads, kv_lora 512, rope 64, pages of 16), bf16: time per call, and the bandwidth of the
# latents it must read, against the reference's per-sequence loop.
from kdaserve.kernels.ref.mla import mla_attention_ref  # noqa: E402
from kdaserve.kernels.triton.mla import mla_attention_triton  # noqa: E402

H, Dn, Dr, R, page = 32, 128, 64, 512, 16
for B, ctx in ((1, 4096), (16, 4096), (64, 2048)):
    pages = -(-ctx // page)
    kv = torch.randn(B * pages, page, R + Dr, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(B * pages, device="cuda").view(B, pages)
    args = (torch.randn(B, H, Dn, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, H, Dr, device="cuda", dtype=torch.bfloat16), kv, table,
            torch.arange(B + 1, device="cuda"), torch.full((B,), ctx, device="cuda"),
            torch.randn(H, Dn, R, device="cuda", dtype=torch.bfloat16) / Dn ** 0.5,
            torch.randn(H, 128, R, device="cuda", dtype=torch.bfloat16) / R ** 0.5, 0.07)
    times = {}
    for name, fn in (("triton", mla_attention_triton), ("ref", mla_attention_ref)):
        fn(*args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn(*args)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 10
    read = B * ctx * (R + Dr) * 2
    print(f"mla B={B} ctx={ctx}: triton {times['triton'] * 1e6:.0f} us "
          f"({peak(read / times['triton'] / 1e12)} of {read / 1e6:.0f} MB), "
          f"ref loop {times['ref'] * 1e6:.0f} us")

# The fused KDA decode (kdaserve/kernels/triton/kda_kernels.py) alone against fla's recurrent
# kernel with our conv and fla's gated norm (what kda_decode_triton ran before), on Kimi
# Linear's KDA shapes (32 heads x 128, conv 4), bf16 with fp32 states: time per call and the
# bandwidth of the states it must read and write.
import kdaserve.kernels.triton.kda as triton_kda  # noqa: E402

H, K, W = 32, 128, 4
C = 3 * H * K
for B in (1, 16, 64):
    N = B + 1
    state = torch.randn(N, H, K, K, device="cuda") * 0.1
    conv = torch.randn(N, W - 1, C, device="cuda", dtype=torch.bfloat16)
    args = (torch.randn(B, C, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, H, K, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, H, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, H, K, device="cuda", dtype=torch.bfloat16),
            torch.randn(C, W, device="cuda", dtype=torch.bfloat16) / W,
            torch.rand(H, device="cuda"), torch.randn(H * K, device="cuda"),
            torch.randn(K, device="cuda", dtype=torch.bfloat16), 1e-5)
    slots = torch.arange(B, device="cuda")
    times = {}
    for name, most in (("fused", triton_kda.FUSED_MAX_STATE), ("fla", 0)):
        triton_kda.FUSED_MAX_STATE = most  # 0: every head is "too large", fla's path
        triton_kda.kda_decode_triton(*args, state, conv, slots)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            triton_kda.kda_decode_triton(*args, state, conv, slots)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 20
    triton_kda.FUSED_MAX_STATE = 128 * 128
    moved = B * H * K * K * 4 * 2  # each state read and written once
    print(f"kda decode B={B}: fused {times['fused'] * 1e6:.0f} us "
          f"({peak(moved / times['fused'] / 1e12)} of {moved / 1e6:.0f} MB), "
          f"fla's recurrence + our conv + fla's norm {times['fla'] * 1e6:.0f} us")
