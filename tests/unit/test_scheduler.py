"""Scheduler policy on real block/state pools, driven by a FakeRunner instead of a model.

The FakeRunner applies a ScheduledBatch the way the engine does (num_computed_tokens += n; the
request whose chunk reaches its last token gets a next token), and also writes every scheduled
token id into the paged cache through the request's block table and counts tokens into its state
slot. The next token is a hash of the history read back from the cache, so a block-table mix-up,
a block reused while still held, or a state slot not zeroed changes or fails the outputs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.checkpoint import preset_config
from kdaserve.engine.prefill_budget import PrefillBudget
from kdaserve.engine.scheduler import Scheduler
from kdaserve.request import Request, RequestStatus, SamplingParams
from kdaserve.scheduled_batch import ScheduledBatch

from .radix_fakes import FAKE_VOCAB, expected_output, fake_next_token

CONFIG = preset_config("tiny")
@dataclass(frozen=True)
class Spec:
    rid: str
    prompt_len: int
    max_tokens: int

    def prompt(self) -> list[int]:
        rng = random.Random(self.rid)
        return [rng.randrange(FAKE_VOCAB) for _ in range(self.prompt_len)]

    def make(self) -> Request:
        return Request(self.rid, self.prompt(), SamplingParams(max_tokens=self.max_tokens))


class FakeRunner:
    """ModelRunner + sampler stand-in, see the module docstring."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.blocks, self.states = scheduler.blocks, scheduler.states

    def _history(self, req: Request) -> list[int]:
        bs = self.blocks.block_size
        pos = torch.arange(req.num_computed_tokens)
        table = torch.tensor(req.block_ids, dtype=torch.int64)
        vals = self.blocks.kv[0, table[pos // bs], pos % bs, 0]
        return [int(v) for v in vals.tolist()]

    def run(self, batch: ScheduledBatch) -> list[Request]:
        bs = self.blocks.block_size
        sampled: list[Request] = []
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            assert req.status is RequestStatus.RUNNING and req.state_slot is not None
            assert 1 <= n and start + n <= req.num_tokens, (req.rid, start, n, req.num_tokens)
            assert len(req.block_ids) * bs >= start + n, f"{req.rid}: block table too short"
            pos = torch.arange(start, start + n)
            table = torch.tensor(req.block_ids, dtype=torch.int64)
            new = torch.tensor(req.all_ids[start:start + n], dtype=torch.float32)
            self.blocks.kv[0, table[pos // bs], pos % bs, 0] = new
            self.states.recurrent[0, req.state_slot, 0, 0, 0] += n
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                sampled.append(req)
        for req in sampled:
            history = self._history(req)
            assert history == req.all_ids, f"{req.rid}: paged cache does not hold its tokens"
            assert self.states.recurrent[0, req.state_slot, 0, 0, 0].item() == req.num_tokens, \
                f"{req.rid}: state slot saw other tokens (not zeroed or shared)"
            req.output_ids.append(fake_next_token(history))
            if len(req.output_ids) >= req.params.max_tokens:
                self.scheduler.finish(req, "length")
        return sampled


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, num_slots: int = 8,
                   max_num_seqs: int = 8, budget: int = 16,
                   prefill_with_decodes: int | None = None) -> Scheduler:
    blocks = BlockPool(CONFIG, num_blocks, block_size, torch.float32)
    states = StatePool(CONFIG, num_slots, torch.float32)
    return Scheduler(blocks, states, max_num_seqs, budget,
                     max_prefill_tokens_with_decodes=prefill_with_decodes)


@dataclass
class Harness:
    scheduler: Scheduler
    runner: FakeRunner = field(init=False)
    batches: list[ScheduledBatch] = field(default_factory=list)
    max_running_seen: int = 0
    mixed_steps: int = 0  # steps with decodes and prefill chunks together
    full_steps: int = 0  # steps that used the whole token budget

    def __post_init__(self) -> None:
        self.runner = FakeRunner(self.scheduler)
        self.scheduler.check_integrity()

    def add(self, req: Request) -> None:
        self.scheduler.add(req)
        self.scheduler.check_integrity()

    def step(self) -> ScheduledBatch:
        s = self.scheduler
        running_before = list(s.running)
        waiting_before = list(s.waiting)
        decoding = [r for r in running_before if not r.is_prefilling]
        batch = s.schedule()
        s.check_integrity()
        self._check_batch(batch, running_before, waiting_before, decoding)
        self.runner.run(batch)
        s.check_integrity()
        self.batches.append(batch)
        return batch

    def run_until_done(self, max_steps: int) -> int:
        for steps in range(1, max_steps + 1):
            self.step()
            if not self.scheduler.has_unfinished():
                assert self.scheduler.blocks.num_free == self.scheduler.blocks.num_blocks
                assert self.scheduler.states.num_free == self.scheduler.states.num_slots
                return steps
        raise AssertionError(f"not done after {max_steps} steps: "
                             f"{len(self.scheduler.running)} running, "
                             f"{len(self.scheduler.waiting)} waiting")

    def _check_batch(self, batch: ScheduledBatch, running_before: list[Request],
                     waiting_before: list[Request], decoding: list[Request]) -> None:
        s = self.scheduler
        assert batch.num_tokens <= s.max_num_batched_tokens, "token budget exceeded"
        assert len(batch.reqs) == len(batch.num_new_tokens)
        assert len({id(r) for r in batch.reqs}) == len(batch.reqs), "request scheduled twice"
        assert all(n >= 1 for n in batch.num_new_tokens)
        assert len(s.running) <= min(s.max_num_seqs, s.states.num_slots)
        self.max_running_seen = max(self.max_running_seen, len(s.running))
        for r in batch.reqs:
            assert r.status is RequestStatus.RUNNING and r in s.running
        # decodes first: among requests already running, no decode comes after a prefill chunk,
        # and a prefill chunk (old or newly admitted) runs only if every decode got its token
        kinds = ["decode" if r in decoding else "prefill" for r in batch.reqs
                 if r in running_before]
        assert kinds == sorted(kinds, key=lambda k: k == "prefill"), kinds
        if any(r not in decoding for r in batch.reqs):
            for r in decoding:
                assert r in batch.reqs or r in batch.preempted, f"decode {r.rid} starved"
            if decoding:
                self.mixed_steps += 1
        if batch.num_tokens == s.max_num_batched_tokens:
            self.full_steps += 1
        # FCFS: requests admitted from the queue are a prefix of it
        admitted = [r for r in batch.reqs if r in waiting_before]
        assert admitted == waiting_before[:len(admitted)], "admission skipped the queue head"
        for v in batch.preempted:
            assert v in running_before and v.num_computed_tokens == 0
            if v not in batch.reqs:  # (re-admission in the same step is allowed)
                assert v.status is RequestStatus.WAITING and v in s.waiting
                assert v.block_ids == [] and v.state_slot is None


def reference_outputs(specs: Sequence[Spec]) -> dict[str, list[int]]:
    """Outputs of an unconstrained run (everything fits, one step per token)."""
    total = sum(sp.prompt_len + sp.max_tokens for sp in specs)
    h = Harness(make_scheduler(num_blocks=total, num_slots=len(specs),
                               max_num_seqs=len(specs), budget=total))
    reqs = [sp.make() for sp in specs]
    for r in reqs:
        h.add(r)
    h.run_until_done(max_steps=max(sp.max_tokens for sp in specs) + 1)
    assert h.scheduler.num_preemptions == 0
    outs = {r.rid: r.output_ids for r in reqs}
    for sp in specs:
        assert outs[sp.rid] == expected_output(sp.prompt(), sp.max_tokens)
    return outs


def random_specs(seed: int, n: int, max_total: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        prompt_len = rng.randint(2, max_total // 2)
        specs.append(Spec(f"s{seed}-r{i}", prompt_len,
                          rng.randint(1, min(12, max_total - prompt_len))))
    return specs


def run_staggered(h: Harness, specs: Sequence[Spec], every: int, max_steps: int) -> list[Request]:
    """Adds one request every `every` steps while stepping, then runs to completion."""
    reqs = [sp.make() for sp in specs]
    pending = list(reqs)
    for step in range(max_steps):
        if pending and step % every == 0:
            h.add(pending.pop(0))
        if not pending and not h.scheduler.has_unfinished():
            return reqs
        h.step()
    raise AssertionError(f"not done after {max_steps} steps")


# ---- token budget, chunked prefill, continuous batching ----

@pytest.mark.parametrize("budget", [4, 16, 33], ids=lambda b: f"budget={b}")
def test_budget_respected_and_decodes_first(budget: int) -> None:
    h = Harness(make_scheduler(num_blocks=256, budget=budget))
    specs = random_specs(seed=budget, n=12, max_total=2 * budget + 20)
    reqs = run_staggered(h, specs, every=2, max_steps=2000)
    assert h.mixed_steps > 0 and h.full_steps > 0, "workload did not exercise the budget"
    ref = reference_outputs(specs)
    assert {r.rid: r.output_ids for r in reqs} == ref
    assert all(r.finish_reason == "length" for r in reqs)


def test_long_prompt_prefilled_in_chunks_alongside_a_decode() -> None:
    h = Harness(make_scheduler(num_blocks=32, budget=16))
    short, long = Spec("short", 3, 10).make(), Spec("long", 50, 2).make()
    h.add(short)
    assert h.step().num_new_tokens == [3]
    assert len(short.output_ids) == 1
    h.add(long)
    chunks: list[int] = []
    while not long.output_ids:
        batch = h.step()
        assert batch.reqs[0] is short and batch.num_new_tokens[0] == 1, "decode not first"
        assert batch.reqs[1] is long
        chunks.append(batch.num_new_tokens[1])
        assert batch.num_tokens <= 16
    assert chunks == [15, 15, 15, 5]
    assert sum(chunks) == len(long.prompt_ids)
    assert long.num_computed_tokens == 50 and not long.is_prefilling
    batch = h.step()
    assert batch.num_new_tokens == [1, 1]
    h.run_until_done(max_steps=20)
    assert long.output_ids == expected_output(long.prompt_ids, 2)


def test_prompt_tokens_capped_while_requests_decode() -> None:
    """max_prefill_tokens_with_decodes: while a request decodes, prompts (running chunks and
    new admissions together) take at most that many tokens a step; with no decoder they take
    the whole budget. Outputs stay those of an unconstrained run."""
    specs = [Spec("short", 3, 12), Spec("long", 40, 2), Spec("other", 4, 2)]
    h = Harness(make_scheduler(num_blocks=64, budget=16, prefill_with_decodes=5))
    short, long, other = (sp.make() for sp in specs)
    h.add(short)
    h.add(long)
    assert h.step().num_new_tokens == [3, 13]  # nobody decodes yet: the full budget
    h.add(other)
    capped = 0
    while long.num_computed_tokens < 40:
        decoding = [r for r in h.scheduler.running if not r.is_prefilling]
        batch = h.step()
        prompt_tokens = sum(n for r, n in zip(batch.reqs, batch.num_new_tokens, strict=True)
                            if r not in decoding)
        assert prompt_tokens <= (5 if decoding else 16), batch.num_new_tokens
        capped += bool(decoding) and prompt_tokens == 5
    assert capped >= 5  # the long prompt and `other` ran 5-token steps beside the decode
    h.run_until_done(max_steps=40)
    assert {r.rid: r.output_ids for r in (short, long, other)} == reference_outputs(specs)


def test_itl_target_budget_follows_the_decodes() -> None:
    """An ITL target's fitted budget: prompt tokens beside d decodes are what the target
    leaves after them (fewer as more decode, the floor when they alone exceed it), the
    fixed cap still applies where lower, and outputs stay those of an unconstrained run."""
    budget = PrefillBudget(target_s=0.010, floor=2)
    for d, p in [(0, 16), (1, 4), (2, 0), (3, 8), (1, 0), (0, 9), (4, 2), (2, 6)]:
        budget.observe(d, p, 0.002 + 0.002 * d + 0.0005 * p)  # 1 decode: 12 prompt tokens
    assert 10 < budget.tokens(1) <= 12 and [budget.tokens(d) for d in (3, 4, 5)] == [4, 2, 2]
    specs = [Spec("a", 3, 10), Spec("b", 2, 9), Spec("c", 3, 8), Spec("long", 60, 2),
             Spec("other", 30, 2)]
    reqs = {sp.rid: sp.make() for sp in specs}
    h = Harness(make_scheduler(num_blocks=128, budget=16, prefill_with_decodes=10))
    h.scheduler.itl_budget = budget
    h.add(reqs["a"])
    capped = {}
    for rid in ("b", "c", "long", "other"):
        h.step()
        h.add(reqs[rid])
    while any(r.is_prefilling and not r.is_finished for r in reqs.values()):
        decoding = [r for r in h.scheduler.running if not r.is_prefilling]
        decode_tokens = len(decoding)
        batch = h.step()
        prompt = sum(n for r, n in zip(batch.reqs, batch.num_new_tokens, strict=True)
                     if r not in decoding)
        if decode_tokens and prompt:
            allowed = min(10, budget.tokens(decode_tokens))
            assert prompt <= allowed, (decode_tokens, batch.num_new_tokens)
            capped[decode_tokens] = max(capped.get(decode_tokens, 0), prompt)
    # beside 1 decode the fixed cap (10) is the lower, beside 3 the fit's 4: both filled
    assert capped.get(1) == 10 and capped.get(3) == 4, capped
    h.run_until_done(max_steps=100)
    assert {r.rid: r.output_ids for r in reqs.values()} == reference_outputs(specs)


def test_continuous_batching_joins_next_step_and_finished_leave() -> None:
    h = Harness(make_scheduler(num_blocks=64, budget=64))
    a, b = Spec("a", 5, 3).make(), Spec("b", 6, 8).make()
    h.add(a)
    h.add(b)
    assert h.step().reqs == [a, b]  # both prefills in one step
    assert h.step().reqs == [a, b]  # decodes
    c = Spec("c", 7, 4).make()
    h.add(c)
    batch = h.step()  # a decodes its last token here
    assert batch.reqs == [a, b, c] and batch.num_new_tokens == [1, 1, 7]
    assert a.is_finished and a.finish_reason == "length"
    assert a not in h.scheduler.running and a.block_ids == [] and a.state_slot is None
    assert len(a.output_ids) == 3
    batch = h.step()
    assert batch.reqs == [b, c] and batch.num_new_tokens == [1, 1]
    h.run_until_done(max_steps=20)
    for r in (a, b, c):
        assert r.output_ids == expected_output(r.prompt_ids, r.params.max_tokens)


@pytest.mark.parametrize(("max_num_seqs", "num_slots"), [(3, 8), (8, 2)],
                         ids=["max_num_seqs=3", "state_slots=2"])
def test_running_limited_by_max_num_seqs_and_state_slots(max_num_seqs: int,
                                                         num_slots: int) -> None:
    h = Harness(make_scheduler(num_blocks=256, num_slots=num_slots, max_num_seqs=max_num_seqs,
                               budget=64))
    specs = [Spec(f"r{i}", 4 + i, 5) for i in range(10)]
    reqs = [sp.make() for sp in specs]
    for r in reqs:
        h.add(r)
    h.run_until_done(max_steps=200)  # the harness asserts the limit every step
    assert h.max_running_seen == min(max_num_seqs, num_slots)
    assert {r.rid: r.output_ids for r in reqs} == reference_outputs(specs)


def test_fcfs_head_is_not_skipped_by_a_smaller_request() -> None:
    h = Harness(make_scheduler(num_blocks=8, block_size=4, budget=64))
    a = Spec("a", 20, 4).make()  # 5 of 8 blocks
    h.add(a)
    h.step()
    big, small = Spec("big", 16, 4).make(), Spec("small", 2, 2).make()
    h.add(big)  # needs 4 blocks for its prompt, 3 are free
    h.add(small)  # would fit in 1 block
    while not a.is_finished:
        batch = h.step()
        assert batch.reqs == [a]
        assert list(h.scheduler.waiting) == [big, small]
        assert small.state_slot is None and small.num_computed_tokens == 0
    batch = h.step()
    assert batch.reqs == [big, small]  # head first, then the smaller one
    h.run_until_done(max_steps=20)


# ---- preemption ----

def test_preempts_newest_running_when_blocks_run_out() -> None:
    # 6 blocks of 4: a, b, c take one block each for their prompt and a second one at their
    # 5th token; at the 9th token a needs a third block and none is free.
    h = Harness(make_scheduler(num_blocks=6, block_size=4, max_num_seqs=3, budget=64))
    specs = [Spec("a", 4, 8), Spec("b", 4, 8), Spec("c", 4, 8), Spec("d", 2, 2)]
    a, b, c, d = reqs = [sp.make() for sp in specs]
    for r in reqs:
        h.add(r)
    for _ in range(5):  # prefill, then tokens 5..8 computed
        batch = h.step()
        assert batch.reqs == [a, b, c] and not batch.preempted
    assert h.scheduler.blocks.num_free == 0 and list(h.scheduler.waiting) == [d]
    c_blocks = list(c.block_ids)
    batch = h.step()
    assert batch.preempted == [c]
    assert batch.reqs == [a, b] and batch.num_new_tokens == [1, 1]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.block_ids == [] and c.state_slot is None and len(c.output_ids) == 5
    assert c.num_preemptions == 1 and h.scheduler.num_preemptions == 1
    assert list(h.scheduler.waiting) == [c, d], "preempted request not at the front"
    assert set(c_blocks) <= set(a.block_ids) | set(b.block_ids), "freed blocks not reused"
    h.run_until_done(max_steps=100)
    assert {r.rid: r.output_ids for r in reqs} == reference_outputs(specs)
    assert c.finish_reason == "length" and c.num_preemptions >= 1


@pytest.mark.parametrize(("seed", "budget"), [(0, 8), (1, 16), (2, 64)],
                         ids=["seed0-budget8", "seed1-budget16", "seed2-budget64"])
def test_tiny_pool_many_requests_finish_with_unconstrained_outputs(seed: int,
                                                                   budget: int) -> None:
    h = Harness(make_scheduler(num_blocks=8, block_size=4, num_slots=6, max_num_seqs=6,
                               budget=budget))
    specs = random_specs(seed=seed, n=24, max_total=32)
    reqs = run_staggered(h, specs, every=1, max_steps=3000)
    assert h.scheduler.num_preemptions > 0, "pool too large to exercise preemption"
    assert {r.rid: r.output_ids for r in reqs} == reference_outputs(specs)
    assert sum(r.num_preemptions for r in reqs) == h.scheduler.num_preemptions


# ---- add / finish / abort ----

@pytest.mark.parametrize(("prompt_len", "max_tokens", "ok"),
                         [(20, 12, True), (20, 13, False), (40, 1, False)],
                         ids=["exactly-fits", "one-over", "prompt-alone-too-big"])
def test_request_larger_than_pool_rejected_without_side_effects(prompt_len: int,
                                                                max_tokens: int,
                                                                ok: bool) -> None:
    h = Harness(make_scheduler(num_blocks=8, block_size=4))  # 32 tokens
    running, queued = Spec("run", 4, 4).make(), Spec("queued", 3, 2).make()
    h.add(running)
    h.step()
    h.add(queued)
    before = (list(h.scheduler.running), list(h.scheduler.waiting),
              h.scheduler.blocks.num_free, h.scheduler.states.num_free)
    req = Spec("big", prompt_len, max_tokens).make()
    if not ok:
        with pytest.raises(ValueError, match="whole KV cache holds 32"):
            h.scheduler.add(req)
        h.scheduler.check_integrity()
        assert (list(h.scheduler.running), list(h.scheduler.waiting),
                h.scheduler.blocks.num_free, h.scheduler.states.num_free) == before
        assert req.block_ids == [] and req.state_slot is None
        h.run_until_done(max_steps=20)
    else:
        h.add(req)
        assert list(h.scheduler.waiting) == [queued, req]
        h.run_until_done(max_steps=100)
        assert req.output_ids == expected_output(req.prompt_ids, max_tokens)


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding"])
@pytest.mark.parametrize("reason", ["abort", "stop"])
def test_finish_or_abort_frees_everything(where: str, reason: str) -> None:
    h = Harness(make_scheduler(num_blocks=32, budget=8,
                               max_num_seqs=1 if where == "waiting" else 2))
    other = Spec("other", 3, 6).make()
    target = Spec("target", 2 if where == "decoding" else 20, 6).make()
    h.add(other)
    h.add(target)
    h.step()
    if where == "decoding":
        h.step()
    if where == "waiting":
        assert list(h.scheduler.waiting) == [target]
    else:
        assert target in h.scheduler.running and target.block_ids
        assert target.is_prefilling == (where == "prefilling")
    free_blocks = h.scheduler.blocks.num_free + len(target.block_ids)
    free_slots = h.scheduler.states.num_free + int(target.state_slot is not None)
    h.scheduler.finish(target, reason)
    h.scheduler.check_integrity()
    assert target.is_finished and target.finish_reason == reason
    assert target not in h.scheduler.running and target not in h.scheduler.waiting
    assert target.block_ids == [] and target.state_slot is None
    assert h.scheduler.blocks.num_free == free_blocks
    assert h.scheduler.states.num_free == free_slots
    h.run_until_done(max_steps=50)
    assert other.output_ids == expected_output(other.prompt_ids, 6)


def test_reused_state_slot_comes_back_zeroed() -> None:
    h = Harness(make_scheduler(num_slots=2, max_num_seqs=2))
    a, b = Spec("a", 3, 4).make(), Spec("b", 3, 4).make()
    h.add(a)
    h.add(b)
    h.step()
    states = h.scheduler.states
    assert a.state_slot is not None and b.state_slot is not None
    slot_a, slot_b = a.state_slot, b.state_slot
    for slot in (slot_a, slot_b):
        states.recurrent[:, slot] = 7.0
        states.conv[:, slot] = -3.0
    h.scheduler.finish(a, "abort")
    h.scheduler.check_integrity()
    c = Spec("c", 3, 4).make()
    h.add(c)
    h.scheduler.schedule()
    h.scheduler.check_integrity()
    assert c.state_slot == slot_a  # the only free slot
    assert torch.count_nonzero(states.recurrent[:, slot_a]) == 0
    assert torch.count_nonzero(states.conv[:, slot_a]) == 0
    assert torch.all(states.recurrent[:, slot_b] == 7.0), "another request's state was touched"
    assert torch.all(states.conv[:, slot_b] == -3.0)
