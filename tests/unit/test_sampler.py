"""Sampler on hand-made logits: greedy, filters, sampling frequencies, seeds, penalties,
logprobs, and SamplingParams validation."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from kdaserve.engine.sampler import Sampler, SamplerOutput, apply_filters, apply_penalties
from kdaserve.request import Request, SamplingParams

# a fixed distribution with no ties and no float-boundary ambiguity for the filters below
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
LOGITS = PROBS.log()
# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    state = torch.random.get_rng_state()
    torch.manual_seed(1234)
    yield
    torch.random.set_rng_state(state)


def make_req(prompt: Sequence[int] = (1, 2, 3), output: Sequence[int] = (), *,
             seed: int | None = None, rid: str = "r", **params: Any) -> Request:
    req = Request(rid, list(prompt), SamplingParams(seed=seed, **params),
                  output_ids=list(output))
    if seed is not None:  # as LLMEngine.add_request does
        req.generator = torch.Generator().manual_seed(seed)
    return req


def sample_rows(logits: torch.Tensor, num_rows: int, **params: Any) -> torch.Tensor:
    """Samples `num_rows` independent rows of the same logits in one batch."""
    reqs = [make_req(**params) for _ in range(num_rows)]
    out = Sampler()(logits.expand(num_rows, -1).clone(), reqs)
    return torch.tensor(out.token_ids)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom over the tokens with nonzero expected probability."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a zero-probability token"
    expected = probs[keep].double() * len(tokens)
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


# ---- greedy and degenerate filters ----

def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 100)
    reqs = [make_req(temperature=0.0) for _ in range(16)]
    out = Sampler()(logits, reqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0},
                                    {"top_k": 1, "temperature": 5.0},
                                    {"top_p": 1e-6, "temperature": 0.2}],
                         ids=["top_k=1", "top_p=1e-6", "min_p=1", "top_k=1-hot",
                              "top_p=1e-6-cold"])
def test_degenerate_filters_equal_greedy(params: dict[str, Any]) -> None:
    logits = torch.randn(256, 50)
    reqs = [make_req(**params) for _ in range(256)]
    assert Sampler()(logits, reqs).token_ids == logits.argmax(-1).tolist()


# ---- filters never leak, and renormalise correctly ----

@pytest.mark.parametrize(("params", "allowed"), [
    ({"top_k": 3}, [0, 1, 2]),
    ({"top_k": 1000}, list(range(8))),  # larger than the vocabulary: no-op
    ({"top_p": 0.6}, [0, 1]),  # mass before token 2 is 0.65 >= 0.6
    ({"top_p": 0.85}, [0, 1, 2, 3]),  # before token 3: 0.8 < 0.85; before 4: 0.9
    ({"min_p": 0.3}, [0, 1, 2]),  # threshold 0.12
    ({"min_p": 0.2}, [0, 1, 2, 3]),  # threshold 0.08
    ({"top_k": 3, "top_p": 0.6}, [0, 1]),
    ({"top_k": 4, "min_p": 0.3}, [0, 1, 2]),
], ids=["top_k=3", "top_k>V", "top_p=0.6", "top_p=0.85", "min_p=0.3", "min_p=0.2",
        "top_k+top_p", "top_k+min_p"])
def test_filters_never_sample_filtered_tokens(params: dict[str, Any],
                                              allowed: list[int]) -> None:
    tokens = sample_rows(LOGITS, 20_000, **params)
    assert set(tokens.tolist()) == set(allowed)  # nothing else, and each allowed one
    expected = torch.zeros(8)
    expected[allowed] = PROBS[allowed] / PROBS[allowed].sum()
    stat, dof = chi_square(tokens, expected)
    assert stat < CHI2_CRIT_001[dof], (stat, frequencies(tokens, 8))


def test_min_p_threshold_is_relative_to_the_top_token() -> None:
    # same min_p, two distributions: a peaked one keeps fewer tokens than a flat one
    peaked = torch.tensor([0.7, 0.2, 0.06, 0.04]).log()
    flat = torch.tensor([0.3, 0.28, 0.22, 0.2]).log()
    reqs = [make_req(min_p=0.5) for _ in range(2)]
    seen: list[set[int]] = [set(), set()]
    for _ in range(300):
        out = Sampler()(torch.stack([peaked, flat]), reqs)
        for i, t in enumerate(out.token_ids):
            seen[i].add(t)
    assert seen == [{0}, {0, 1, 2, 3}]


# ---- sampling distribution ----

@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0], ids=lambda t: f"T={t}")
def test_sampling_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0])
    tokens = sample_rows(logits, 20_000, temperature=temperature)
    probs = (logits / temperature).softmax(-1)
    stat, dof = chi_square(tokens, probs)
    assert stat < CHI2_CRIT_001[dof], (stat, frequencies(tokens, 6), probs)
    assert (frequencies(tokens, 6) - probs.double()).abs().max() < 0.015


# ---- seeds ----

@pytest.mark.parametrize("params", [{}, {"top_k": 20, "temperature": 0.7},
                                    {"top_p": 0.9, "min_p": 0.01}],
                         ids=["plain", "top_k+temperature", "top_p+min_p"])
def test_seeded_request_reproducible_regardless_of_batch(params: dict[str, Any]) -> None:
    vocab, steps = 64, 25
    gen = torch.Generator().manual_seed(99)
    logit_rows = [torch.randn(vocab, generator=gen) for _ in range(steps)]

    def alone() -> list[int]:
        req = make_req(seed=7, **params)
        tokens = []
        for step in range(steps):
            tokens.append(Sampler()(logit_rows[step].unsqueeze(0), [req]).token_ids[0])
        return tokens

    def batched(row: int, seed: int = 7) -> list[int]:
        target = make_req(seed=seed, **params)
        neighbours = [make_req(), make_req(top_k=3, temperature=1.5), make_req(seed=8),
                      make_req(temperature=0.0, presence_penalty=1.0, output=[1, 2])]
        reqs = neighbours[:row] + [target] + neighbours[row:]
        tokens = []
        for step in range(steps):
            logits = torch.randn(len(reqs), vocab)
            logits[row] = logit_rows[step]
            tokens.append(Sampler()(logits, reqs).token_ids[row])
        return tokens

    reference = alone()
    assert batched(row=0) == reference
    assert batched(row=2) == reference
    assert batched(row=4) == reference
    assert alone() == reference
    assert batched(row=2, seed=8) != reference  # the seed matters
    assert len(set(reference)) > 5  # actually sampled, not greedy


@pytest.mark.parametrize(("params", "num_kept"),
                         [({}, 4096), ({"top_k": 50}, 50), ({"min_p": 1e-14}, 4096),
                          ({"min_p": 1e-12}, 1)],
                         ids=["plain", "top_k-only", "min_p-keeps-tail", "min_p-cuts-tail"])
def test_row_probabilities_do_not_depend_on_neighbours(params: dict[str, Any],
                                                       num_kept: int) -> None:
    # One token holds all but ~4e-10 of the mass, so the float32 cumsum is exactly 1.0 after
    # it: a row without top-p must not be cut there, alone or next to a top-p neighbour.
    logits = torch.zeros(1, 4096)
    logits[0, 0] = 30.0  # each tail token: e^-30 ~ 9.4e-14
    req = make_req(**params)
    alone = apply_filters(logits, [req])
    batched = apply_filters(torch.cat([logits, torch.randn(2, 4096)]),
                            [req, make_req(top_p=0.9), make_req(top_k=5, min_p=0.1)])
    assert torch.equal(batched[0], alone[0])
    assert int((alone > 0).sum()) == num_kept


def test_unseeded_requests_do_not_consume_seeded_generators() -> None:
    seeded = make_req(seed=3)
    first = Sampler()(torch.zeros(1, 32), [seeded]).token_ids
    seeded.generator = torch.Generator().manual_seed(3)
    unseeded = [make_req() for _ in range(5)]
    second = Sampler()(torch.zeros(6, 32), [*unseeded, seeded]).token_ids
    assert second[-1] == first[0]


# ---- penalties ----

PEN_LOGITS = torch.tensor([3.0, 2.6, 2.2, 1.0, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize(("output", "freq", "pres", "expected_argmax"), [
    ([0, 0, 1], 0.5, 0.0, 2),  # 3-1.0=2.0, 2.6-0.5=2.1, 2.2
    ([0, 0, 1], 0.25, 0.0, 0),  # 2.5, 2.35, 2.2
    ([0, 0, 1], 0.0, 0.9, 2),  # 2.1, 1.7, 2.2
    ([0, 0, 0, 0, 1], 0.0, 0.5, 0),  # presence ignores the count: 2.5, 2.1, 2.2
    ([0, 0, 0, 0, 1], 0.5, 0.0, 2),  # frequency does not: 1.0, 2.1, 2.2
    ([0, 0, 1], 0.3, 0.3, 2),  # 2.1, 2.0, 2.2
    ([2], 0.0, -1.0, 2),  # negative presence encourages: 3.2 > 3.0
    ([3, 3, 3], -1.0, 0.0, 3),  # negative frequency encourages: 1.0 + 3.0 = 4.0 > 3.0
], ids=["freq-shifts", "freq-small-keeps", "presence-shifts", "presence-ignores-count",
        "freq-counts", "both", "negative-presence", "negative-frequency"])
def test_frequency_presence_penalty_arithmetic(output: list[int], freq: float, pres: float,
                                               expected_argmax: int) -> None:
    logits = PEN_LOGITS.clone()
    req = make_req(output=output, temperature=0.0, frequency_penalty=freq,
                   presence_penalty=pres)
    counts = torch.bincount(torch.tensor(output), minlength=8).float()
    predicted = logits - freq * counts - pres * (counts > 0).float()
    penalised = apply_penalties(logits.unsqueeze(0), [req])[0]
    torch.testing.assert_close(penalised, predicted)
    assert int(predicted.argmax()) == expected_argmax
    assert Sampler()(logits.unsqueeze(0), [req]).token_ids == [expected_argmax]


def test_penalties_apply_per_row() -> None:
    logits = PEN_LOGITS.expand(3, -1).clone()
    reqs = [make_req(output=[0, 0, 1], temperature=0.0, frequency_penalty=0.5),
            make_req(output=[0, 0, 1], temperature=0.0),  # no penalty: same history
            make_req(output=[], temperature=0.0, presence_penalty=2.0)]  # nothing generated
    assert Sampler()(logits, reqs).token_ids == [2, 0, 0]


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[3.0, 2.0, -1.0, -2.0, 1.5, 0.5]])
    req = make_req(prompt=[0, 2], output=[4], temperature=0.0, repetition_penalty=2.0)
    out = apply_penalties(logits, [req])
    # prompt and output tokens 0, 2, 4 are penalised; 1, 3, 5 untouched
    torch.testing.assert_close(out, torch.tensor([[1.5, 2.0, -2.0, -2.0, 0.75, 0.5]]))
    assert Sampler()(logits, [req]).token_ids == [1]
    # below 1 the penalty encourages the seen tokens instead
    boost = make_req(prompt=[4], temperature=0.0, repetition_penalty=0.5)
    torch.testing.assert_close(apply_penalties(logits, [boost])[0, 4], torch.tensor(3.0))


# ---- logprobs ----

def test_logprobs_are_raw_log_softmax_with_sampled_token() -> None:
    V = 20
    logits = torch.stack([torch.linspace(5.0, 3.1, V), torch.randn(V), torch.randn(V),
                          torch.randn(V)])
    raw = logits.log_softmax(-1)
    reqs = [
        # tokens 0..5 penalised below token 6 (5 - 0.1*6 = 4.4): a token outside the top 5
        make_req(output=[0, 1, 2, 3, 4, 5], temperature=0.0, logprobs=5,
                 frequency_penalty=2.0, presence_penalty=2.0),
        make_req(temperature=0.5, top_k=4, logprobs=3),
        make_req(temperature=0.0, logprobs=0),
        make_req(temperature=0.0),  # no logprobs asked in a batch where others ask
    ]
    out = Sampler()(logits, reqs)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.token_ids[0] == 6
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, t].item(), abs=1e-6)
        assert out.top_logprobs[i][t] == pytest.approx(raw[i, t].item(), abs=1e-6)
    # row 0: the 5 best raw tokens plus the sampled one
    assert list(out.top_logprobs[0])[:5] == [0, 1, 2, 3, 4]
    assert set(out.top_logprobs[0]) == {0, 1, 2, 3, 4, 6}
    for tok, lp in out.top_logprobs[0].items():
        assert lp == pytest.approx(raw[0, tok].item(), abs=1e-6)
    # row 1: top 3 by raw logprob, the sampled token (one of the top 4) included
    top3 = raw[1].topk(3).indices.tolist()
    assert list(out.top_logprobs[1])[:3] == top3
    assert len(out.top_logprobs[1]) == (3 if out.token_ids[1] in top3 else 4)
    assert out.token_ids[1] in raw[1].topk(4).indices.tolist()
    assert out.top_logprobs[2] == {out.token_ids[2]: pytest.approx(raw[2].max().item())}
    assert set(out.top_logprobs[3]) == {out.token_ids[3]}


def test_no_logprobs_when_none_asked() -> None:
    out = Sampler()(torch.randn(2, 10), [make_req(), make_req(temperature=0.0)])
    assert isinstance(out, SamplerOutput)
    assert out.logprobs is None and out.top_logprobs is None


# ---- mixed batches ----

def test_mixed_greedy_and_sampled_rows() -> None:
    n = 512
    logits = torch.randn(n, 30)
    reqs = [make_req(temperature=0.0) if i % 2 == 0 else make_req(temperature=1.0, top_k=3)
            for i in range(n)]
    tokens = torch.tensor(Sampler()(logits, reqs).token_ids)
    argmax = logits.argmax(-1)
    assert torch.equal(tokens[0::2], argmax[0::2])
    top3 = logits[1::2].topk(3, dim=-1).indices
    assert (tokens[1::2].unsqueeze(1) == top3).any(-1).all()
    assert (tokens[1::2] != argmax[1::2]).float().mean() > 0.2  # really sampled


# ---- validation ----

BAD_PARAMS: list[tuple[str, object]] = [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.5), ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 101.0), ("temperature", math.inf),
    ("temperature", math.nan), ("top_p", math.nan), ("min_tokens", 17),
    ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("frequency_penalty", 2.1),
    ("frequency_penalty", -2.1), ("max_tokens", 0), ("logprobs", 21), ("logprobs", -1),
    ("stop", [""]), ("stop", ["ok", ""]),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS,
                         ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_sampling_params_validation(field: str, value: object) -> None:
    name = "stop strings" if field == "stop" else field
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{field: value})


def test_sampling_params_normalisation_and_edges() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="END").stop == ["END"]  # type: ignore[arg-type]
    edge = SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0,
                          frequency_penalty=2.0, logprobs=20, max_tokens=1)
    assert edge.is_greedy and not SamplingParams().is_greedy
    assert math.isclose(edge.min_p, 1.0)
    # temperatures too small to divide the logits by are greedy (as in vLLM), not NaN
    for tiny in (1e-300, 1e-39, 9e-6):
        assert SamplingParams(temperature=tiny).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_tiny_temperature_and_penalty_sample_as_argmax() -> None:
    """What a 1e-300 temperature did before: NaN probabilities and token 0 every step."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    logits[:, 0] = -5.0
    reqs = [make_req(temperature=1e-300), make_req(temperature=1e-39)]
    assert Sampler()(logits[:2].clone(), reqs).token_ids == logits[:2].argmax(-1).tolist()
    # the smallest penalty allowed keeps the logits finite
    low = make_req(temperature=0.5, repetition_penalty=0.01, prompt=[7])
    assert bool(apply_penalties(logits[2:].clone(), [low]).isfinite().all())


