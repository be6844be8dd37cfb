"""Overlap scheduling (engine/overlap.py) run on the CPU: the engine launches step N+1, whose
inputs stand for step N's unread tokens, before it reads them. Every case gives the plain
engine's tokens, logprobs and finish reasons, leaves the pools whole, and never lets a
placeholder out (outputs, prefix cache). On a CPU the forward is synchronous, so the order
gains nothing here; the engine turns it on by itself only on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.engine.overlap import Pending
from kdaserve.engine.placeholders import placeholder, resolve_inputs
from kdaserve.engine.sampler import Drawn, Sampler
from kdaserve.request import Request


def overlapped(ckpt: Path, **kw) -> LLM:  # noqa: ANN003
    llm = LLM(ckpt, **kw)
    assert not llm.engine.overlap  # a CPU engine does not overlap by itself
    llm.engine.overlap = True
    return llm


def watch(llm: LLM) -> list[tuple[str, int]]:
    """Records ("run", step) and ("read", step it launched) in order."""
    events: list[tuple[str, int]] = []
    e = llm.engine
    run, launch = e.runner.run, e.pipeline._launch

    def counted_run(batch, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        events.append(("run", e.out.counters["num_steps"] + 1))
        return run(batch, *a, **kw)

    def counted_launch(logits, reqs):  # noqa: ANN001, ANN202
        pending = launch(logits, reqs)
        step, read = e.out.counters["num_steps"], pending.read

        def counted_read(sampler):  # noqa: ANN001, ANN202
            events.append(("read", step))
            return read(sampler)

        pending.read = counted_read  # type: ignore[method-assign]
        return pending

    e.runner.run = counted_run  # type: ignore[method-assign]
    e.pipeline._launch = counted_launch  # type: ignore[method-assign]
    return events


def prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 900 + 3 for j in range(4 + 3 * i)] for i in range(n)]


def no_placeholders(llm: LLM) -> None:
    cache = llm.engine.cache
    if cache is not None:
        assert all(t >= 0 for node in cache._nodes() for t in node.key)
    llm.check_integrity()


def same(a, b) -> None:  # noqa: ANN001
    for x, y in zip(a, b, strict=True):
        assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]
        assert [o.finish_reason for o in x.outputs] == [o.finish_reason for o in y.outputs]
        assert [o.stop_reason for o in x.outputs] == [o.stop_reason for o in y.outputs]
        assert [o.text for o in x.outputs] == [o.text for o in y.outputs]
        for o, p in zip(x.outputs, y.outputs, strict=True):
            assert (o.logprobs is None) == (p.logprobs is None)
            for d, f in zip(o.logprobs or [], p.logprobs or [], strict=True):
                assert d.keys() == f.keys()
                assert all(abs(d[t] - f[t]) < 1e-5 for t in d)


def test_step_n_plus_1_runs_before_step_n_is_read(tiny_ckpt: Path) -> None:
    """Seven requests of different lengths: the greedy tokens are the plain engine's, every
    step after the first runs before the last one's tokens are read, and a request whose
    last token is pending at max_tokens is not run again (no step is added)."""
    kw = {"block_size": 4, "max_num_batched_tokens": 64}
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(7)]
    plain = LLM(tiny_ckpt, **kw)
    want = plain.generate(prompt_token_ids=prompts(7), sampling_params=params)
    llm = overlapped(tiny_ckpt, **kw)
    events = watch(llm)
    got = llm.generate(prompt_token_ids=prompts(7), sampling_params=params)
    same(got, want)
    runs = [s for kind, s in events if kind == "run"]
    reads = [s for kind, s in events if kind == "read"]
    assert runs == list(range(1, len(runs) + 1)) and reads == runs
    for s in runs[1:]:  # step s ran before step s - 1 was read
        assert events.index(("run", s)) < events.index(("read", s - 1))
    assert llm.engine.out.counters["num_steps"] == plain.engine.out.counters["num_steps"]
    no_placeholders(llm)


def test_stops_sampling_and_logprobs(tiny_ckpt: Path) -> None:
    """Stop tokens and stop strings end a request a step before the engine reads them: the
    row it ran meanwhile is dropped. Seeded top-k/top-p/min-p sampling, n = 3, logprobs,
    min_tokens and logit_bias match the plain engine's."""
    text = "The quick brown fox"
    plain = LLM(tiny_ckpt)
    free = plain.generate(text, SamplingParams(temperature=0, max_tokens=24,
                                               ignore_eos=True))[0].outputs[0]
    stop_token = free.token_ids[5]
    stop_text = free.text[8:12]
    cases = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_text]),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=12,
                       ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, min_p=0.05, seed=3, n=3, max_tokens=9,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=6,
                       stop_token_ids=[stop_token], logit_bias={stop_token: 5.0}),
    ]
    want = [plain.generate(text, p)[0] for p in cases]
    assert want[0].outputs[0].finish_reason == "stop"
    assert want[1].outputs[0].stop_reason == stop_text
    llm = overlapped(tiny_ckpt)
    got = [llm.generate(text, p)[0] for p in cases]
    same(got, want)
    both = llm.generate([text, text], cases[:2])  # the two in one batch
    same(both, want[:2])
    no_placeholders(llm)


