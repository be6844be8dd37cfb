"""Weight-only int8 on a CPU (`quantization="int8"`): projections and experts quantized per
row once loaded; the engine computes what fp32 arithmetic on the dequantized weights computes
(how far that is from the float weights is measured in docs/benchmarks_log.md); weight updates are
refused, not half done."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.engine_config import EngineConfig
from kdaserve.kernels.native import ops as native_ops
from kdaserve.kernels.ref.quant import dequantize
from kdaserve.layers.linear import Linear
from kdaserve.layers.moe import MoE

PROMPTS = [[5, 9, 17, 33], list(range(40, 130)), [7] * 30]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def test_int8_engine_is_fp32_math_on_the_dequantized_weights(small_ckpt: Path) -> None:
    q = LLM(small_ckpt, quantization="int8")
    ref = LLM(small_ckpt)
    with torch.no_grad():
        mods = dict(ref.model.named_modules())
        for name, m in q.model.named_modules():
            if isinstance(m, Linear):
                assert (m.weight.dtype == torch.int8) == (not name.endswith("kv_b_proj"))
                mods[name].weight.copy_(dequantize(m.weight, m.scale, torch.float32))
            elif isinstance(m, MoE):
                mods[name].w13.copy_(dequantize(m.w13, m.w13_scale, torch.float32))
                mods[name].w2.copy_(dequantize(m.w2, m.w2_scale, torch.float32))
    ids = list(range(3, 300))
    # on an AMX host the prefill's int8 products run on the tiles as exact bf16 panels
    # against split fp32 activations (2^-16 relative a term, test_native_amx.py): a few of
    # 4.9M logits then land past 1e-4 (1.2e-4 seen); elsewhere fp32 arithmetic throughout
    torch.testing.assert_close(q.prefill_logits(ids), ref.prefill_logits(ids),
                               atol=3e-4 if native_ops.amx() else 1e-4, rtol=1e-4)
    a = q.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    b = ref.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    q.check_integrity()


def test_int8_refuses_what_it_does_not_do(tiny_ckpt: Path) -> None:
    q = LLM(tiny_ckpt, quantization="int8")
    before = q.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)[0].token_ids
    for call in (lambda: q.engine.rl.update_weights_from_disk(str(tiny_ckpt)),
                 lambda: q.engine.rl.release_memory_occupation(["weights"])):
        with pytest.raises(ValueError, match="int8-quantized"):
            call()
    assert q.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)[0].token_ids \
        == before
    for bad in ({"quantization": "int4"}, {"quantization": "int8", "dtype": "bfloat16"},
                {"quantization": "int8", "enable_deterministic_inference": True}):
        with pytest.raises(ValueError, match="int8|quantiz"):
            EngineConfig(model=str(tiny_ckpt), **bad)
