"""The streaming interface: per-request output streams, concurrent requests, abort, errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kdaserve import LLM, SamplingParams
from kdaserve.client.async_llm import AsyncLLM
from kdaserve.client.request_client import EngineError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_ckpt: Path):
    e = AsyncLLM(model=str(tiny_ckpt), max_num_batched_tokens=32)
    yield e
    e.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_streams_concurrent_requests_token_by_token(engine: AsyncLLM, tiny_ckpt: Path) -> None:
    prompts = [[5, 6, 7], list(range(100, 180)), [42]]

    async def consume(p: list[int]) -> list[list[int]]:
        return [list(o.token_ids) async for o in engine.generate(p, GREEDY)]

    async def main() -> list[list[list[int]]]:
        return await asyncio.gather(*(consume(p) for p in prompts))

    streams = run(main())
    expected = LLM(tiny_ckpt).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for updates, ref in zip(streams, expected, strict=True):
        # one update per generated token, each extending the previous one
        assert [len(u) for u in updates] == list(range(1, 13))
        assert updates[-1] == ref.token_ids
    run(engine.call("check_integrity"))


def test_leaving_a_stream_aborts_it(engine: AsyncLLM) -> None:
    async def main() -> dict[str, int]:
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        async for out in engine.generate(list(range(50)), params):
            if len(out.token_ids) == 3:
                break  # the client went away
        await asyncio.sleep(0.05)
        return await engine.get_metrics()

    metrics = run(main())
    assert metrics["num_running"] == 0 and metrics["num_waiting"] == 0
    # everything is free again, or held by the prefix cache alone
    assert metrics["free_blocks"] + metrics["cached_blocks"] == metrics["total_blocks"]
    assert metrics["free_state_slots"] + metrics["cached_snapshots"] == \
        metrics["total_state_slots"]


def test_bad_request_raises_and_engine_stays_healthy(engine: AsyncLLM) -> None:
    async def main() -> list[int]:
        with pytest.raises(EngineError, match="vocabulary") as err:
            async for _ in engine.generate([10**8], GREEDY):
                pass
        assert err.value.status == 400
        first = engine.generate([1, 2], GREEDY, rid="dup")
        await first.__anext__()
        with pytest.raises(EngineError, match="already in use"):
            async for _ in engine.generate([1, 2], GREEDY, rid="dup"):
                pass
        await first.aclose()  # leaving the stream aborts it
        outs = [o async for o in engine.generate([1, 2, 3], GREEDY)]
        return outs[-1].token_ids

    assert len(run(main())) == 12
    run(engine.call("check_integrity"))


def test_add_request_submits_at_once_and_streams(engine: AsyncLLM) -> None:
    async def main() -> tuple[int, list[int]]:
        rid, stream = await engine.add_request([3, 4, 5], GREEDY, rid="explicit")
        assert rid == "explicit"
        await asyncio.sleep(0.3)  # the engine runs it although nobody reads yet
        running = (await engine.get_metrics())["generation_tokens"]
        outs = [o async for o in stream]
        return running, outs[-1].token_ids

    generated_before_reading, tokens = run(main())
    assert generated_before_reading > 0 and len(tokens) == 12
