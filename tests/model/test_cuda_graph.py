"""The CUDA-graph runner's static-buffer decode (engine/cuda_graph.py) on the CPU, replayed
eagerly: the same forward a graph captures, on buffers padded to batch-size buckets, gives the
plain engine's greedy tokens; padding rows touch only the pools' scratch slot and block; the
steps it must not take run eagerly. Capture itself is checked on a GPU (test_triton.py), and
the captured forward's freedom from host reads under Triton's interpreter
(interpreted/check_graph_step.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kdaserve import LLM, RequestOptions, SamplingParams
from kdaserve.engine.cuda_graph import CudaGraphRunner, capture_sizes, verify_tokens
from kdaserve.engine_config import EngineConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import graph_verify_tokens

from .conftest import KEYS, attach


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_sizes(0)


def test_verify_graph_size(tiny_ckpt: Path) -> None:
    """A verify step sits in a graph only within what the fused kernels take (the kernels
    package says: the absorbed MLA path's 16 new tokens, nothing where a KDA state tile is too
    large for the fused step), the block and the fused step's token limit; else it runs
    eagerly (1)."""
    assert graph_verify_tokens([64, 128]) == 16
    assert graph_verify_tokens([129]) == 0  # a 256 x 256 state tile
    model = LLM(tiny_ckpt).engine.model
    plain = EngineConfig(model=str(tiny_ckpt))
    assert verify_tokens(plain, model, 16) == 1  # no speculation
    spec = EngineConfig(model=str(tiny_ckpt), speculative_algorithm="ngram",
                        speculative_num_draft_tokens=3)
    assert verify_tokens(spec, model, 16) == 4
    assert verify_tokens(spec, model, 2) == 1  # 4 tokens do not fit one block of 2


def prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 900 + 3 for j in range(4 + 3 * i)] for i in range(n)]


@pytest.mark.parametrize("backend", [None, "cpu"])
def test_padded_static_decode_equals_the_plain_engine(tiny_ckpt: Path,
                                                      backend: str | None) -> None:
    """Six requests with different lengths finish at different steps, so the decode batch
    shrinks 6 -> 1 through buckets 6, 4, 2, 1 (rows freed become padding again); and a seventh
    past max_bs=6 leaves the steps with 7 decodes to the eager forward."""
    kw = {"kernel_backend": backend, "block_size": 4, "max_num_batched_tokens": 64}
    ps = prompts(7)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(7)]
    want = [o.token_ids for o in LLM(tiny_ckpt, **kw).generate(
        prompt_token_ids=ps, sampling_params=params)]
    llm = LLM(tiny_ckpt, **kw)
    ran = attach(llm, max_bs=6)
    e = llm.engine
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    assert got == want
    assert ran and max(ran) == 6 and min(ran) == 1 and 7 not in ran
    assert {e.runner.graphs.bucket(n) for n in ran} == {6, 4, 2, 1}
    llm.engine.check_integrity()


def test_padding_touches_only_the_scratch_rows(tiny_ckpt: Path) -> None:
    """A bucket-4 step of 3 real rows: every pool row but the 3 sequences' slots and the
    scratch is unchanged, and the 3 rows' logits equal the eager forward's."""
    llm = LLM(tiny_ckpt, block_size=4)
    e = llm.engine
    attach(llm, max_bs=4)
    graphs = e.runner.graphs
    ps = prompts(3)
    slots = [e.states.allocate() for _ in ps]
    tables = [e.blocks.allocate(e.blocks.blocks_needed(len(p) + 1)) for p in ps]
    with torch.inference_mode():
        for s, t, p in zip(slots, tables, ps, strict=True):  # the prompts into those rows
            e.model.forward(ForwardBatch.build([p], [0], [s], [t], e.blocks.block_size),
                            e.states, e.blocks)
        fb = ForwardBatch.build([[7], [8], [9]], [len(p) for p in ps], slots, tables,
                                e.blocks.block_size)
        before = (e.states.recurrent.clone(), e.states.conv.clone(), e.blocks.kv.clone())
        got, kept = graphs.run(fb, graphs.key(fb))
        assert kept is None
        after = (e.states.recurrent.clone(), e.states.conv.clone(), e.blocks.kv.clone())
        # the eager forward from the same starting pools
        e.states.recurrent.copy_(before[0])
        e.states.conv.copy_(before[1])
        e.blocks.kv.copy_(before[2])
        want = e.model.forward(fb, e.states, e.blocks)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    keep_slots = [i for i in range(e.states.num_slots + 1)
                  if i not in slots and i != e.states.scratch]
    assert torch.equal(after[0][:, keep_slots], before[0][:, keep_slots])
    assert torch.equal(after[1][:, keep_slots], before[1][:, keep_slots])
    used = {b for t in tables for b in t}
    keep_blocks = [b for b in range(e.blocks.num_blocks + 1)
                   if b not in used and b != e.blocks.scratch]
    assert torch.equal(after[2][:, keep_blocks], before[2][:, keep_blocks])
    assert not torch.equal(after[0][:, e.states.scratch], before[0][:, e.states.scratch])
    for s, t in zip(slots, tables, strict=True):
        e.states.free(s)
        e.blocks.free(t)
    e.check_integrity()


def test_steps_a_graph_cannot_hold_run_eagerly(tiny_ckpt: Path) -> None:
    """Routed experts, hidden states and prefill chunks take the eager forward; the tokens
    are the plain engine's."""
    ps = prompts(2)
    want = [o.token_ids for o in LLM(tiny_ckpt).generate(
        prompt_token_ids=ps, sampling_params=SamplingParams(temperature=0, max_tokens=4))]
    llm = LLM(tiny_ckpt)
    ran = attach(llm, max_bs=8)
    params = SamplingParams(temperature=0, max_tokens=4)
    for extra in ({"return_routed_experts": True}, {"return_hidden_states": True}):
        got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params,
                                                 options=RequestOptions(**extra))]
        assert got == want and ran == []
    got = [o.token_ids for o in llm.generate(
        prompt_token_ids=ps, sampling_params=SamplingParams(temperature=0, max_tokens=4))]
    assert got == want and ran  # plain decodes replayed