@pytest.mark.parametrize("scale", [0.5, 8.0], ids=["flat", "peaked"])
def test_windowed_top_k_top_p_equals_full_sort(scale: float) -> None:
    """The top-window shortcut (no full-vocabulary sort) masks exactly what the full sort
    masks, whether the window holds the top-p mass (peaked) or not (flat: the fallback)."""
    from kdaserve import sampling_filters as sampler

    g = torch.Generator().manual_seed(0)
    V = 3 * sampler.TOP_WINDOW
    logits = torch.randn(6, V, generator=g) * scale
    logits[5, 100:] = float("-inf")  # a grammar-masked row
    top_k = torch.tensor([V, 10, V, 5000, V, V, 5000])  # 5000: top-k past the window
    top_p = torch.tensor([[0.95], [0.9], [1.0], [1.0], [0.5], [0.99], [0.5]])
    logits = torch.cat([logits, logits[:1] * 4])
    assert torch.equal(sampler._top_k_top_p(logits, top_k, top_p),
                       sampler._sorted_filter(logits, top_k, top_p))


def test_bucketed_top_p_keeps_the_exact_prefix() -> None:
    """Flat rows take the bucket path: the kept set is the smallest set of best tokens whose
    mass reaches top_p (checked in float64 against a full sort)."""
    from kdaserve import sampling_filters as sampler

    g = torch.Generator().manual_seed(1)
    V = 5 * sampler.TOP_WINDOW
    for scale, top_p in ((0.3, 0.95), (1.0, 0.5), (2.0, 0.99)):
        row = torch.randn(V, generator=g) * scale
        out = sampler._bucketed_top_p(row, top_p)
        p = row.double().softmax(-1)
        sorted_p, order = p.sort(descending=True)
        excl = sorted_p.cumsum(0) - sorted_p
        expected = torch.zeros(V, dtype=torch.bool)
        expected[order[excl < top_p]] = True
        assert torch.equal(out > float("-inf"), expected)
        assert torch.equal(out[expected], row[expected])