def test_prefix_cache_preemption_and_chunks(tiny_ckpt: Path) -> None:
    """A small pool (requests preempted while their last token is pending), chunked prefill
    beside decodes, prompt logprobs, and shared prefixes: then a second turn that resumes
    from what the first turn's requests left in the prefix cache."""
    kw = {"block_size": 4, "max_total_tokens": 160, "max_num_batched_tokens": 24,
          "snapshot_interval": 8}
    head = [7 + (3 * j) % 50 for j in range(30)]
    ps = [head + [100 + i, 200 + i] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True,
                             prompt_logprobs=1 if i == 2 else None) for i in range(6)]
    plain = LLM(tiny_ckpt, **kw)
    llm = overlapped(tiny_ckpt, **kw)
    for engine in (plain, llm):
        first = engine.generate(prompt_token_ids=ps, sampling_params=params)
        turn = [p + o.outputs[0].token_ids + [300 + i] for i, (p, o) in
                enumerate(zip(ps, first, strict=True))]
        second = engine.generate(prompt_token_ids=turn, sampling_params=params)
        engine.results = first + second  # type: ignore[attr-defined]
    same(llm.results, plain.results)
    scored = [(a.prompt_logprobs, b.prompt_logprobs) for a, b in
              zip(llm.results, plain.results, strict=True) if b.prompt_logprobs]
    assert len(scored) == 2
    for got, want in scored:
        assert len(got) == len(want) and got[0] is None and want[0] is None
        for d, f in zip(got[1:], want[1:], strict=True):
            assert d.keys() == f.keys() and all(abs(d[t] - f[t]) < 1e-5 for t in d)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    # hits are not the plain engine's to the token: a finish is read a step later, so what a
    # request leaves in the cache lands a step later; both turns must hit
    assert all(o.num_cached_tokens >= 24 for o in llm.results[3:6])  # the shared head
    assert sum(o.num_cached_tokens for o in llm.results[6:]) > 0  # the first turn's outputs
    no_placeholders(llm)


def test_requests_that_need_their_tokens_do_not_overlap(tiny_ckpt: Path) -> None:
    """A repetition-penalised request joins greedy ones mid-way: the step in flight is read
    before the next is scheduled, steps run one after the other while it is in the engine,
    and overlap again once it has finished; the tokens are the plain engine's."""
    ps = prompts(4)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    penalised = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                               repetition_penalty=1.3)

    def run(llm: LLM) -> dict[str, list[int]]:
        e, done = llm.engine, {}
        for i in range(3):
            e.add_request(ps[i], greedy, rid=str(i))
        for step in range(40):
            if step == 4:
                e.add_request(ps[3], penalised, rid="p")
            done.update({o.rid: o.outputs[0].token_ids for o in e.step() if o.finished})
            if not e.has_unfinished():
                return done
        raise AssertionError("did not finish")

    want = run(LLM(tiny_ckpt))
    llm = overlapped(tiny_ckpt)
    events = watch(llm)
    assert run(llm) == want
    assert len(want["p"]) == 4
    runs = [s for kind, s in events if kind == "run"]
    overlapped_runs = [s for s in runs[1:] if ("read", s - 1) in events
                       and events.index(("run", s)) < events.index(("read", s - 1))]
    # steps 5 to 9 (the penalised request's prefill and 3 more tokens) ran alone
    assert 4 in overlapped_runs and 11 in overlapped_runs
    assert not set(range(5, 10)) & set(overlapped_runs)
    assert not llm.engine.out.serial
    no_placeholders(llm)


