"""return_hidden_states: every forwarded position's final-normed hidden state (the prompt's,
then each output token's but the last), equal to a plain forward's and transformers' (fp32),
through batching, chunked prefill, a prefix-cache hit and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdaserve import LLM, RequestOptions, SamplingParams

from .conftest import clear_prompt

NEW = 6


def check(llm: LLM, prompt: list[int], out, hf=None) -> None:
    h = out.outputs[0].hidden_states
    ids = prompt + out.token_ids[:-1]
    assert h is not None and h.shape == (len(ids), llm.config.hidden_size)
    torch.testing.assert_close(h, llm.prefill_hidden(ids), atol=1e-5, rtol=1e-5)
    if hf is not None:
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(h, ref.float(), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def prompts(tiny_ckpt: Path) -> list[list[int]]:
    llm = LLM(tiny_ckpt)
    return [clear_prompt(llm, n, seed=300 + n, continuation=NEW) for n in (1, 9, 40, 75)]


HIDDEN = RequestOptions(return_hidden_states=True)


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True, **kw})


def test_hidden_states_batched_and_chunked_match_transformers(tiny_ckpt: Path, prompts,
                                                              hf_tiny) -> None:
    llm = LLM(tiny_ckpt, max_num_batched_tokens=16, block_size=8)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts + prompts[:2],
                        sampling_params=[params()] * len(prompts) + [plain] * 2,
                        options=[HIDDEN] * len(prompts) + [RequestOptions()] * 2)
    for p, out in zip(prompts, outs, strict=False):
        check(llm, p, out, hf_tiny)
    assert all(o.outputs[0].hidden_states is None for o in outs[len(prompts):])
    llm.check_integrity()


def test_hidden_states_on_a_prefix_hit_and_after_preemption(tiny_ckpt: Path, prompts) -> None:
    llm = LLM(tiny_ckpt, block_size=4, snapshot_interval=16, max_total_tokens=200,
              max_num_batched_tokens=32)
    p = prompts[3]
    llm.generate(prompt_token_ids=[p], sampling_params=params())
    hit = llm.generate(prompt_token_ids=[p], sampling_params=params(), options=HIDDEN)[0]
    assert hit.num_cached_tokens == 0  # every row must run to produce its hidden state
    check(llm, p, hit)
    outs = llm.generate(prompt_token_ids=prompts * 3, sampling_params=params(max_tokens=20),
                        options=HIDDEN)
    assert llm.get_metrics()["num_preemptions"] > 0
    for q, out in zip(prompts * 3, outs, strict=True):
        check(llm, q, out)
    llm.check_integrity()
