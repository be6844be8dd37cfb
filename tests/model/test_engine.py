"""Engine paths (batching, chunked prefill, paging, staggered arrival, preemption, abort) give
the same greedy tokens as transformers on the same checkpoint, and free every block and slot."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.engine_config import EngineConfig

from .conftest import clear_prompt, hf_greedy

LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 63, 64, 65, 89, 100, 130, 200]
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_ckpt: Path) -> LLM:
    return LLM(tiny_ckpt)


@pytest.fixture(scope="module")
def cases(base: LLM, hf_tiny: torch.nn.Module) -> list[tuple[list[int], list[int]]]:
    """16 prompts of very different lengths with transformers' greedy continuations."""
    prompts = [clear_prompt(base, n, seed=1000 + n, continuation=NEW) for n in LENGTHS]
    return [(p, hf_greedy(hf_tiny, p, NEW)) for p in prompts]


def make_llm(ckpt: Path, **kw) -> Iterator[LLM]:
    llm = LLM(ckpt, **kw)
    yield llm
    llm.check_integrity()  # after every engine test: all blocks and slots free again


def test_batch_equals_alone_equals_transformers(base: LLM, cases) -> None:
    together = base.generate(prompt_token_ids=[p for p, _ in cases], sampling_params=GREEDY)
    for (prompt, ref), out in zip(cases, together, strict=True):
        assert out.token_ids == ref
        alone = base.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
        assert alone.token_ids == ref
    base.check_integrity()


@pytest.mark.parametrize("backend", ["ref", "cpu", "native"])
def test_kernel_backends_give_transformers_tokens(tiny_ckpt: Path, cases, backend: str) -> None:
    """Every kernel backend, end to end through batched prefill and decode."""
    for llm in make_llm(tiny_ckpt, kernel_backend=backend):
        outs = llm.generate(prompt_token_ids=[p for p, _ in cases], sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == [r for _, r in cases]


@pytest.mark.parametrize("budget", [1, 7, 64], ids=lambda b: f"budget{b}")
@pytest.mark.parametrize("block_size", [1, 16], ids=lambda b: f"block{b}")
def test_chunk_budget_and_block_size(tiny_ckpt: Path, cases, budget: int,
                                     block_size: int) -> None:
    sub = cases[::2] if budget == 1 else cases  # budget 1 = one token per step: keep it short
    for llm in make_llm(tiny_ckpt, max_num_batched_tokens=budget, block_size=block_size):
        outs = llm.generate(prompt_token_ids=[p for p, _ in sub], sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == [r for _, r in sub]


def test_staggered_arrival(tiny_ckpt: Path, cases) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), max_num_batched_tokens=48))
    results: dict[str, list[int]] = {}
    pending = list(enumerate(cases))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:  # a new request every third step, mid-decode of others
            i, (prompt, _) = pending.pop(0)
            engine.add_request(prompt, GREEDY, rid=str(i))
        for out in engine.step():
            if out.finished:
                results[out.rid] = out.token_ids
        engine.check_integrity()
        step += 1
    assert [results[str(i)] for i in range(len(cases))] == [r for _, r in cases]
    engine.check_integrity()


def test_itl_target_caps_prompts_beside_decodes(tiny_ckpt: Path, cases) -> None:
    """itl_target_ms, with staggered arrivals: the step cost is fitted from the engine's own
    steps; once fitted, a target no step can meet leaves prompts one block a step beside
    decodes (and the full budget with none), and tokens stay transformers'."""
    config = EngineConfig(model=str(tiny_ckpt), max_num_batched_tokens=64, block_size=4,
                          itl_target_ms=1e-3)
    engine = LLMEngine(config)
    budget = engine.scheduler.itl_budget
    assert budget is not None and not engine.overlap
    schedule = engine.scheduler.schedule
    mixed: list[int] = []  # prompt tokens of steps beside decodes, once the cost was fitted
    alone: list[int] = []  # prompt tokens of steps with no decode

    def recording_schedule():
        decoding = {id(r) for r in engine.scheduler.running if not r.is_prefilling}
        fitted = budget.coef is not None
        batch = schedule()
        prompt = sum(n for r, n in zip(batch.reqs, batch.num_new_tokens, strict=True)
                     if id(r) not in decoding)
        if decoding and prompt and fitted:
            mixed.append(prompt)
        elif not decoding:
            alone.append(prompt)
        return batch

    engine.scheduler.schedule = recording_schedule
    results: dict[str, list[int]] = {}
    pending = list(enumerate(cases))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            i, (prompt, _) = pending.pop(0)
            engine.add_request(prompt, GREEDY, rid=str(i))
        for out in engine.step():
            if out.finished:
                results[out.rid] = out.token_ids
        step += 1
    assert [results[str(i)] for i in range(len(cases))] == [r for _, r in cases]
    assert budget.coef is not None and len(mixed) >= 10
    assert max(mixed) == 4, mixed  # the floor: one block
    assert max(alone) > 4, alone  # no decode, no cap: the step budget
    engine.check_integrity()


