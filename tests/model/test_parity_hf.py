"""Whole-model parity with transformers' KimiLinearForCausalLM (fp32, same checkpoint)."""

from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams

from .conftest import clear_prompt, hf_greedy


@pytest.fixture(params=["tiny", "small"])
def pair(request: pytest.FixtureRequest) -> tuple[LLM, torch.nn.Module]:
    ckpt = request.getfixturevalue(f"{request.param}_ckpt")
    hf = request.getfixturevalue(f"hf_{request.param}")
    return LLM(ckpt), hf


@pytest.mark.parametrize("length", [1, 37, 64, 150])
def test_prefill_logits_match_transformers(pair, length: int) -> None:
    llm, hf = pair
    ids = clear_prompt(llm, length, seed=length)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = llm.prefill_logits(ids)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, f"max |logit diff| {diff:.2e} vs transformers"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_decode_token_identical_to_transformers(pair) -> None:
    """8 prompts of different lengths, generated together in one batch, 32 new tokens each."""
    llm, hf = pair
    prompts = [clear_prompt(llm, n, seed=100 + n, continuation=32)
               for n in (1, 3, 8, 16, 31, 64, 65, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 32)
        assert out.finish_reason == "length"