def test_cuda_graph_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=8)  # on a CPU: no graphs to size
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(device="cuda", cuda_graph_max_bs=0)
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(device="cuda", cuda_graph_max_bs=8, disable_cuda_graph=True)
    assert EngineConfig(device="cuda", cuda_graph_max_bs=8).cuda_graph_max_bs == 8


def test_cpu_engine_has_no_graph_runner(tiny_ckpt: Path) -> None:
    assert LLM(tiny_ckpt).engine.runner.graphs is None


def test_prompt_logprob_rows_run_eagerly(tiny_ckpt: Path) -> None:
    """A 3-token budget with two requests decoding leaves a prompt-logprob request one-token
    chunks: decode-shaped steps in which one row scores the prompt instead of sampling. Those
    steps must not replay (the graph returns one logits row per sequence, all sampled): tokens
    and prompt logprobs equal the plain engine's."""
    kw = {"max_num_batched_tokens": 3, "disable_prefix_cache": True}
    ps = [[5, 6], [7, 8], [9, 10, 11, 12, 13, 14]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)]

    def run(llm: LLM) -> list:
        outs = llm.generate(prompt_token_ids=ps, sampling_params=params)
        return [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outs]

    want = run(LLM(tiny_ckpt, **kw))
    llm = LLM(tiny_ckpt, **kw)
    ran = attach(llm, max_bs=4)
    got = run(llm)
    assert got == want and ran
    llm.engine.check_integrity()


