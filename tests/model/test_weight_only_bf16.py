"""Weight-only bf16 on a CPU (`dtype="bfloat16"`): projections and experts stored bf16,
activations, norms, router and caches fp32. On a checkpoint stored in bf16 (as Kimi's are)
the weights are the same numbers, so outputs equal fp32 serving up to summation order; on an
fp32 checkpoint the rounding of the weights is the only difference, measured here."""

from __future__ import annotations

from pathlib import Path

import torch

from kdaserve import LLM, SamplingParams

PROMPTS = [[5, 9, 17, 33], list(range(40, 130)), [7] * 30]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def test_bf16_checkpoint_serves_as_fp32(tiny_ckpt: Path) -> None:
    fp32, bf16 = LLM(tiny_ckpt), LLM(tiny_ckpt, dtype="bfloat16")
    assert bf16.model.lm_head.weight.dtype == torch.bfloat16
    assert bf16.engine.states.recurrent.dtype == torch.float32
    a = fp32.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    b = bf16.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for u, v in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert all(abs(u[t] - v[t]) < 1e-4 for t in u)
    bf16.check_integrity()


def test_fp32_checkpoint_is_served_on_its_bf16_rounding(small_ckpt: Path) -> None:
    """The bf16 path computes what fp32 arithmetic on the rounded weights computes (how far
    that is from the fp32 weights' output is a property of the model: docs/benchmarks_log.md)."""
    bf16 = LLM(small_ckpt, dtype="bfloat16")
    rounded = LLM(small_ckpt)
    with torch.no_grad():
        for name, p in rounded.model.named_parameters():
            mine = bf16.model.get_parameter(name)
            if mine.dtype == torch.bfloat16:
                p.copy_(mine.float())
    ids = list(range(3, 400))
    torch.testing.assert_close(bf16.prefill_logits(ids), rounded.prefill_logits(ids),
                               atol=1e-4, rtol=1e-4)
    a = rounded.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    b = bf16.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
