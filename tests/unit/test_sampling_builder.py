"""Every endpoint's one way to SamplingParams (server/sampling.py): the request's fields, the
sampling policy for the request's mode, then SamplingParams' own defaults and range checks."""

from __future__ import annotations

import pytest

from kdaserve.request import SamplingParams
from kdaserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateSampling
from kdaserve.server.sampling import Sampling
from kdaserve.server.sampling_policy import load_policy

K3 = load_policy("kimi-k3", None)


def test_omitted_fields_take_the_engine_defaults_whatever_the_endpoint() -> None:
    plain = SamplingParams(max_tokens=5)
    for fields in (CompletionRequest(prompt="x").sampling_fields(5),
                   GenerateSampling(max_new_tokens=5).sampling_fields()):
        got = Sampling().params(fields)
        assert got == plain, fields
    # /generate's SGLang spellings of "off" mean the same
    off = GenerateSampling(top_k=-1, max_new_tokens=5).sampling_fields()
    assert Sampling().params(off).top_k == 0


def test_the_policy_fills_defaults_by_mode_and_a_raw_prompt_takes_the_default_mode() -> None:
    fields = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]) \
        .sampling_fields(8)
    assert Sampling(K3).params(fields, thinking=True).temperature == 1.0
    assert Sampling(K3).params(fields, thinking=False).temperature == 0.6
    raw = CompletionRequest(prompt="x").sampling_fields(8)
    assert Sampling(K3, default_thinking=True).params(raw).temperature == 1.0
    assert Sampling(K3, default_thinking=False).params(raw).temperature == 0.6
    assert Sampling(K3).params(raw).top_p == 0.95
    given = CompletionRequest(prompt="x", temperature=0.3).sampling_fields(8)
    assert Sampling(K3).params(given).temperature == 0.3  # allowed: kept


@pytest.mark.parametrize(("fields", "named"), [
    ({"temperature": 1.5}, "temperature"),  # the policy's range
    ({"top_p": 0.8}, "top_p"),  # the policy's allowed values
])
def test_a_value_the_policy_refuses_is_an_error_naming_it(fields: dict, named: str) -> None:
    for request in (CompletionRequest(prompt="x", **fields).sampling_fields(8),
                    GenerateSampling(**fields).sampling_fields()):
        with pytest.raises(ValueError, match=named):
            Sampling(K3).params(request)


def test_ranges_are_checked_by_sampling_params_for_every_endpoint() -> None:
    # within the request schema's bounds, outside what the engine takes: min_tokens > max
    with pytest.raises(ValueError, match="min_new_tokens"):
        Sampling().params(GenerateSampling(min_new_tokens=9, max_new_tokens=3)
                          .sampling_fields())
    with pytest.raises(ValueError, match="min_tokens"):
        Sampling().params(CompletionRequest(prompt="x", min_tokens=9).sampling_fields(3))
