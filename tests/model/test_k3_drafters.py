"""K3's published block drafters (speculative/context_net.py, context_drafter.py): Inferact's
DSpark (MLA), RadixArk's DSpark (GQA) and DFlash, written with random weights in their released
layouts and loaded by path. The engine hands each drafter the taps a plain forward computes at
every committed position (chunked, after verifies that kept all, some or no drafts), in the
stream the format reads; tokens stay plain decoding's on every engine path; the batched,
padded, incremental draft pass equals one request's pass in one piece; broken checkpoints are
refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import preset_config
from kdaserve.request import Request
from kdaserve.speculative.context_drafter import (
    ContextDrafter,
    load_net,
)
from kdaserve.speculative.context_net import FORMATS, Rope, rotate
from kdaserve.speculative.schedule import StepCost
from kdaserve.speculative.scripted import ScriptedDrafter

from .conftest import K3_GREEDY, k3_drafter_engine


def test_rope_is_the_complex_rotation() -> None:
    """Both layouts against x * e^{i pos theta^(-2j/d)} on complex pairs: GPT-J's adjacent
    pairs (MLA) and NeoX's halves (GQA)."""
    g = torch.Generator().manual_seed(0)
    x, pos = torch.randn(5, 3, 8, generator=g), torch.tensor([0, 1, 7, 30, 1000])
    angle = pos[:, None, None] * 500.0 ** -(torch.arange(0, 8, 2) / 8)
    turn = torch.polar(torch.ones_like(angle), angle.float())
    pairs = torch.view_as_complex(x.view(5, 3, 4, 2).contiguous())
    # (fp32 angles at position 1000 round differently by how the frequency is formed)
    torch.testing.assert_close(rotate(x, pos, Rope(500.0), interleaved=True),
                               torch.view_as_real(pairs * turn).flatten(-2), atol=1e-4, rtol=0)
    halves = torch.complex(x[..., :4], x[..., 4:]) * turn
    torch.testing.assert_close(rotate(x, pos, Rope(500.0), interleaved=False),
                               torch.cat([halves.real, halves.imag], -1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("mscales", [{}, {"mscale": 1.0, "mscale_all_dim": 1.0},
                                     {"mscale": 0.707, "mscale_all_dim": 0.707}])
def test_yarn_is_transformers_yarn(mscales: dict) -> None:
    """The MLA drafter's YaRN frequencies and cos/sin scale against transformers'
    `_compute_yarn_parameters` (DeepSeek's rope_parameters with and without mscales); the
    attention scale is m(mscale_all_dim)^2, 1 without it (vLLM's DeepSeek scaling)."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    params = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
              "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
              **mscales}
    hf = PretrainedConfig(hidden_size=64 * 4, num_attention_heads=4, head_dim=64,
                          max_position_embeddings=131072, rope_parameters=params)
    inv, factor = _compute_yarn_parameters(hf)
    rope = Rope(50000.0, 32.0, 4096, 32, 1, mscales.get("mscale", 1.0),
                mscales.get("mscale_all_dim", 0.0))
    torch.testing.assert_close(rope.inv_freq(64), inv.float())
    assert rope.cos_sin_scale == pytest.approx(factor)
    m = 0.1 * mscales.get("mscale_all_dim", 0.0) * math.log(32.0) + 1
    assert rope.attention_scale == pytest.approx(m * m)


LAYER_TENSORS = {
    "mla": ["self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj",
            "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
            "self_attn.o_proj"],
    "gqa": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "self_attn.q_norm", "self_attn.k_norm"],
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_written_in_the_released_layout(k3_drafters: dict[str, Path], fmt: str) -> None:
    """The tensor names vLLM's and SGLang's loaders read (no `model.` prefix; the target's
    embedding and lm_head not included), and the config keys where they look for them."""
    f = FORMATS[fmt]
    names = set(load_file(k3_drafters[fmt] / "model.safetensors"))
    layer = {f"layers.0.{n}.weight" for n in LAYER_TENSORS[f.attention]
             + ["input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj"]}
    heads = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
             "confidence_head.proj.weight", "confidence_head.proj.bias"} if f.dspark else set()
    assert names == layer | heads | {f"{f.fc}.weight", f"{f.fc_norm}.weight",
                                     f"{f.final_norm}.weight"}
    cfg = json.loads((k3_drafters[fmt] / "config.json").read_text())
    assert cfg["architectures"] == [f.architecture]
    where = cfg if f.attention == "mla" else cfg["dflash_config"]
    assert {"mask_token_id", "target_layer_ids"} <= set(where)


class Recording(ContextDrafter):
    """Keeps every context row the engine hands over: (prompt, first position, rows)."""

    def __init__(self, inner: ContextDrafter) -> None:
        super().__init__(inner.net, inner.target, inner.device, inner.pages.pool)
        self.seen: list[tuple[tuple[int, ...], int, torch.Tensor]] = []

    def on_context(self, req: Request, rows: torch.Tensor, start: int) -> None:
        self.seen.append((tuple(req.prompt_ids), start, rows.clone()))
        super().on_context(req, rows, start)


@pytest.mark.parametrize("corrupt", [set(), {0}, {2}], ids=["all", "none", "some"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_context_is_the_plain_forwards_taps(k3_ckpt: Path, k3_drafters: dict[str, Path],
                                            k3_plain: LLM, k3_prompts: list[list[int]],
                                            k3_want: list[list[int]], fmt: str,
                                            corrupt: set[int]) -> None:
    """Chunked prefill and verifies whose drafts (the real drafter's pass, then replaced by
    the target's own tokens, corrupted at a known position) are all, none or some kept: every
    position of every sequence reaches the drafter once, in order, with the taps one plain
    forward computes there in the format's stream; tokens stay plain decoding's."""
    llm = k3_drafter_engine(k3_ckpt, k3_drafters[fmt], fmt, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.drafter, ContextDrafter)
    rec = Recording(spec.drafter)
    futures = {tuple(p): w for p, w in zip(k3_prompts, k3_want, strict=True)}
    spec.drafter = ScriptedDrafter(rec, rec.k, llm.config.vocab_size, futures, corrupt,
                                   min_survival=0.0)
    outs = llm.generate(prompt_token_ids=k3_prompts, sampling_params=K3_GREEDY)
    assert [o.token_ids for o in outs] == k3_want
    m = llm.get_metrics()
    rate = m["spec_num_accepted"] / m["spec_num_drafted"]
    assert rate == 1.0 if not corrupt else (rate == 0 if 0 in corrupt else 0 < rate < 1)
    stream = FORMATS[fmt].tap_stream
    for prompt, out in zip(k3_prompts, k3_want, strict=True):
        parts = [(s, r) for p, s, r in rec.seen if p == tuple(prompt)]
        assert [s for s, _ in parts] == list(tiling_starts(parts))
        got = torch.cat([r for _, r in parts])
        ids = prompt + out[:-1]  # every position the target computed (the last never runs)
        _, taps = k3_plain.prefill_taps(ids, rec.taps, stream)
        assert taps is not None and got.shape[0] <= taps.shape[0]
        torch.testing.assert_close(got, taps[:got.shape[0]], atol=2e-4, rtol=1e-4)
        assert got.shape[0] >= len(ids) - 1 - rec.k  # within one verify of the end
    llm.check_integrity()


def tiling_starts(parts: list[tuple[int, torch.Tensor]]) -> list[int]:
    """Where each part should start if the parts tile the sequence from position 0."""
    starts, at = [], 0
    for _, rows in parts:
        starts.append(at)
        at += rows.shape[0]
    return starts


def test_aggregated_tap_is_what_the_next_site_reads(k3_ckpt: Path, k3_plain: LLM,
                                                    k3_prompts: list[list[int]]) -> None:
    """The aggregated stream after layer i, normed by layer i + 1's input norm, is that
    layer's attention input; after the last layer, the final norm of it is what the lm_head
    reads. The partial stream is the block's partial sum: not the same thing."""
    model = k3_plain.engine.model
    L, ids = len(model.layers), k3_prompts[1]
    seen: dict[int, torch.Tensor] = {}
    hooks = [model.layers[i].self_attn.register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, args[0].clone())) for i in range(L)]
    try:
        hidden, agg = k3_plain.prefill_taps(ids, tuple(range(L)), "aggregated")
    finally:
        for h in hooks:
            h.remove()
    _, partial = k3_plain.prefill_taps(ids, tuple(range(L)), "partial")
    assert agg is not None and partial is not None
    D = model.config.hidden_size
    for i in range(L - 1):
        norm = model.layers[i + 1].input_layernorm
        torch.testing.assert_close(norm(agg[:, i * D:(i + 1) * D]), seen[i + 1],
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.norm(agg[:, -D:]), hidden, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(agg, partial)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_engine_paths_keep_plain_tokens(k3_ckpt: Path, k3_drafters: dict[str, Path],
                                        k3_prompts: list[list[int]], k3_want: list[list[int]],
                                        fmt: str) -> None:
    """Prefix-cache hits (the second pass: the hit tokens' taps never come, the drafter's
    context starts after them) and preemption with recompute (a pool for about one long
    request), batched: tokens stay plain decoding's, nothing leaks."""
    llm = k3_drafter_engine(k3_ckpt, k3_drafters[fmt], fmt)
    for _ in range(2):
        outs = llm.generate(prompt_token_ids=k3_prompts, sampling_params=K3_GREEDY)
        assert [o.token_ids for o in outs] == k3_want
    assert llm.get_metrics()["prefix_cache_hit_tokens"] > 0
    llm.check_integrity()
    tight = k3_drafter_engine(k3_ckpt, k3_drafters[fmt], fmt, max_num_batched_tokens=16,
                              block_size=4, snapshot_interval=8, max_total_tokens=64)
    outs = tight.generate(prompt_token_ids=k3_prompts, sampling_params=K3_GREEDY)
    assert [o.token_ids for o in outs] == k3_want
    m = tight.get_metrics()
    assert m["num_preemptions"] > 0 and m["spec_num_drafted"] > 0
    tight.check_integrity()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_released_variants_load_and_faults_are_named(k3_ckpt: Path, k3_plain: LLM,
                                                     k3_drafters: dict[str, Path], fmt: str,
                                                     tmp_path: Path) -> None:
    """A `model.` prefix and the target's embedding stored beside the drafter (Inferact's
    file holds one) load as the same network, and so does YaRN on an MLA drafter; a missing
    tensor, an incomplete YaRN, YaRN on GQA layers, another target's width and a DFlash
    algorithm on a DSpark drafter are refused by name."""
    src, config = k3_drafters[fmt], preset_config("k3-tiny")
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())

    def write(name: str, t: dict[str, torch.Tensor], c: dict) -> Path:
        (tmp_path / name).mkdir()
        save_file(t, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(c))
        return tmp_path / name

    prefixed = {"model." + n: t for n, t in tensors.items()}
    prefixed["embed_tokens.weight"] = torch.zeros(config.vocab_size, config.hidden_size)
    a = load_net(src, config, torch.float32, torch.device("cpu"))
    b = load_net(write("prefixed", prefixed, cfg), config, torch.float32, torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))
    missing = dict(tensors)
    gone = sorted(missing)[0]
    del missing[gone]
    with pytest.raises(ValueError, match=gone):
        load_net(write("missing", missing, cfg), config, torch.float32, torch.device("cpu"))
    yarn = dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 32,
                                   "original_max_position_embeddings": 32768})
    if FORMATS[fmt].attention == "mla":  # YaRN as vLLM's DeepSeek scaling; incomplete: refused
        assert load_net(write("yarn", tensors, yarn), config, torch.float32,
                        torch.device("cpu")).c.rope.factor == 32
        del yarn["rope_scaling"]["original_max_position_embeddings"]
        with pytest.raises(ValueError, match="original_max_position_embeddings"):
            load_net(write("yarn2", tensors, yarn), config, torch.float32, torch.device("cpu"))
    else:
        with pytest.raises(ValueError, match="yarn"):
            load_net(write("yarn", tensors, yarn), config, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="hidden"):
        load_net(src, preset_config("k3-small"), torch.float32, torch.device("cpu"))
    if FORMATS[fmt].dspark:
        with pytest.raises(ValueError, match="DFlash"):
            LLM(k3_ckpt, speculative_algorithm="dflash", speculative_draft_model=str(src))
        with pytest.raises(ValueError, match="gamma"):
            LLM(k3_ckpt, speculative_algorithm="dspark", speculative_draft_model=str(src),
                speculative_num_draft_tokens=3)