def test_graphs_only_with_kernels_that_read_nothing_back(tiny_ckpt: Path) -> None:
    """Graphs need every graphed op's backend to say it reads nothing back: the triton
    backend's do (as registered), the references and the CPU's do not."""
    from kdaserve.engine.cuda_graph import GRAPHED_OPS, graph_safe
    from kdaserve.kernels import registry

    kernels = LLM(tiny_ckpt, kernel_backend="ref").engine.kernels
    assert not graph_safe(kernels) and not graph_safe(LLM(tiny_ckpt).engine.kernels)
    triton = {op: next(b for b in registry.backends(op) if b.name == "triton")
              for op in GRAPHED_OPS}
    assert all(registry.GRAPH_SAFE in b.capabilities for b in triton.values())
    assert graph_safe(kernels._replace(**{op: b.fn for op, b in triton.items()},
                                       capabilities=frozenset(
                                           (op, c) for op, b in triton.items()
                                           for c in b.capabilities)))
    assert not any(registry.GRAPH_SAFE in b.capabilities for op in GRAPHED_OPS
                   for b in registry.backends(op) if b.name != "triton")


def test_speculation_and_prefix_cache_beside_graphs(tiny_ckpt: Path) -> None:
    """With n-gram speculation (verify steps eager; steps where no request drafts replay) and
    the prefix cache on (prompts sharing a prefix, so hits and snapshots), the tokens equal
    the plain engine's with the same settings."""
    kw = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3,
          "block_size": 4, "snapshot_interval": 8}
    shared = [(7 * j) % 50 + 3 for j in range(20)]
    ps = [shared + [100 + i] * (1 + i) for i in range(4)] + [[1, 2, 3, 1, 2, 3, 1, 2]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_ckpt, **kw).generate(
        prompt_token_ids=ps, sampling_params=params)]
    llm = LLM(tiny_ckpt, **kw)
    ran = attach(llm, max_bs=8)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    assert got == want and ran
    llm.engine.check_integrity()


