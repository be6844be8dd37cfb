"""The `triton` backend (fla-core's KDA kernels; our conv, router, fused MoE and paged MLA)
against the references on CUDA: ragged batches of 1..200 tokens, random state slots and
initial states, fp32 and bf16 inputs, several decode steps; then a whole model on CUDA
against the reference on CPU. Skipped without CUDA and triton; the CPU test checks that the
backend declines a CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kdaserve.kernels import registry, resolve_kernels
from kdaserve.kernels.ref.kda import kda_chunk_ref, kda_decode_ref
from kdaserve.kernels.triton import supports
from kdaserve.kernels.triton.kda import kda_chunk_triton, kda_decode_triton

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
CUDA = torch.device("cuda")
W = 4
# Relative RMS error bounds: fla's chunk kernels use TF32 dots on fp32 inputs and keep bf16
# intermediates for bf16 inputs; the references accumulate in fp32.
TOL = {torch.float32: 5e-3, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    a, e = actual.double(), expected.double()
    err = ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-12)).item()
    assert err <= tol, f"relative RMS error {err:.2e} > {tol:.0e}"


def test_triton_backend_declines_cpu() -> None:
    ok, reason = supports(torch.device("cpu"))
    assert not ok and "CUDA" in reason
    kernels = resolve_kernels(torch.device("cpu"))
    assert kernels.kda_chunk is not kda_chunk_triton
    assert kernels.kda_decode is not kda_decode_triton
    with pytest.raises(ValueError, match="unsupported"):
        registry.resolve("kda_chunk", torch.device("cpu"), "triton")


@pytest.mark.gpu
@needs_gpu
def test_triton_resolves_on_cuda() -> None:
    assert supports(CUDA) == (True, "")
    kernels = resolve_kernels(CUDA)
    assert kernels.kda_chunk is kda_chunk_triton
    assert kernels.kda_decode is kda_decode_triton


LENGTHS = [[1], [64], [200], [1, 70, 3, 128, 200, 17],
           torch.randint(1, 201, (12,), generator=gen(7)).tolist()]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lengths", LENGTHS,
                         ids=lambda L: "len" + "_".join(map(str, L)))
@pytest.mark.parametrize("H,K", [(2, 64), (4, 128)], ids=["h2k64", "h4k128"])
@DTYPES
def test_kda_chunk_triton_vs_ref(lengths: list[int], H: int, K: int, dtype: torch.dtype) -> None:
    g = gen(len(lengths) + K)
    T, B, N = sum(lengths), len(lengths), len(lengths) + 5
    q, k, v, f = (torch.randn(T, H, K, generator=g) for _ in range(4))
    f = f * 3  # gate logits up to ~ +-9: strong and negligible decay both occur
    beta = torch.randn(T, H, generator=g)
    A_log, dt_bias = torch.rand(H, generator=g) * 2, torch.randn(H * K, generator=g)
    pool = torch.randn(N, H, K, K, generator=g) * 0.5
    slots = torch.randperm(N, generator=g)[:B]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, f, beta = (t.to(dtype).to(CUDA) for t in (q, k, v, f, beta))
    A_log, dt_bias, pool, slots, cu = (t.to(CUDA) for t in (A_log, dt_bias, pool, slots, cu))
    ref_pool = pool.clone()
    o_ref = kda_chunk_ref(q, k, v, f, beta, A_log, dt_bias, ref_pool, slots, cu)
    o = kda_chunk_triton(q, k, v, f, beta, A_log, dt_bias, pool, slots, cu)
    assert o.shape == (T, H, K) and o.dtype == dtype
    assert_rel(o, o_ref, TOL[dtype])
    assert_rel(pool[slots], ref_pool[slots], TOL[dtype])
    others = torch.ones(N, dtype=torch.bool, device=CUDA).index_fill_(0, slots, False)
    assert torch.equal(pool[others], ref_pool[others]), "wrote to slots it does not own"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("B", [1, 9, 64])
@pytest.mark.parametrize("H,K", [(2, 32), (4, 128)], ids=["h2k32", "h4k128"])
@pytest.mark.parametrize("strided", [False, True], ids=["pool", "strided_pool"])
@DTYPES
def test_kda_decode_triton_vs_ref(B: int, H: int, K: int, strided: bool,
                                  dtype: torch.dtype) -> None:
    """Three consecutive steps, so the conv window shift and the in-place state update
    (through fla's ssm_state_indices, or gather/scatter for a strided pool) are both used."""
    g = gen(B + K)
    N, C = B + 5, 3 * H * K
    conv_weight = torch.randn(C, W, generator=g).to(dtype).to(CUDA)
    A_log = (torch.rand(H, generator=g) * 2).to(CUDA)
    dt_bias = torch.randn(H * K, generator=g).to(CUDA)
    norm_weight = torch.randn(K, generator=g).to(dtype).to(CUDA)
    state = torch.randn(N, H, K, K, generator=g) * 0.5
    if strided:  # same values, rows no longer contiguous [H, K, V] blocks
        state = state.transpose(0, 1).contiguous().transpose(0, 1)
    state = state.to(CUDA)
    conv_state = torch.randn(N, W - 1, C, generator=g).to(dtype).to(CUDA)
    slots = torch.randperm(N, generator=g)[:B].to(CUDA)
    ref_state, ref_conv = state.clone(), conv_state.clone()
    for _ in range(3):
        qkv = torch.randn(B, C, generator=g).to(dtype).to(CUDA)
        f = (torch.randn(B, H, K, generator=g) * 3).to(dtype).to(CUDA)
        beta = torch.randn(B, H, generator=g).to(dtype).to(CUDA)
        z = torch.randn(B, H, K, generator=g).to(dtype).to(CUDA)
        args = (qkv, f, beta, z, conv_weight, A_log, dt_bias, norm_weight, 1e-5)
        o_ref = kda_decode_ref(*args, ref_state, ref_conv, slots)
        o = kda_decode_triton(*args, state, conv_state, slots)
        assert o.shape == (B, H, K) and o.dtype == dtype
        assert_rel(o, o_ref, TOL[dtype])
        assert_rel(state, ref_state, TOL[dtype])
        torch.testing.assert_close(conv_state, ref_conv)


@pytest.mark.gpu
@needs_gpu
@DTYPES
@pytest.mark.parametrize("T", [1, 16, 200])
def test_moe_experts_triton_vs_ref(T: int, dtype: torch.dtype) -> None:
    """The fused MoE (our Triton kernels, also run under the interpreter on CPU by
    test_triton_interpreted.py) compiled for the GPU: decode and prefill sizes, 16 experts
    top-4, against the reference's expert loop in fp32."""
    from kdaserve.kernels.ref.moe import moe_experts_ref
    from kdaserve.kernels.triton.moe import moe_experts_triton

    g = gen(T)
    E, D, inter, k = 16, 256, 128, 4
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * inter, D, generator=g) / D ** 0.5
    w2 = torch.randn(E, D, inter, generator=g) / inter ** 0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    want = moe_experts_ref(x, weights, ids, w13, w2)
    got = moe_experts_triton(*(t.to(CUDA, dtype if t.is_floating_point() else t.dtype)
                               for t in (x, weights, ids, w13, w2)))
    assert got.shape == (T, D) and got.dtype == dtype
    assert_rel(got.float().cpu(), want, TOL[dtype])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("groups,kept", [(1, 1), (8, 4)])
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_moe_route_triton_vs_ref(T: int, groups: int, kept: int) -> None:
    """Kimi's routing (256 experts, sigmoid scores, bias for selection, top 8 renormalised
    and scaled) in one kernel against the reference: the same experts in the same order; and
    DeepSeek-V3's group-limited form (8 groups, 4 kept)."""
    from kdaserve.kernels.ref.moe import moe_route_ref
    from kdaserve.kernels.triton.moe import moe_route_triton

    g = gen(T)
    logits, bias = torch.randn(T, 256, generator=g) * 2, torch.randn(256, generator=g) * 0.3
    w_ref, ids_ref = moe_route_ref(logits, bias, 8, groups, kept, True, 2.446, "sigmoid")
    w, ids = moe_route_triton(logits.to(CUDA), bias.to(CUDA), 8, groups, kept, True, 2.446,
                              "sigmoid")
    # the GPU's exp is not torch's: rows whose top 9 choices come within 1e-4 of each other
    # may order them otherwise, so those are left out (and must be few)
    top = (torch.sigmoid(logits) + bias).topk(9, dim=-1).values
    clear = (top[:, :-1] - top[:, 1:]).min(-1).values > 1e-4
    assert clear.float().mean() > 0.8
    assert torch.equal(ids.cpu()[clear], ids_ref[clear])
    torch.testing.assert_close(w.cpu()[clear], w_ref[clear], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@needs_gpu
@DTYPES
@pytest.mark.parametrize("new,ctx", [([1] * 8, [1, 7, 300, 1000, 5, 64, 65, 2049]),
                                     ([1, 5, 200], [40, 600, 200])])
def test_mla_attention_triton_vs_ref(new: list[int], ctx: list[int],
                                     dtype: torch.dtype) -> None:
    """Paged MLA (our Triton kernel, also interpreted on CPU) on Kimi's latent shapes:
    decodes over contexts of 1..2049 keys (several splits), a verify and a prefill."""
    from kdaserve.kernels.ref.mla import mla_attention_ref
    from kdaserve.kernels.triton.mla import mla_attention_triton

    g = gen(sum(ctx))
    H, Dn, Dr, R, Dv, page = 32, 128, 64, 512, 128, 16
    pages = [-(-c // page) for c in ctx]
    kv = torch.randn(sum(pages) + 3, page, R + Dr, generator=g)
    perm = torch.randperm(kv.shape[0], generator=g)
    table = torch.zeros(len(ctx), max(pages), dtype=torch.int64)
    starts = [0, *torch.tensor(pages).cumsum(0).tolist()]
    for b, n in enumerate(pages):
        table[b, :n] = perm[starts[b]:starts[b] + n]
    T = sum(new)
    cpu = (torch.randn(T, H, Dn, generator=g), torch.randn(T, H, Dr, generator=g), kv, table,
           torch.tensor([0, *new]).cumsum(0), torch.tensor(ctx),
           torch.randn(H, Dn, R, generator=g) / Dn ** 0.5,
           torch.randn(H, Dv, R, generator=g) / R ** 0.5, 0.07)
    want = mla_attention_ref(*cpu)
    got = mla_attention_triton(*(t.to(CUDA, dtype if t.is_floating_point() else t.dtype)
                                 if isinstance(t, torch.Tensor) else t for t in cpu))
    assert got.shape == want.shape and got.dtype == dtype
    assert_rel(got.float().cpu(), want, TOL[dtype])


@pytest.mark.gpu
@needs_gpu
def test_llm_on_cuda_matches_ref_on_cpu(tiny_ckpt: Path) -> None:
    """Greedy tokens of the whole engine (prefill through kda_chunk, decode through
    kda_decode) on CUDA with the triton backend equal the reference backend's on CPU. fp32
    on both sides, so only kernel rounding differs."""
    from kdaserve import LLM, SamplingParams

    prompts = [[(7 * i + 3 * j) % 3000 + 5 for j in range(n)] for i, n in
               enumerate([1, 9, 70, 130])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {}
    for device, backend in (("cuda", None), ("cpu", "ref")):
        llm = LLM(tiny_ckpt, device=device, dtype="float32", kernel_backend=backend,
                  disable_prefix_cache=True)
        out[device] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                         sampling_params=params)]
        del llm
    assert out["cuda"] == out["cpu"]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fmt", ["k3-dspark-mla", "k3-dspark-gqa", "dflash"])
def test_drafting_passes_from_cuda_graphs_keep_tokens(k3_ckpt: Path, tmp_path: Path,
                                                      fmt: str) -> None:
    """K3's published drafters on CUDA with graphs: their drafting passes replayed from
    CUDA graphs (speculative/draft_graph.py), every draft verified; tokens equal the plain
    engine's, and graphs were captured for the batches seen."""
    import math

    from kdaserve import LLM, SamplingParams
    from kdaserve.checkpoint import preset_config
    from kdaserve.speculative.context_drafter import make_context_drafter
    from kdaserve.speculative.schedule import StepCost

    path = make_context_drafter(tmp_path / fmt, preset_config("k3-tiny"), fmt, seed=11)
    prompts = [[(7 * i + 3 * j) % 900 + 3 for j in range(5 + 11 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(k3_ckpt, device="cuda", disable_prefix_cache=True)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts,
                                                sampling_params=params)]
    del plain
    llm = LLM(k3_ckpt, device="cuda", disable_prefix_cache=True,
              speculative_algorithm="dflash" if fmt == "dflash" else "dspark",
              speculative_draft_model=str(path))
    llm.engine.spec.cost = StepCost(fitted=False, prior_tokens=math.inf)  # type: ignore
    out = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in out] == want
    graphs = llm.engine.spec.drafter.graphs  # type: ignore[union-attr]
    assert graphs is not None and graphs.graphs and not graphs.failed
    assert llm.get_metrics()["spec_num_verifies"] > 0
    llm.engine.check_integrity()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager(tiny_ckpt: Path, dtype: str) -> None:
    """Greedy tokens with decode steps replayed from CUDA graphs equal the eager forward's:
    seven requests finishing one by one walk the decode batch down through the buckets (and
    the steps of 7 decodes, past cuda_graph_max_bs=6, run eagerly)."""
    from kdaserve import LLM, SamplingParams

    prompts = [[(11 * i + 5 * j) % 900 + 3 for j in range(4 + 9 * i)] for i in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(7)]
    out = {}
    for graphs in (True, False):
        kw = {"cuda_graph_max_bs": 6} if graphs else {"disable_cuda_graph": True}
        llm = LLM(tiny_ckpt, device="cuda", dtype=dtype, disable_prefix_cache=True, **kw)
        out[graphs] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                         sampling_params=params)]
        runner = llm.engine.runner.graphs
        assert (runner is not None) == graphs
        if graphs:
            assert sorted(key.bs for key in runner.graphs) == [1, 2, 4, 6]
        llm.engine.check_integrity()
        del llm
    assert out[True] == out[False]


