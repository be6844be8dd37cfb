"""RL refit and sleep/wake in the engine: after each kind of weight update the engine's greedy
tokens and logprobs equal a fresh engine on the new weights (and transformers' on them); bad
updates are refused whole with the old weights serving; released memory is really freed and
generation after resuming is unchanged; pause modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import make_checkpoint
from kdaserve.engine import rl
from tests.ports import free_port

from .conftest import serialize

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 9, 17, 33], list(range(40, 90))]


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny architecture with other weights (another seed)."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-other"), "tiny", seed=7)


def run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    return [(o.token_ids, o.outputs[0].logprobs or []) for o in outs]


def same(a, b) -> None:  # noqa: ANN001
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        for x, y in zip(la, lb, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[k] - y[k]) <= 1e-4 for k in x)


def test_update_from_disk_and_tensor(tiny_ckpt: Path, other_ckpt: Path) -> None:
    llm = LLM(tiny_ckpt)
    e = llm.engine
    old = run(llm)
    new = run(LLM(other_ckpt))
    assert [t for t, _ in old] != [t for t, _ in new]
    out = e.rl.update_weights_from_disk(str(other_ckpt), weight_version="v1")
    assert out["weight_version"] == e.rl.weight_version == "v1"
    same(run(llm), new)
    # back to the old weights as shared tensors (what a trainer on the same host sends)
    named = list(LLM(tiny_ckpt).model.checkpoint_tensors().items())
    e.rl.update_weights_from_tensor([serialize([(k, v.clone()) for k, v in named])], "v2")
    same(run(llm), old)
    llm.check_integrity()


def test_bad_updates_are_refused_whole(tiny_ckpt: Path, small_ckpt: Path) -> None:
    llm = LLM(tiny_ckpt)
    e = llm.engine
    before = run(llm)
    name, tensor = next(iter(llm.model.checkpoint_tensors().items()))
    bad = [
        (lambda: e.rl.update_weights_from_disk(str(small_ckpt)), "architecture"),
        (lambda: e.rl.update_weights_from_disk("/no/such/dir"), "not a checkpoint"),
        (lambda: e.rl.update_weights_from_tensor([serialize([(name, tensor * 0 + 1),
                                                              ("nope", tensor)])]), "nope"),
        (lambda: e.rl.update_weights_from_tensor([serialize([(name, tensor[:1])])]), "shape"),
        (lambda: e.rl.update_weights_from_tensor([b"not a pickle"]), "serialized"),
        (lambda: e.rl.update_weights_from_tensor([serialize([("os", print)])]), "tensors"),
    ]
    import pickle

    evil = pickle.dumps(__import__("os").system)  # would run a command if unpickled freely
    bad.append((lambda: e.rl.update_weights_from_tensor([evil]), "tensors only"))

    class Nested:  # a second, unrestricted unpickle through torch.load: refused
        def __reduce__(self):  # noqa: ANN204
            return (torch.storage._load_from_bytes, (b"x",))

    class Foreign:  # another process's shared memory by name: refused
        def __reduce__(self):  # noqa: ANN204
            from torch.multiprocessing.reductions import rebuild_storage_filename

            return (rebuild_storage_filename, (torch.UntypedStorage, b"", b"/other", 16))

    for payload, message in ((Nested(), "tensors only"), (Foreign(), "shared-memory")):
        blob = pickle.dumps([(name, payload)])
        bad.append((lambda blob=blob: e.rl.update_weights_from_tensor([blob]), message))
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()
    assert e.rl.weight_version == "default"
    same(run(llm), before)  # the first tensor of the refused batch was never written
    llm.check_integrity()


def test_release_frees_memory_and_resume_restores(tiny_ckpt: Path) -> None:
    llm = LLM(tiny_ckpt, max_total_tokens=200_000)  # a KV cache big enough to see
    e = llm.engine
    before = run(llm)
    e.blocks.kv.fill_(1.0)  # a used cache is resident; a fresh calloc'ed one is not yet
    out = e.rl.release_memory_occupation()
    freed = out["rss_mb_before"] - out["rss_mb_after"]
    assert freed > 0.5 * (e.blocks.bytes_per_block(e.model_config, e.config.block_size,
                                                   e.dtype) * e.blocks.num_blocks) / 2**20
    with pytest.raises(rl.EngineAsleep):
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="released"):
        e.rl.update_weights_from_disk(str(tiny_ckpt))
    e.rl.resume_memory_occupation(["kv_cache"])
    e.rl.resume_memory_occupation(["weights"])
    same(run(llm), before)
    llm.check_integrity()


def test_pause_modes(tiny_ckpt: Path) -> None:
    llm = LLM(tiny_ckpt)
    e = llm.engine
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = llm.generate(prompt_token_ids=PROMPTS, sampling_params=long)
    for mode in ("retract", "in_place"):
        rids = [e.add_request(p, long) for p in PROMPTS]
        for _ in range(5):
            e.step()
        e.rl.pause_generation(mode)
        if mode == "retract":
            assert not e.scheduler.running and e.blocks.num_free + len(
                e.cache.tree_blocks()) == e.blocks.num_blocks
        e.rl.continue_generation()
        done = {}
        while e.has_unfinished():
            for o in e.step():
                if o.finished:
                    done[o.rid] = o
        assert [done[r].token_ids for r in rids] == [w.token_ids for w in want]
    e.add_request(PROMPTS[0], long)
    e.step()
    e.rl.pause_generation("abort")
    assert not e.has_unfinished()
    e.step()  # the abort outputs
    llm.check_integrity()


def _trainer(port: int, out) -> None:  # noqa: ANN001 - a multiprocessing queue
    """Rank 0: joins, then broadcasts a tensor too big to vanish into a socket buffer."""
    import datetime

    import torch.distributed as dist

    t0 = __import__("time").monotonic()
    try:
        # the engine may leave the group while this side still completes its connections
        # (its own join returned first): that is the same quick failure as a broadcast's
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                rank=0, timeout=datetime.timedelta(seconds=120))
        t0 = __import__("time").monotonic()
        dist.broadcast(torch.ones(32 * 2**20), src=0)
        out.put(("sent", 0.0))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((f"failed: {type(e).__name__}", __import__("time").monotonic() - t0))


def test_rendezvous_runs_beside_the_engine_and_failures_leave_no_trace(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing as mp

    monkeypatch.setattr(rl, "RENDEZVOUS_TIMEOUT_S", 2.0)
    llm = LLM(tiny_ckpt)
    e = llm.engine
    want = run(llm)
    # nobody joins: the call returns at once, the engine serves while it waits, then it fails;
    # an update sent meanwhile waits for the join and fails with it
    waiting = e.rl.init_weights_update_group("127.0.0.1", free_port(), 1, 2)
    with pytest.raises(ValueError, match="still waiting"):
        e.rl.destroy_weights_update_group()
    same(run(llm), want)
    with pytest.raises(ValueError, match="failed"):
        e.rl.update_weights_from_distributed(["x"], ["float32"], [[1]])
    with pytest.raises(ValueError, match="failed"):
        waiting.result(timeout=60)
    assert e.rl.update_groups == {}
    # a later rendezvous meets its trainer (the failed one left torch's group count as it was);
    # the join waits long enough for a spawned trainer to import torch on a busy machine (at
    # 2 s a CI-loaded run timed out before the trainer connected)
    monkeypatch.setattr(rl, "RENDEZVOUS_TIMEOUT_S", 60.0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    trainer = ctx.Process(target=_trainer, args=(port, out))
    trainer.start()
    try:
        e.rl.init_weights_update_group("127.0.0.1", port, 1, 2)  # not awaited: the update waits
        # an update that cannot be received (here: the weights are released, so nothing
        # bounds its shapes; a wrong dtype or shape goes the same way) is refused, and the
        # group is left so the trainer's broadcast fails now instead of waiting out its
        # two-minute timeout
        e.rl.release_memory_occupation(["weights"])
        with pytest.raises(ValueError, match="released.*group was left"):
            e.rl.update_weights_from_distributed(["w"], ["int8"], [[32 * 2**20]])
        e.rl.resume_memory_occupation(["weights"])
        status, waited = out.get(timeout=60)
        # failed when the group was left, not at its 120 s timeout (a generous margin for a
        # busy machine)
        assert status.startswith("failed") and waited < 90
        assert e.rl.update_groups == {}
    finally:
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
    same(run(llm), want)
    llm.check_integrity()


def test_update_from_a_transformers_module_matches_transformers(tiny_ckpt: Path,
                                                                other_ckpt: Path) -> None:
    """A trainer holding transformers' module sends its named_parameters (fused conv, forget
    gate module, fused experts): the engine then generates what that module computes."""
    from .conftest import load_hf

    hf = load_hf(other_ckpt)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # weights no checkpoint holds: a training step's worth of change
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
    llm = LLM(tiny_ckpt)
    # the router's correction bias is a buffer in transformers: sent too (it differs here)
    named = [(k, v.detach().clone()) for k, v in hf.named_parameters()] + [
        (k, v.clone()) for k, v in hf.named_buffers() if "e_score_correction_bias" in k]
    llm.engine.rl.update_weights_from_tensor([serialize(named)], "hf")
    for prompt, (tokens, lps) in zip(PROMPTS, run(llm), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
        for i, (t, entry) in enumerate(zip(tokens, lps, strict=True)):
            row = ref[len(prompt) - 1 + i]
            assert t == int(row.argmax())
            assert abs(entry[t] - row[t].item()) <= 1e-4
    llm.check_integrity()
