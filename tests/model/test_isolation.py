"""One bad request never fails the batch: a request whose sampling fails ends alone (with an
error in the server, `abort` in `LLM`), its neighbours' tokens do not change, and nothing
leaks; parameters that would overflow in the sampler are refused up front."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.engine.sampler import Sampler
from kdaserve.request import Request

POISON = 0.123  # the temperature that makes the patched sampler fail


class FlakySampler(Sampler):
    """Fails whenever a poisoned request is in the batch: what an overflow in one request's
    parameters did to every request sampled with it."""

    def __call__(self, logits: torch.Tensor, reqs: list[Request]):  # noqa: ANN204
        if any(r.params.temperature == POISON for r in reqs):
            raise OverflowError("Overflow when unpacking long long")
        return super().__call__(logits, reqs)


def test_a_failing_request_fails_alone(tiny_ckpt: Path) -> None:
    llm = LLM(tiny_ckpt)
    prompts = [[5 + i, 9, 17 + 3 * i] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    llm.engine.sampler = FlakySampler(llm.engine.sampler.stop_ids)
    poisoned = SamplingParams(temperature=POISON, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[greedy, poisoned, greedy,
                                                                   greedy])
    assert outs[1].finish_reason == "abort"
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == \
        [o.token_ids for i, o in enumerate(want) if i != 1]
    llm.check_integrity()


@pytest.mark.parametrize("kw", [{"top_k": 2**63}, {"n": 10**9}, {"seed": 2**70}])
def test_overflowing_parameters_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_engine_loop_reports_the_failure_to_its_request_only(tiny_ckpt: Path) -> None:
    """Through the engine loop the server runs: the poisoned stream raises a 500 EngineError,
    the others finish with the tokens they would have had, and the loop keeps serving."""
    import asyncio

    from kdaserve.client.async_llm import AsyncLLM
    from kdaserve.client.request_client import EngineError

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    poisoned = SamplingParams(temperature=POISON, max_tokens=6, ignore_eos=True)
    prompts = [[5 + i, 9, 17 + 3 * i] for i in range(3)]
    want = LLM(tiny_ckpt).generate(prompt_token_ids=prompts, sampling_params=greedy)
    engine = AsyncLLM(model=str(tiny_ckpt))
    engine.engine.sampler = FlakySampler(engine.engine.sampler.stop_ids)

    async def last(p: list[int], sp: SamplingParams) -> list[int] | EngineError:
        try:
            return [list(o.token_ids) async for o in engine.generate(p, sp)][-1]
        except EngineError as e:
            return e

    async def main() -> list[list[int] | EngineError]:
        return await asyncio.gather(last(prompts[0], greedy), last(prompts[1], poisoned),
                                    last(prompts[2], greedy))

    try:
        a, bad, c = asyncio.run(main())
        assert isinstance(bad, EngineError) and bad.status == 500 and "sampling" in str(bad)
        assert [a, c] == [want[0].token_ids, want[2].token_ids]
        again = asyncio.run(last(prompts[0], greedy))
        assert again == want[0].token_ids
    finally:
        engine.shutdown()
    engine.engine.check_integrity()


class FailsAfterDrawing(Sampler):
    """Draws everyone's noise (seeded generators move on), then fails for the batch."""

    def __call__(self, logits: torch.Tensor, reqs: list[Request]):  # noqa: ANN204
        out = super().__call__(logits, reqs)
        if len(reqs) > 1 and any(r.params.temperature == POISON for r in reqs):
            raise RuntimeError("failed after drawing")
        if any(r.params.temperature == POISON for r in reqs):
            raise RuntimeError("the poisoned request fails alone too")
        return out


def test_seeded_neighbours_of_a_failed_batch_are_undisturbed(tiny_ckpt: Path) -> None:
    llm = LLM(tiny_ckpt)
    prompts = [[5 + i, 9, 17 + 3 * i] for i in range(3)]
    seeded = [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=6, ignore_eos=True)
              for i in range(2)]
    want = llm.generate(prompt_token_ids=prompts[:2], sampling_params=seeded)
    llm.engine.sampler = FailsAfterDrawing(llm.engine.sampler.stop_ids)
    poisoned = SamplingParams(temperature=POISON, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[*seeded, poisoned])
    assert outs[2].finish_reason == "abort"
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in want]
    llm.check_integrity()