def test_sglang_flags_and_the_writer_command(k3_ckpt: Path, tmp_path: Path,
                                             k3_prompts: list[list[int]],
                                             k3_want: list[list[int]]) -> None:
    """`make-block-drafter --format k3-dspark-gqa` writes a drafter that the server's flags,
    spelled as SGLang's (`--speculative-algorithm DSPARK --speculative-draft-model-path
    --speculative-dspark-block-size`), load; gamma 5 drafts 5 tokens a step."""
    import argparse

    from kdaserve.cli import main
    from kdaserve.server.launch import add_engine_args, engine_config

    main(["make-block-drafter", "--format", "k3-dspark-gqa", "--target", str(k3_ckpt),
          "--out", str(tmp_path / "d"), "--seed", "2"])
    p = argparse.ArgumentParser()
    add_engine_args(p)
    config = engine_config(p.parse_args([
        "--model", str(k3_ckpt), "--speculative-algorithm", "DSPARK",
        "--speculative-draft-model-path", str(tmp_path / "d"),
        "--speculative-dspark-block-size", "5"]))
    assert config.speculative_algorithm == "dspark"
    llm = LLM(k3_ckpt, **{f: getattr(config, f) for f in (
        "speculative_algorithm", "speculative_draft_model", "speculative_dspark_block_size")})
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.drafter, ContextDrafter)
    assert spec.drafter.k == 5 and spec.drafter.fmt.name == "k3-dspark-gqa"
    spec.cost = StepCost(fitted=False, prior_tokens=math.inf)
    outs = llm.generate(prompt_token_ids=k3_prompts, sampling_params=K3_GREEDY)
    assert [o.token_ids for o in outs] == k3_want
    m = llm.get_metrics()
    assert m["spec_num_drafted"] == 5 * m["spec_num_verifies"] > 0
    llm.check_integrity()


