"""Offline generation: cached decode equals full recomputation; batching, sampling, stops, CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.cli import main as cli_main


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> LLM:
    return LLM(tiny_ckpt)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 3800, (int(L),), generator=g).tolist()
            for L in torch.randint(1, 90, (n,), generator=g)]


def test_decode_uses_caches_and_matches_full_forward(llm: LLM) -> None:
    """Each decode step embeds exactly one token (no prefix recomputation), and its logits equal
    the logits of a from-scratch forward over prompt + generated tokens."""
    prompt = prompts(1, seed=3)[0]
    seen: list[int] = []
    runner = llm.engine.runner  # every step's forward, per op or in one native call
    forward = runner.forward_hidden

    def counted(batch):  # type: ignore[no-untyped-def]
        seen.append(batch.input_ids.numel())  # tokens this forward computes
        return forward(batch)

    runner.forward_hidden = counted  # type: ignore[method-assign]
    try:
        out = llm.generate(prompt_token_ids=[prompt],
                           sampling_params=SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True))[0]
    finally:
        del runner.forward_hidden
    assert seen == [len(prompt)] + [1] * 19
    full = llm.prefill_logits(prompt + out.token_ids)
    # logits at position p predict token p+1: the greedy choices must be the argmaxes
    assert full[len(prompt) - 1:-1].argmax(-1).tolist() == out.token_ids


def test_batched_equals_one_at_a_time(llm: LLM) -> None:
    ps = prompts(6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids for p in ps]
    assert together == alone


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    ps = prompts(3, seed=2)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=16, seed=123,
                            ignore_eos=True)
    a = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    b = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    params.seed = 124
    c = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)]
    assert a == b
    assert a != c


def test_generate_builds_only_final_outputs(llm: LLM) -> None:
    """LLM.generate keeps only each request's last output, so the engine builds no other
    (each copies every token so far); streaming is back on after, and the results are a
    streamed run's final outputs."""
    ps, params = prompts(3, seed=5), SamplingParams(temperature=0, max_tokens=6)
    built: list[bool] = []
    group_output = llm.engine.out.group_output

    def spy(rid: str):  # noqa: ANN202
        out = group_output(rid)
        built.append(out.finished)
        return out

    llm.engine.out.group_output = spy  # type: ignore[method-assign]
    try:
        got = llm.generate(prompt_token_ids=ps, sampling_params=params)
        assert built == [True] * 3 and llm.engine.out.stream
        built.clear()
        for p in ps:
            llm.engine.add_request(p, params)
        streamed = {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                streamed.setdefault(out.rid, []).append(out)
        assert False in built  # updates along the way
        finals = [v[-1] for v in streamed.values()]
        assert all(f.finished for f in finals)
        assert [f.outputs[0].token_ids for f in finals] == [o.token_ids for o in got]
    finally:
        llm.engine.out.group_output = group_output  # type: ignore[method-assign]


def test_stop_token_and_eos(llm: LLM) -> None:
    p = prompts(1, seed=5)
    greedy = llm.generate(prompt_token_ids=p, sampling_params=SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    stop_at = greedy[4]
    out = llm.generate(prompt_token_ids=p, sampling_params=SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_text_prompt_round_trip(llm: LLM) -> None:
    out = llm.generate("Hello, Kimi!", SamplingParams(temperature=0, max_tokens=5,
                                                      ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello, Kimi!")
    assert out.text == llm.tokenizer.decode(out.token_ids)


@pytest.mark.parametrize("bad", [
    {"prompt_token_ids": [[]]},
    {"prompt_token_ids": [[10**9]]},
    {"prompts": ["a"], "prompt_token_ids": [[1]]},
])
def test_bad_input_is_a_value_error(llm: LLM, bad: dict) -> None:
    with pytest.raises(ValueError):
        llm.generate(**bad)


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}])
def test_bad_sampling_params(kw: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_cli_make_checkpoint_and_generate(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "ckpt"
    cli_main(["make-checkpoint", "--preset", "tiny", "--seed", "3", "--out", str(out)])
    assert (out / "config.json").is_file() and (out / "tiktoken.model").is_file()
    capsys.readouterr()
    cli_main(["generate", "--model", str(out), "--prompt", "Hi", "--max-tokens", "4",
              "--ignore-eos"])
    captured = capsys.readouterr()
    assert captured.out.startswith("Hi")
    assert "4 tokens" in captured.err


def test_random_checkpoints_say_so(tiny_ckpt: Path) -> None:
    from kdaserve.checkpoint import RANDOM_MARKER

    assert (tiny_ckpt / RANDOM_MARKER).is_file()
    assert "RANDOM WEIGHTS" in LLM(tiny_ckpt).engine.summary()