@pytest.mark.gpu
@needs_gpu
def test_verify_graphs_equal_eager_verifies(tiny_ckpt: Path) -> None:
    """Speculation with 3 drafts a step, each request drafting the plain engine's own tokens
    corrupted at position 2 (every verify keeps 2 and rolls back): verify steps replay from
    graphs of 4 tokens a sequence, the KDA rollback fed from the graph's record, and the
    tokens equal eager verifies' and the plain engine's."""
    import math

    from kdaserve import LLM, SamplingParams
    from kdaserve.speculative.schedule import StepCost
    from kdaserve.speculative.scripted import ScriptedDrafter

    prompts = [[(11 * i + 5 * j) % 900 + 3 for j in range(4 + 9 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=7 + 6 * i, ignore_eos=True)
              for i in range(5)]
    plain = LLM(tiny_ckpt, device="cuda", dtype="float32", disable_prefix_cache=True)
    refs = [o.token_ids for o in plain.generate(prompt_token_ids=prompts,
                                                sampling_params=params)]
    del plain
    futures = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
    for graphs in (True, False):
        llm = LLM(tiny_ckpt, device="cuda", dtype="float32", disable_prefix_cache=True,
                  disable_cuda_graph=not graphs, speculative_algorithm="ngram",
                  speculative_num_draft_tokens=3)
        spec = llm.engine.spec
        spec.cost = StepCost(fitted=False, prior_tokens=math.inf)
        spec.drafter = ScriptedDrafter(None, 3, llm.config.vocab_size, futures, {2})
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                 sampling_params=params)]
        assert got == refs
        assert all(j == 2 for n, j in spec.drafter.log if n == 3)
        if graphs:
            assert any(key.q == 4 for key in llm.engine.runner.graphs.graphs)
        llm.engine.check_integrity()
        del llm


