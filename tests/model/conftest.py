"""The independent reference: transformers' KimiLinearForCausalLM on the same checkpoint."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import preset_config
from kdaserve.engine.cuda_graph import CudaGraphRunner, GraphKey
from kdaserve.speculative.context_drafter import make_context_drafter
from kdaserve.speculative.context_net import FORMATS
from kdaserve.speculative.schedule import StepCost


def load_hf(path: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    if importlib.util.find_spec("triton") is not None:
        # With fla and triton importable, transformers routes CPU tensors to Triton kernels
        # and crashes; the test environment deliberately has no triton.
        pytest.skip("triton is installed: transformers would not use its torch fallback")
    model = transformers.KimiLinearForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    # Like our ignore_eos: EOS is an ordinary token that does not stop generation. (HF's
    # min_new_tokens would instead mask EOS out, changing the greedy choice.)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="session")
def hf_tiny(tiny_ckpt: Path) -> torch.nn.Module:
    return load_hf(tiny_ckpt)


@pytest.fixture(scope="session")
def hf_small(small_ckpt: Path) -> torch.nn.Module:
    return load_hf(small_ckpt)


def routing_margin(llm, token_ids: list[int]) -> float:
    """Smallest gap, over every token and MoE layer of a full forward, between the last
    selected and the first rejected expert (or expert group) score.

    Two correct fp32 implementations differ by ~1e-6 in their hidden states; when a router
    score gap is that small they may pick different experts, and the outputs then legitimately
    diverge. Parity tests assert a clear margin first, so a failure always means a real bug.
    """
    import torch.nn.functional as F

    from kdaserve.layers.moe import MoE

    margins: list[float] = []

    def hook(mod: MoE, inp: tuple[torch.Tensor], out: torch.Tensor) -> None:
        c = mod.config
        logits = F.linear(inp[0].float(), mod.gate_weight)
        scores = logits.sigmoid() if c.router_activation == "sigmoid" else logits.softmax(-1)
        choice = scores + mod.e_score_correction_bias
        T, E, G = choice.shape[0], choice.shape[1], c.num_expert_group
        if G > 1:
            group = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
            gs = group.sort(-1, descending=True).values
            margins.append((gs[:, c.topk_group - 1] - gs[:, c.topk_group]).min().item())
            keep = group.topk(c.topk_group, dim=-1).indices
            mask = torch.zeros_like(group, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(E // G, 1), float("-inf"))
        cs = choice.sort(-1, descending=True).values
        k = c.num_experts_per_token
        if k < cs.shape[1]:
            gap = cs[:, k - 1] - cs[:, k]
            margins.append(gap[torch.isfinite(gap)].min().item())

    handles = [m.register_forward_hook(hook) for m in llm.model.modules() if isinstance(m, MoE)]
    try:
        llm.prefill_logits(token_ids)
    finally:
        for h in handles:
            h.remove()
    return min(margins) if margins else float("inf")


# Router score gaps below this are near-ties that two correct fp32 implementations may break
# differently (see routing_margin). Inputs that hit one are redrawn (a few percent do), and the
# margin is asserted, so every comparison is one where only a bug can cause a mismatch.
MIN_MARGIN = 1e-5


def clear_prompt(llm, length: int, seed: int, continuation: int = 0) -> list[int]:
    """A random prompt whose forward (and greedy continuation) has no router near-tie."""
    from kdaserve import SamplingParams

    g = torch.Generator().manual_seed(seed)
    for _ in range(10):
        ids = torch.randint(0, llm.config.vocab_size - 256, (length,), generator=g).tolist()
        full = ids
        if continuation:
            params = SamplingParams(temperature=0.0, max_tokens=continuation, ignore_eos=True)
            full = ids + llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids
        if routing_margin(llm, full) > MIN_MARGIN:
            return ids
    raise AssertionError("could not draw a prompt without router near-ties")


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


# ---- speculative decoding ----
SPEC_NEW = 20  # tokens generated per request in the speculation tests


def greedy_outputs(llm, prompts: list[list[int]]) -> list[list[int]]:
    from kdaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=SPEC_NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="session")
def spec_plain(tiny_ckpt: Path):  # noqa: ANN201 - LLM
    """The reference engine: no speculation, no prefix cache."""
    from kdaserve import LLM

    return LLM(tiny_ckpt, disable_prefix_cache=True)


@pytest.fixture(scope="session")
def spec_prompts(spec_plain) -> list[list[int]]:  # noqa: ANN001
    """Margin-checked prompts, the last with a repeated span so n-gram drafts get accepted."""
    out = [clear_prompt(spec_plain, n, seed=500 + i, continuation=SPEC_NEW)
           for i, n in enumerate((5, 12, 30, 47, 70, 90))]
    rep = greedy_outputs(spec_plain, [out[2]])[0]
    out.append(out[2] + rep + out[2][-8:])  # the continuation is in the context: drafts hit
    return out


def serialize(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """Named tensors as a trainer on the same host sends them to update_weights_from_tensor
    (torch's multiprocessing pickler: shared memory, not copies)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return buf.getvalue()


def attach(llm: LLM, max_bs: int, max_q: int = 1) -> list[int]:
    """Gives the engine an eager-replay runner; returns the batch sizes it ran, in order (and
    keeps the graph keys in `KEYS`)."""
    e = llm.engine
    graphs = CudaGraphRunner(e.model, e.states, e.blocks, max_bs,
                             e.scheduler.max_request_tokens(), max_q, capture=False)
    ran: list[int] = []
    KEYS.clear()
    run = graphs.run

    def counted(fb, key):  # noqa: ANN001, ANN202
        ran.append(fb.num_seqs)
        KEYS.append(key)
        return run(fb, key)

    graphs.run = counted  # type: ignore[method-assign]
    e.runner.graphs = graphs
    return ran


KEYS: list[GraphKey] = []


# K3's published drafters (test_k3_drafters.py, test_k3_drafter_pages.py): a plain K3 engine,
# prompts with clear continuations, its greedy outputs, random drafters in each format
K3_NEW = 12
K3_GREEDY = SamplingParams(temperature=0.0, max_tokens=K3_NEW, ignore_eos=True)
K3_ALGORITHM = {"k3-dspark-mla": "DSPARK", "k3-dspark-gqa": "DSPARK", "dflash": "DFLASH"}


@pytest.fixture(scope="module")
def k3_plain(k3_ckpt: Path) -> LLM:
    return LLM(k3_ckpt, disable_prefix_cache=True)


@pytest.fixture(scope="module")
def k3_prompts(k3_plain: LLM) -> list[list[int]]:
    return [clear_prompt(k3_plain, n, seed=700 + n, continuation=K3_NEW) for n in (3, 17, 40)]


@pytest.fixture(scope="module")
def k3_want(k3_plain: LLM, k3_prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in k3_plain.generate(prompt_token_ids=k3_prompts,
                                                    sampling_params=K3_GREEDY)]


@pytest.fixture(scope="module")
def k3_drafters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, config = tmp_path_factory.mktemp("k3-drafters"), preset_config("k3-tiny")
    return {f: make_context_drafter(root / f, config, f, seed=11) for f in FORMATS}


def k3_drafter_engine(k3_ckpt: Path, path: Path, fmt: str, **kw) -> LLM:
    """An engine speculating with the drafter at path, every draft verified."""
    llm = LLM(k3_ckpt, speculative_algorithm=K3_ALGORITHM[fmt],
              speculative_draft_model=str(path), **kw)
    # every draft verified whatever the timings (random drafts would rightly be stopped)
    llm.engine.spec.cost = StepCost(fitted=False, prior_tokens=math.inf)  # type: ignore
    return llm