@pytest.mark.parametrize("drafter", ["scripted", "dspark"])
def test_verify_steps_replay_with_rollback(tiny_ckpt: Path, drafter: str,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """Verify steps of 1 + 3 tokens a sequence replay from the static buffers (padded to
    buckets as requests finish at different steps), the KDA step record the rollback replays
    and, for DSpark, the tapped rows it drafts from included. Each request drafts the plain
    engine's own tokens corrupted at position 2 (every verify keeps 2 of 3, so every one
    rolls back): the tokens equal the plain engine's and the acceptance is exact."""
    from kdaserve.checkpoint import preset_config
    from kdaserve.speculative.dspark import make_dspark_drafter
    from kdaserve.speculative.schedule import StepCost
    from kdaserve.speculative.scripted import ScriptedDrafter

    k = 3
    ps = prompts(5)
    # 3 tokens a verify: the steps before a request's last one (whose drafts max_tokens
    # trims) are uniform verifies of 5, 4, 3 (padded to 4), 2 and 1 sequences
    params = [SamplingParams(temperature=0, max_tokens=7 + 6 * i, ignore_eos=True)
              for i in range(5)]
    refs = [o.token_ids for o in LLM(tiny_ckpt).generate(prompt_token_ids=ps,
                                                          sampling_params=params)]
    kw: dict = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": k}
    if drafter == "dspark":
        path = make_dspark_drafter(tmp_path_factory.mktemp("dspark-graphs"),
                                   preset_config("tiny"), taps=[0, 2], seed=4)
        kw.update(speculative_algorithm="dspark", speculative_draft_model=str(path))
    llm = LLM(tiny_ckpt, **kw)
    spec = llm.engine.spec
    assert spec is not None
    spec.cost = StepCost(fitted=False, prior_tokens=math.inf)
    futures = {tuple(p): r for p, r in zip(ps, refs, strict=True)}
    scripted = ScriptedDrafter(spec.drafter if drafter == "dspark" else None, k,
                               llm.config.vocab_size, futures, {2}, min_survival=0.0)
    spec.drafter = scripted
    ran = attach(llm, max_bs=8, max_q=1 + k)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    assert got == refs
    verified = [(n, j) for n, j in scripted.log if n]
    assert verified and all(j == scripted.expected_accepts(n) for n, j in verified)
    verifies = [(n, key) for n, key in zip(ran, KEYS, strict=True) if key.q == 1 + k]
    assert {key.bs for _, key in verifies} >= {8, 4, 2, 1}
    assert any(n < key.bs for n, key in verifies)  # padded verify rows
    want_hidden = spec.drafter.taps if spec.drafter.wants_hidden else None
    assert all(key.hidden == want_hidden for key in KEYS)
    assert (want_hidden is not None) == (drafter == "dspark")
    llm.engine.check_integrity()


def test_drafter_rows_from_graphs(tiny_ckpt: Path,
                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """DSpark drafting its own 3 drafts a step (uniform verifies) from the tapped rows the
    graphs return. A 12-token budget leaves running requests out of some steps, so a request
    drafts from rows kept since an earlier step, while other steps replay and rewrite the
    graph's buffers: every proposal equals the eager engine's, the tokens the plain
    engine's."""
    from kdaserve.checkpoint import preset_config
    from kdaserve.speculative.dspark import make_dspark_drafter
    from kdaserve.speculative.schedule import StepCost
    from kdaserve.speculative.scripted import ScriptedDrafter

    k = 3
    path = make_dspark_drafter(tmp_path_factory.mktemp("dspark-rows"), preset_config("tiny"),
                               taps=[0, 2], seed=4)
    ps = prompts(5)
    params = [SamplingParams(temperature=0, max_tokens=7 + 6 * i, ignore_eos=True)
              for i in range(5)]
    refs = [o.token_ids for o in LLM(tiny_ckpt).generate(prompt_token_ids=ps,
                                                          sampling_params=params)]
    drafted = {}
    for graphs in (True, False):
        llm = LLM(tiny_ckpt, speculative_algorithm="dspark", speculative_draft_model=str(path),
                  speculative_num_draft_tokens=k, max_num_batched_tokens=12,
                  speculative_min_acceptance_rate=0.0)
        spec = llm.engine.spec
        assert spec is not None
        spec.cost = StepCost(fitted=False, prior_tokens=math.inf)
        scripted = ScriptedDrafter(spec.drafter, k, llm.config.vocab_size, min_survival=0.0)
        spec.drafter = scripted
        if graphs:
            ran = attach(llm, max_bs=8, max_q=1 + k)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
        assert got == refs
        drafted[graphs] = scripted.drafted
        llm.engine.check_integrity()
    assert any(key.q == 1 + k and key.hidden == (0, 2) for key in KEYS) and ran
    assert drafted[True] == drafted[False] and any(drafted[True])


def test_a_failed_capture_leaves_steps_to_the_eager_forward(tiny_ckpt: Path) -> None:
    """A capture that raises (here: no CUDA to capture on) is said once and every step from
    then on runs the plain forward, verifies with their rollback included: the tokens equal
    the plain engine's and no padding is left where a later step would read it."""
    from kdaserve.speculative.schedule import StepCost
    from kdaserve.speculative.scripted import ScriptedDrafter

    ps = prompts(3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    refs = [o.token_ids for o in LLM(tiny_ckpt).generate(prompt_token_ids=ps,
                                                          sampling_params=params)]
    llm = LLM(tiny_ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    e = llm.engine
    assert e.spec is not None
    e.spec.cost = StepCost(fitted=False, prior_tokens=math.inf)
    e.spec.drafter = ScriptedDrafter(None, 3, llm.config.vocab_size,
                                     {tuple(p): r for p, r in zip(ps, refs, strict=True)}, {2})
    graphs = CudaGraphRunner(e.model, e.states, e.blocks, 4, e.scheduler.max_request_tokens(),
                             4, capture=True)
    e.runner.graphs = graphs
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    assert got == refs and graphs.failed and not graphs.graphs
    assert e.spec.num_verifies > 0
    e.check_integrity()
