"""Whole-model parity with transformers' KimiLinearForCausalLM (fp32, same checkpoint)."""

from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams

from .conftest import routing_margin

# Router score gaps below this are near-ties that two correct fp32 implementations may break
# differently (see routing_margin). Inputs that hit one are redrawn (a few percent do), and the
# margin is asserted, so every comparison below is one where only a bug can cause a mismatch.
MIN_MARGIN = 1e-5


def clear_prompt(llm: LLM, length: int, seed: int, continuation: int = 0) -> list[int]:
    """A random prompt whose forward (and greedy continuation) has no router near-tie."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(10):
        ids = torch.randint(0, llm.config.vocab_size - 256, (length,), generator=g).tolist()
        full = ids
        if continuation:
            params = SamplingParams(temperature=0.0, max_tokens=continuation, ignore_eos=True)
            full = ids + llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids
        if routing_margin(llm, full) > MIN_MARGIN:
            return ids
    raise AssertionError("could not draw a prompt without router near-ties")


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
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length"
