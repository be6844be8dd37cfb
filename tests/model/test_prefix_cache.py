"""KDA-aware prefix caching: greedy outputs with the cache equal those without it, the cache
actually hits, and every block and state slot is accounted for after each run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_ckpt: Path) -> LLM:
    return LLM(tiny_ckpt, disable_prefix_cache=True)


def cached(ckpt: Path, **kw) -> LLM:
    return LLM(ckpt, **kw)


def run_waves(llm: LLM, waves: list[list[list[int]]]) -> list[list[int]]:
    out = []
    for wave in waves:
        out += [o.token_ids for o in llm.generate(prompt_token_ids=wave, sampling_params=GREEDY)]
        llm.check_integrity()
    return out


def expected(plain: LLM, waves: list[list[list[int]]]) -> list[list[int]]:
    flat = [p for w in waves for p in w]
    return [o.token_ids for o in plain.generate(prompt_token_ids=flat, sampling_params=GREEDY)]


def rand(n: int, seed: int) -> list[int]:
    return torch.randint(0, 3800, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def gsm8k_prompts(tok, path: Path, n: int, shots: int = 8) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[: shots + n]]
    prefix = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:shots])
    return [tok.encode(prefix + f"Question: {r['question']}\nAnswer:") for r in rows[shots:]]


def test_gsm8k_8shot_shared_examples(tiny_ckpt: Path, plain: LLM, gsm8k_file: Path) -> None:
    llm = cached(tiny_ckpt)
    prompts = gsm8k_prompts(llm.tokenizer, gsm8k_file, 6)
    waves = [prompts[:2], prompts[2:4], prompts[4:]]
    assert run_waves(llm, waves) == expected(plain, waves)
    m = llm.get_metrics()
    # wave 2 learns the branch point of the shared examples, wave 3 resumes from it
    shared = next(i for i, col in enumerate(zip(*prompts, strict=False)) if len(set(col)) > 1)
    assert m["prefix_cache_hit_tokens"] >= 2 * (shared // 64 * 64)


def test_multi_turn_chat_resumes_from_last_turn(tiny_ckpt: Path, plain: LLM) -> None:
    llm = cached(tiny_ckpt)
    convo = rand(40, 1)
    hits = []
    for turn in range(4):
        prompt = convo + rand(9 + 5 * turn, 10 + turn)  # the new user message
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].token_ids
        hits.append(llm.get_metrics()["prefix_cache_hit_tokens"] - before)
        assert out == plain.generate(prompt_token_ids=[prompt],
                                     sampling_params=GREEDY)[0].token_ids
        llm.check_integrity()
        convo = prompt + out
    # every later turn resumes at least from the previous prompt's last block boundary
    assert all(h >= 32 for h in hits[1:]), hits


def test_prompts_diverging_mid_chunk(tiny_ckpt: Path, plain: LLM) -> None:
    llm = cached(tiny_ckpt, max_num_batched_tokens=48)  # chunks of 48 across the fork
    shared = rand(100, 2)  # fork mid-block and mid-snapshot-interval
    waves = [[shared + rand(30, 3)], [shared + rand(25, 4)], [shared + rand(7, 5)],
             [shared[:70] + rand(20, 6)]]
    assert run_waves(llm, waves) == expected(plain, waves)
    assert llm.get_metrics()["prefix_cache_hit_tokens"] >= 64 + 64


def test_identical_prompts_and_prefix_of_another(tiny_ckpt: Path, plain: LLM) -> None:
    llm = cached(tiny_ckpt)
    a = rand(77, 7)
    waves = [[a], [a], [a + rand(40, 8)], [a[:50]], [a]]
    assert run_waves(llm, waves) == expected(plain, waves)
    m = llm.get_metrics()
    assert m["prefix_cache_hit_tokens"] >= 64 + 64 + 48  # identical, extended, shortened


def test_eviction_pressure_tiny_pool(tiny_ckpt: Path, plain: LLM) -> None:
    llm = cached(tiny_ckpt, block_size=4, snapshot_interval=16, max_total_tokens=360,
                 num_snapshot_slots=2, max_num_batched_tokens=40, max_num_seqs=4)
    base = rand(60, 9)
    prompts = [base[: 20 + 7 * i] + rand(15, 20 + i) for i in range(6)] + [base, base]
    waves = [prompts[i:i + 3] for i in range(0, len(prompts), 3)]
    assert run_waves(llm, waves) == expected(plain, waves)
    m = llm.get_metrics()
    assert m["cached_snapshots"] <= 2
    assert m["prefix_cache_hit_tokens"] > 0
    assert llm.engine.flush_cache()
    llm.check_integrity()
    m = llm.get_metrics()
    assert m["free_blocks"] == m["total_blocks"]
    assert m["free_state_slots"] == m["total_state_slots"]


def test_disable_prefix_cache(tiny_ckpt: Path) -> None:
    llm = LLM(tiny_ckpt, disable_prefix_cache=True)
    a = rand(70, 11)
    run_waves(llm, [[a], [a]])
    m = llm.get_metrics()
    assert m["prefix_cache_hit_tokens"] == 0 and m["cached_blocks"] == 0
    assert m["free_blocks"] == m["total_blocks"]


def test_prefill_chunk_ends_leave_snapshots(tiny_ckpt: Path, plain: LLM) -> None:
    """With chunked prefill, a long prompt leaves a snapshot at each grid-aligned chunk end, so
    the very first request forking from it already resumes from the last one before the fork."""
    llm = cached(tiny_ckpt, max_num_batched_tokens=128)
    long = rand(400, 12)
    waves = [[long], [long[:300] + rand(20, 13)]]
    before = llm.get_metrics()["prefix_cache_hit_tokens"]
    outs = [o for w in waves
            for o in [llm.generate(prompt_token_ids=w, sampling_params=GREEDY)[0].token_ids]]
    llm.check_integrity()
    assert outs == expected(plain, waves)
    assert llm.get_metrics()["prefix_cache_hit_tokens"] - before == 256


def test_in_batch_dedup_first_wave_hits(tiny_ckpt: Path, plain: LLM, gsm8k_file: Path) -> None:
    """Requests submitted together that share a long prefix: one computes it (and is told to
    snapshot where they fork), the others wait for it and resume from that snapshot."""
    llm = cached(tiny_ckpt)
    prompts = gsm8k_prompts(llm.tokenizer, gsm8k_file, 4)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    llm.check_integrity()
    assert [o.token_ids for o in outs] == expected(plain, [prompts])
    shared = next(i for i, col in enumerate(zip(*prompts, strict=False)) if len(set(col)) > 1)
    assert llm.get_metrics()["prefix_cache_hit_tokens"] >= 3 * (shared // 64 * 64)