def top3(logits: torch.Tensor) -> dict[int, float]:
    """top_k=3 at temperature 1, as the engine's filters sample it."""
    v, i = logits.topk(3)
    return dict(zip(i.tolist(), v.softmax(-1).tolist(), strict=True))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_sampled_tokens_keep_the_target_distribution(k3_ckpt: Path, k3_plain: LLM,
                                                     k3_drafters: dict[str, Path],
                                                     k3_prompts: list[list[int]], fmt: str) -> None:
    """Sampling (top_k 3) with the drafter's pass running and its drafts replaced by the
    greedy continuation, so verifies accept some and reject others by rejection sampling: the
    second token (the first a verify emits) is distributed as the target's exact
    sum_t0 p(t0) p(t1 | t0), within a total variation of 0.1 over 400 seeded requests."""
    prompt = k3_prompts[1]
    first = top3(k3_plain.prefill_logits(prompt)[-1])
    exact: dict[int, float] = {}
    for t0, p0 in first.items():
        for t1, p1 in top3(k3_plain.prefill_logits(prompt + [t0])[-1]).items():
            exact[t1] = exact.get(t1, 0.0) + p0 * p1
    llm = k3_drafter_engine(k3_ckpt, k3_drafters[fmt], fmt)
    spec = llm.engine.spec
    assert spec is not None
    greedy = k3_plain.generate(prompt_token_ids=[prompt], sampling_params=K3_GREEDY)[0].token_ids
    spec.drafter = ScriptedDrafter(spec.drafter, spec.drafter.k, llm.config.vocab_size,
                                   {tuple(prompt): greedy}, min_survival=0.0)
    n = 400
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=s, ignore_eos=True)
              for s in range(n)]
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params)
    seen: dict[int, int] = {}
    for o in outs:
        seen[o.token_ids[1]] = seen.get(o.token_ids[1], 0) + 1
    tv = 0.5 * sum(abs(seen.get(t, 0) / n - exact.get(t, 0.0)) for t in set(seen) | set(exact))
    assert tv < 0.1, (seen, exact)
    m = llm.get_metrics()
    assert 0 < m["spec_num_accepted"] < m["spec_num_drafted"]
    llm.check_integrity()