def test_preemption_under_tiny_pool(tiny_ckpt: Path, cases) -> None:
    # room for ~2 long requests at a time: most get preempted and recomputed at least once
    for llm in make_llm(tiny_ckpt, block_size=4, max_total_tokens=2 * (200 + NEW) + 8,
                        max_num_batched_tokens=64):
        outs = llm.generate(prompt_token_ids=[p for p, _ in cases], sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == [r for _, r in cases]
        assert llm.get_metrics()["num_preemptions"] > 0


def test_state_slots_bound_concurrency(tiny_ckpt: Path, cases) -> None:
    for llm in make_llm(tiny_ckpt, num_state_slots=3):
        engine = llm.engine
        for i, (prompt, _) in enumerate(cases[:8]):
            engine.add_request(prompt, GREEDY, rid=str(i))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.rid] = out.token_ids
            assert len(engine.scheduler.running) <= 3
        assert [done[str(i)] for i in range(8)] == [r for _, r in cases[:8]]


@pytest.mark.parametrize("when", ["mid_prefill", "mid_decode", "waiting"])
def test_abort_frees_everything(tiny_ckpt: Path, cases, when: str) -> None:
    for llm in make_llm(tiny_ckpt, max_num_batched_tokens=16, max_num_seqs=2):
        engine = llm.engine
        engine.add_request(cases[-1][0], GREEDY, rid="long")  # 200 tokens: 13 prefill steps
        engine.add_request(cases[3][0], GREEDY, rid="other")
        engine.add_request(cases[4][0], GREEDY, rid="queued")  # waits: max_num_seqs=2
        steps = {"mid_prefill": 3, "mid_decode": 16, "waiting": 1}[when]
        for _ in range(steps):
            engine.step()
        victim = "queued" if when == "waiting" else "long"
        req = engine.out.groups[victim][0]
        if when == "mid_prefill":
            assert req.num_computed_tokens < len(req.prompt_ids)
        elif when == "mid_decode":
            assert req.output_ids
        assert engine.abort(victim)
        engine.check_integrity()
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        victim_outs = [o for o in outs if o.rid == victim]
        assert len(victim_outs) == 1 and victim_outs[0].finish_reason == "abort"
        others = {o.rid: o.token_ids for o in outs if o.finished}
        assert others["other"] == cases[3][1]


def test_seeded_sampling_independent_of_batch(base: LLM, cases) -> None:
    prompt = cases[5][0]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=7, ignore_eos=True)
    alone = base.generate(prompt_token_ids=[prompt], sampling_params=seeded)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = base.generate(prompt_token_ids=[cases[2][0], prompt, cases[9][0]],
                          sampling_params=[others, seeded, GREEDY])
    assert mixed[1].token_ids == alone
    n3 = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    a = base.generate(prompt_token_ids=[prompt], sampling_params=n3)[0]
    b = base.generate(prompt_token_ids=[prompt], sampling_params=n3)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3
    base.check_integrity()


def test_stop_string_ends_output_exactly(base: LLM) -> None:
    prompt = "The quick brown fox"
    full = base.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    text = full.text
    assert text and len(text) > 12
    stop = text[7:12]  # most likely spans a token boundary; cut must be exact either way
    out = base.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                               stop=[stop]))[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    base.check_integrity()


def test_logprobs_are_model_log_softmax(base: LLM, cases) -> None:
    prompt = cases[6][0]
    out = base.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, logprobs=3))[0].outputs[0]
    ref = base.prefill_logits(prompt + out.token_ids).log_softmax(-1)
    assert out.logprobs is not None and len(out.logprobs) == 5
    for i, (tok, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert len(top) == 3 and tok in top  # greedy: the sampled token is the top one
        for t, lp in top.items():
            assert abs(lp - row[t].item()) < 1e-4
    assert abs(out.cumulative_logprob - sum(top[t] for t, top in
                                            zip(out.token_ids, out.logprobs, strict=False))) < 1e-4


def test_metrics_and_bad_input_keep_engine_healthy(tiny_ckpt: Path, cases) -> None:
    for llm in make_llm(tiny_ckpt, max_total_tokens=256):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate(prompt_token_ids=[[1, 2], [10**7]], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="KV cache"):
            llm.generate(prompt_token_ids=[[1] * 300], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="empty"):
            llm.generate(prompt_token_ids=[[]], sampling_params=GREEDY)
        llm.check_integrity()
        m0 = llm.get_metrics()
        assert m0["num_running"] == m0["num_waiting"] == 0
        assert m0["free_blocks"] == m0["total_blocks"] == 16
        prompts = [p for p, _ in cases[:4]]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == [r for _, r in cases[:4]]
        m = llm.get_metrics()
        assert m["prompt_tokens"] == sum(map(len, prompts))
        assert m["generation_tokens"] == 4 * NEW
        assert m["free_state_slots"] + m["cached_snapshots"] == m["total_state_slots"]
        assert llm.engine.flush_cache()
        m = llm.get_metrics()
        assert m["free_state_slots"] == m["total_state_slots"]
        assert m["free_blocks"] == m["total_blocks"]