def test_abort_pause_and_failures_in_flight(tiny_ckpt: Path) -> None:
    """An abort, a retracting pause and a request whose sampling fails, each while a step is
    in flight: the others' tokens are the plain engine's, the aborted one's output holds
    only read tokens, and nothing leaks."""
    poison = 0.123

    class Flaky(Sampler):
        def draw(self, logits: torch.Tensor, reqs: list[Request]) -> Drawn:
            if any(r.params.temperature == poison for r in reqs):
                raise OverflowError("Overflow when unpacking long long")
            return super().draw(logits, reqs)

    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ps = prompts(4)
    want = LLM(tiny_ckpt).generate(prompt_token_ids=ps, sampling_params=greedy)
    llm = overlapped(tiny_ckpt)
    e = llm.engine
    e.sampler = Flaky(e.sampler.stop_ids)
    for i, p in enumerate(ps):
        e.add_request(p, greedy, rid=str(i))
    e.add_request(ps[0], SamplingParams(temperature=poison, max_tokens=10), rid="bad")
    done: dict[str, object] = {}
    after_abort: list[object] = []
    for step in range(40):
        if step == 3:
            assert e.pipeline.inflight is not None
            assert e.abort("1")
            after_abort = e.out.pending
        if step == 5:
            assert e.pipeline.inflight is not None
            e.rl.pause_generation("retract")
            assert e.pipeline.inflight is None and not e.scheduler.running
            e.rl.continue_generation()
        for out in e.step():
            if out.finished:
                done[out.rid] = out
        failed = e.take_failures()
        if failed:
            assert [rid for rid, _ in failed] == ["bad"]
        if not e.has_unfinished():
            break
    assert set(done) == {"0", "1", "2", "3", "bad"}
    assert [o.rid for o in after_abort].count("1") == 1  # its final output only
    aborted = done["1"].outputs[0]
    assert aborted.finish_reason == "abort"
    assert aborted.token_ids == want[1].outputs[0].token_ids[:len(aborted.token_ids)]
    for i in (0, 2, 3):
        assert done[str(i)].outputs[0].token_ids == want[i].outputs[0].token_ids
    no_placeholders(llm)


def test_graph_replay_overlaps(tiny_ckpt: Path) -> None:
    """The CUDA-graph runner's static buffers (replayed eagerly on the CPU) take their input
    ids from the step in flight's tokens."""
    from .conftest import attach

    ps = prompts(5)
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True)
              for i in range(5)]
    want = LLM(tiny_ckpt, block_size=4).generate(prompt_token_ids=ps, sampling_params=params)
    llm = overlapped(tiny_ckpt, block_size=4)
    ran = attach(llm, max_bs=8)
    same(llm.generate(prompt_token_ids=ps, sampling_params=params), want)
    assert ran
    no_placeholders(llm)


def test_placeholders_and_resolve_inputs() -> None:
    future = torch.tensor([40, 41, 42])
    ids = torch.tensor([5, placeholder(2), 7, placeholder(0)])
    assert resolve_inputs(ids, future).tolist() == [5, 42, 7, 40]
    req = Request("r", [1, 2], SamplingParams(max_tokens=3))
    req.output_ids = [9]
    pending = Pending([req], Drawn(torch.tensor([77]), None))
    assert req.output_ids == [9, placeholder(0)] and pending.index == [1]
    assert req.last_token_pending and req.known_output_ids == [9]
    assert pending.read(Sampler()).token_ids == [77]


def test_abort_while_the_last_token_is_in_flight(tiny_ckpt: Path) -> None:
    """The token in flight ends the request: reading it before the abort finishes it as it
    would have finished, and the abort has nothing left to end."""
    llm = overlapped(tiny_ckpt)
    e = llm.engine
    e.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                  rid="a")
    e.step()
    e.step()
    assert e.out.groups["a"][0].ends_when_read
    assert e.abort("a")
    outs = e.step()
    assert [o.finished for o in outs] == [True]
    assert outs[0].outputs[0].finish_reason == "length"
    assert len(outs[0].outputs[0].token_ids) == 2 and e.out.counters["num_aborted"] == 0
    assert not e.has_unfinished()
    no_placeholders(llm)


def test_a_failed_read_leaves_no_placeholder(tiny_ckpt: Path) -> None:
    """A step whose read of the step in flight fails raises; the engine loop then aborts every
    request, and their outputs hold only tokens that were read."""
    llm = overlapped(tiny_ckpt)
    e = llm.engine
    for i, p in enumerate(prompts(3)):
        e.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                      rid=str(i))
    e.step()
    e.step()

    def fail(sampler: Sampler) -> None:
        raise RuntimeError("device lost")

    assert e.pipeline.inflight is not None
    e.pipeline.inflight.read = fail  # type: ignore[method-assign] - read by the next step
    with pytest.raises(RuntimeError, match="device lost"):
        e.step()
    assert e.pipeline.inflight is None
    for rid in list(e.out.groups):
        assert e.abort(rid)
    outs = e.step()
    assert sorted(o.rid for o in outs) == ["0", "1", "2"]
    for o in outs:
        assert o.outputs[0].finish_reason == "abort"
        assert o.outputs[0].token_ids and all(t >= 0 for t in o.outputs[0].token_ids)
    no_placeholders(llm)