def test_taps_stop_while_no_request_will_draft(k3_ckpt: Path, k3_drafters: dict[str, Path],
                                               k3_plain: LLM, k3_prompts: list[list[int]]) -> None:
    """Random drafts are never kept, so the adaptive policy switches each request off for
    longer each time; once no request will draft within TAPS_WARMUP tokens the forwards stop
    tapping (the one-call decode path is back, no context writes) and resume before drafting
    does: the context then has gaps, and the tokens are still plain decoding's."""
    long = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    k3_want = k3_plain.generate(prompt_token_ids=k3_prompts[:2], sampling_params=long)
    llm = k3_drafter_engine(k3_ckpt, k3_drafters["k3-dspark-gqa"], "k3-dspark-gqa",
                            speculative_min_acceptance_rate=0.5)
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.drafter, ContextDrafter)
    rec = spec.drafter = Recording(spec.drafter)
    outs = llm.generate(prompt_token_ids=k3_prompts[:2], sampling_params=long)
    assert [o.token_ids for o in outs] == [o.token_ids for o in k3_want]
    assert llm.get_metrics()["spec_num_switched_off"] >= 2
    for prompt, out in zip(k3_prompts[:2], k3_want, strict=True):
        parts = [(s, r.shape[0]) for p, s, r in rec.seen if p == tuple(prompt)]
        covered = sum(n for _, n in parts)
        ends = [s + n for s, n in parts]
        gaps = sum(s > e for (s, _), e in zip(parts[1:], ends, strict=False))
        assert gaps >= 1 and covered < len(prompt) + len(out.token_ids) - 1
    llm.check_integrity()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_graph_pass_drafts_as_the_eager_one(k3_ckpt: Path, k3_drafters: dict[str, Path],
                                                k3_prompts: list[list[int]],
                                                k3_want: list[list[int]], fmt: str) -> None:
    """The drafting pass on the CUDA graphs' static buffers (run eagerly here: the capture
    needs a GPU; speculative/draft_graph.py) proposes what the eager pass does, for 1-3
    requests padded to a batch bucket (3 in 4 rows), their contexts of different lengths
    padded to a 256-position bucket; tokens stay plain decoding's."""
    llm = k3_drafter_engine(k3_ckpt, k3_drafters[fmt], fmt)
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.drafter, ContextDrafter)
    drafter = spec.drafter
    drafter.use_graphs(capture=False)
    graphs = drafter.graphs
    assert graphs is not None
    propose, sizes = drafter.propose, []

    def both(reqs: list[Request]) -> None:
        drafter.graphs = graphs
        propose(reqs)
        got = [(r.draft_ids, drafter.survival(r)) for r in reqs]
        drafter.graphs = None
        propose(reqs)
        for (ids, survival), r in zip(got, reqs, strict=True):
            assert ids == r.draft_ids
            if survival is not None:
                torch.testing.assert_close(survival, drafter.survival(r))
        sizes.append(len(reqs))

    drafter.propose = both  # type: ignore[method-assign]
    out = llm.generate(prompt_token_ids=k3_prompts[:3], sampling_params=K3_GREEDY)
    assert [o.token_ids for o in out] == k3_want[:3]
    assert max(sizes) == 3 and {k.bs for k in graphs.buffers} >= {4}
    assert {k.length for k in graphs.buffers} == {256}
    llm.check_integrity()
