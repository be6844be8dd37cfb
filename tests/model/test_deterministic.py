"""Deterministic inference (`enable_deterministic_inference`): one request's tokens, output
logprobs and prompt logprobs are bit-identical (asserted with ==) alone and inside batches of
1..64 mixed requests, under several chunk budgets, on a prefix-cache hit (prompt and decode
snapshots) and across preemption; and they are still the model's: close to the plain forward."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kdaserve import LLM, SamplingParams
from kdaserve.request import RequestOutput

from .conftest import clear_prompt

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 3}
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 8, "ignore_eos": True,
               "logprobs": 2}


def det(ckpt: Path, **kw) -> LLM:
    return LLM(ckpt, enable_deterministic_inference=True,
               **{"block_size": 8, "snapshot_interval": 16, **kw})


def fingerprint(out: RequestOutput) -> tuple:
    """Everything a request returns that depends on the arithmetic: compared with ==."""
    c = out.outputs[0]
    return (c.token_ids, c.logprobs, c.cumulative_logprob, out.prompt_logprobs)


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> LLM:
    return det(tiny_ckpt)


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    return clear_prompt(llm, 45, seed=5, continuation=8)


def others(n: int, seed: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 70))] for _ in range(n)]
    params = [SamplingParams(**{**(GREEDY if rng.random() < 0.5 else SAMPLED),
                                "max_tokens": rng.randint(1, 12), "seed": rng.randrange(99)})
              for _ in range(n)]
    return prompts, params


def run_among(llm: LLM, prompt: list[int], params: SamplingParams, n_others: int,
              seed: int) -> RequestOutput:
    prompts, ps = others(n_others, seed, llm.config.vocab_size)
    at = n_others // 2
    outs = llm.generate(prompt_token_ids=prompts[:at] + [prompt] + prompts[at:],
                        sampling_params=ps[:at] + [params] + ps[at:])
    llm.check_integrity()
    return outs[at]


@pytest.mark.parametrize("kind", [GREEDY, {**GREEDY, "prompt_logprobs": 2}, SAMPLED])
def test_same_bits_alone_batched_and_chunked(llm: LLM, tiny_ckpt: Path, prompt: list[int],
                                             kind: dict) -> None:
    params = SamplingParams(**kind)
    alone = fingerprint(llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0])
    for n in (1, 3, 16, 63):
        assert fingerprint(run_among(llm, prompt, params, n, seed=n)) == alone, n
    for budget in (5, 16):
        chunked = det(tiny_ckpt, max_num_batched_tokens=budget)
        assert fingerprint(run_among(chunked, prompt, params, 7, seed=budget)) == alone, budget


def test_same_bits_from_the_prefix_cache(tiny_ckpt: Path, prompt: list[int]) -> None:
    params = SamplingParams(**GREEDY)
    fresh = det(tiny_ckpt, disable_prefix_cache=True)
    cold = fingerprint(fresh.generate(prompt_token_ids=[prompt], sampling_params=params)[0])
    llm = det(tiny_ckpt)
    # a sibling sharing 33 tokens leaves prompt-side snapshots at 16 and 32
    llm.generate(prompt_token_ids=[prompt[:33] + [7, 8, 9]], sampling_params=params)
    hit = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert hit.num_cached_tokens >= 32
    assert fingerprint(hit) == cold
    # a follow-up turn resumes from the snapshot its first turn's decode left: same bits as
    # computing the whole conversation from scratch
    turn2 = prompt + hit.token_ids + [11, 12, 13]
    warm = llm.generate(prompt_token_ids=[turn2], sampling_params=params)[0]
    assert warm.num_cached_tokens > len(prompt)
    scratch = fresh.generate(prompt_token_ids=[turn2], sampling_params=params)[0]
    assert fingerprint(warm) == fingerprint(scratch)
    llm.check_integrity()


def test_same_bits_across_preemption(tiny_ckpt: Path, llm: LLM, prompt: list[int]) -> None:
    params = SamplingParams(**{**GREEDY, "max_tokens": 24})
    alone = fingerprint(llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0])
    tight = det(tiny_ckpt, block_size=4, max_total_tokens=160, max_num_batched_tokens=32)
    out = run_among(tight, prompt, params, 12, seed=3)
    assert tight.get_metrics()["num_preemptions"] > 0
    assert fingerprint(out) == alone


def test_deterministic_outputs_are_the_models(tiny_ckpt: Path, llm: LLM,
                                              prompt: list[int]) -> None:
    params = SamplingParams(**{**GREEDY, "prompt_logprobs": 1})
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    plain = LLM(tiny_ckpt).generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert out.token_ids == plain.token_ids
    for a, b in zip(out.outputs[0].logprobs + out.prompt_logprobs[1:],
                    plain.outputs[0].logprobs + plain.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_refused_combinations(tiny_ckpt: Path) -> None:
    from kdaserve.engine_config import EngineConfig

    for bad in ({"speculative_algorithm": "ngram"}, {"dtype": "bfloat16"},
                {"kernel_backend": "native"}, {"device": "cuda"}):
        with pytest.raises(ValueError, match="deterministic"):
            EngineConfig(model=str(tiny_ckpt), enable_deterministic_inference=True, **bad)
