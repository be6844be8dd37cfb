"""Rollout routing replay: the engine returns, per sequence, the experts every MoE layer chose
for every forwarded position; they equal a plain full-sequence forward's choices and
transformers' router on the same checkpoint, through chunked prefill, batching, preemption and
a prefix cache that is bypassed for the recorded positions."""

from __future__ import annotations

from pathlib import Path

import torch

from kdaserve import LLM, RequestOptions, SamplingParams
from kdaserve.layers.moe import MoE

from .conftest import MIN_MARGIN, routing_margin

NEW = 6


def plain_routing(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[T, MoE layers, k] experts of one plain forward (the oracle of the engine paths)."""
    got: list[torch.Tensor] = []

    def hook(mod: MoE, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        c = mod.config
        logits = torch.nn.functional.linear(inp[0].float(), mod.gate_weight)
        _, chosen = mod.kernels.moe_route(
            logits, mod.e_score_correction_bias, c.num_experts_per_token, c.num_expert_group,
            c.topk_group, c.moe_renormalize, c.routed_scaling_factor, c.router_activation)
        got.append(chosen.to(torch.int32))

    handles = [m.register_forward_hook(hook) for m in llm.model.modules() if isinstance(m, MoE)]
    try:
        llm.prefill_logits(ids)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(got, 1)


def hf_routing(hf, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """transformers' router choices, taken from its gate modules' outputs."""
    got: list[torch.Tensor] = []

    def hook(mod, inp, out) -> None:  # noqa: ANN001 - (router logits, weights, indices)
        got.append(out[2].reshape(len(ids), -1).to(torch.int32))

    gates = [m.gate for m in hf.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(got, 1)


def test_routed_experts_equal_a_plain_forward(tiny_ckpt: Path, hf_tiny) -> None:  # noqa: ANN001
    llm = LLM(tiny_ckpt, max_num_batched_tokens=24, block_size=4, snapshot_interval=8,
              max_total_tokens=64)  # chunked prefill and preemption
    g = torch.Generator().manual_seed(5)
    prompts = []
    while len(prompts) < 4:
        p = torch.randint(10, 3000, (int(torch.randint(3, 50, (1,), generator=g)),),
                          generator=g).tolist()
        if routing_margin(llm, p) > MIN_MARGIN:
            prompts.append(p)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(
        temperature=0, max_tokens=2, ignore_eos=True))  # cached: replay must bypass it
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp,
                        options=RequestOptions(return_routed_experts=True))
    assert llm.get_metrics()["num_preemptions"] > 0
    compared_hf = 0
    for p, out in zip(prompts, outs, strict=True):
        seq = p + out.token_ids[:-1]  # the last token was never forwarded
        got = out.outputs[0].routed_experts
        assert got is not None and got.shape[0] == len(seq)
        want = plain_routing(llm, seq)
        # the same experts, in whatever order the router lists them
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
        if routing_margin(llm, seq) > MIN_MARGIN:
            hf = hf_routing(hf_tiny, seq)
            assert hf.shape == want.shape, (hf.shape, want.shape)
            assert torch.equal(hf.sort(-1).values, want.sort(-1).values)
            compared_hf += 1
    assert compared_hf > 0
    out = llm.generate(prompt_token_ids=prompts[1:2], sampling_params=sp, options=RequestOptions(
        return_routed_experts=True, routed_experts_start=3))[0]
    full = outs[1].outputs[0].routed_experts
    assert torch.equal(out.outputs[0].routed_experts, full[3:])
    llm.check_integrity()
