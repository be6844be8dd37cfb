"""Throughput smoke on CUDA with the triton KDA kernels: the `bench` preset (random weights),
64-token random prompts, 32 greedy tokens, batch 1 and 16, bf16 and fp32; and the fp32
CUDA tokens against the CPU reference backend at batch 1."""

from __future__ import annotations

import tempfile
import time

import torch

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import make_checkpoint

path = tempfile.mkdtemp()
make_checkpoint(path, "bench", seed=0)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(1000, 50000, (64,), generator=g).tolist() for _ in range(16)]
params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
first: dict[str, list[int]] = {}
for dtype in ("bfloat16", "float32"):
    llm = LLM(path, device="cuda", dtype=dtype)
    for batch in (1, 16):
        llm.generate(prompt_token_ids=prompts[:batch], sampling_params=params)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts[:batch], sampling_params=params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"cuda {dtype} batch {batch}: {batch * 32 / dt:.1f} output tok/s ({dt:.2f} s)")
        first[dtype] = outs[0].token_ids
    llm.check_integrity()
cpu = LLM(path, kernel_backend="ref").generate(prompt_token_ids=prompts[:1],
                                               sampling_params=params)[0].token_ids
same = sum(a == b for a, b in zip(first["float32"], cpu, strict=True))
print(f"fp32 cuda vs cpu ref: {same}/32 greedy tokens equal (first {first['float32'][:8]})")