@pytest.mark.gpu
@needs_gpu
def test_overlap_schedule_equals_serial_steps(tiny_ckpt: Path) -> None:
    """On CUDA the engine overlaps by default (engine/overlap.py): with graphs, stop tokens
    read a step late and seeded sampling, the tokens equal those of serial steps."""
    from kdaserve import LLM, SamplingParams

    prompts = [[(11 * i + 5 * j) % 900 + 3 for j in range(4 + 9 * i)] for i in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(5)] + [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=list(range(0, 4096, 3))),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, logprobs=2)]
    out = {}
    for overlap in (True, False):
        llm = LLM(tiny_ckpt, device="cuda", dtype="float32",
                  disable_overlap_schedule=not overlap)
        assert llm.engine.overlap == overlap
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        out[overlap] = [(o.token_ids, o.finish_reason) for o in outs]
        llm.engine.check_integrity()
        del llm
    assert out[True] == out[False]


@pytest.mark.parametrize("n,c", [(1, 1), (20, 20), (17, 60), (5, 33)])
def test_mla_prefill_sdpa_matches_reference(n: int, c: int) -> None:
    """The triton backend's expanded MLA prefill (torch SDPA, no triton in it) on the CPU
    against the reference: a fresh prompt, a chunk after cached context, on scattered pages
    (the mixed batches that route to it run under the interpreter, check_mla.py)."""
    from kdaserve.kernels.ref.mla import mla_attention_ref
    from kdaserve.kernels.triton.mla import mla_prefill_sdpa

    g = gen(n + c)
    H, Dn, Dr, R, Dv, page = 3, 16, 8, 32, 12, 4
    pages = -(-c // page)
    kv = torch.randn(pages + 3, page, R + Dr, generator=g)
    table = torch.randperm(pages + 3, generator=g)[:pages]
    q_nope, q_pe = torch.randn(n, H, Dn, generator=g), torch.randn(n, H, Dr, generator=g)
    w_uk, w_uv = torch.randn(H, Dn, R, generator=g) / 4, torch.randn(H, Dv, R, generator=g)
    want = mla_attention_ref(q_nope, q_pe, kv, table[None], torch.tensor([0, n]),
                             torch.tensor([c]), w_uk, w_uv, 0.2)
    got = mla_prefill_sdpa(q_nope, q_pe, kv, table, c, torch.cat([w_uk, w_uv], 1), 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
