"""Checkpoint loading: every tensor lands where it belongs with the value written, transformers'
`save_pretrained` output loads too, broken checkpoints fail by name, and the peak memory of a
load stays near the model's own size."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdaserve import LLM, SamplingParams
from kdaserve.checkpoint import make_checkpoint
from kdaserve.models.loader import random_tensor, read_header

FP32_ON_DISK = ("A_log", "dt_bias")  # fp32 in Moonshot's checkpoints whatever the rest is
FP32_IN_MODEL = ("A_log", "dt_bias", "gate.weight", "gate.e_score_correction_bias")
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenizer.json")
CKPTS = {"tiny_ckpt": (0, torch.bfloat16), "small_ckpt": (1, torch.float32)}  # seed, disk dtype


def written_value(name: str, shape: tuple[int, ...], seed: int,
                  disk_dtype: torch.dtype) -> torch.Tensor:
    """What `make_checkpoint` stored for `name`, in the dtype it stored it in."""
    t = random_tensor(name, shape, seed)
    return t if name.endswith(FP32_ON_DISK) else t.to(disk_dtype)


def file_tensor_names(folder: Path) -> set[str]:
    return {name for f in folder.glob("*.safetensors") for name in read_header(f)[0]}


def copy_ckpt(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=lambda _dir, names: [n for n in names if n in skip])
    return dst


def edit_tensors(file: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab - 256, (n,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


# ---- correct checkpoints ----

@pytest.mark.parametrize("ckpt", list(CKPTS), ids=["tiny-single_file-bf16",
                                                   "small-3_shards-fp32"])
def test_every_tensor_has_the_written_value(request: pytest.FixtureRequest, ckpt: str) -> None:
    path: Path = request.getfixturevalue(ckpt)
    seed, disk_dtype = CKPTS[ckpt]
    if ckpt == "small_ckpt":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == 3
    llm = LLM(path)
    views = llm.model.checkpoint_tensors()
    assert set(views) == file_tensor_names(path)
    for name, view in views.items():
        assert view.dtype == torch.float32, name  # CPU default: fp32 compute
        expected = written_value(name, tuple(view.shape), seed, disk_dtype).float()
        assert torch.equal(view, expected), name
    # the fp32 decay parameters really are fp32 on disk, and were not rounded on the way in
    a_log = views["model.layers.0.self_attn.A_log"]
    assert not torch.equal(a_log, a_log.bfloat16().float())


@pytest.mark.parametrize("ckpt", list(CKPTS), ids=["tiny-bf16_disk", "small-fp32_disk"])
def test_bf16_model_keeps_router_and_decay_fp32(request: pytest.FixtureRequest,
                                                ckpt: str) -> None:
    """On a CPU, bfloat16 is weight-only: the projections' and experts' weights bf16, the
    rest (norms, embeddings, conv, router, decay) fp32 and unrounded."""
    import re

    # (MLA's kv_b_proj is read only as the absorbed W_UK / W_UV and stays fp32)
    matmul = re.compile(r"((?<!kv_b)_proj|_proj_with_mqa|lm_head|\.w[123])\.weight$")
    path: Path = request.getfixturevalue(ckpt)
    seed, disk_dtype = CKPTS[ckpt]
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True)
    views = llm.model.checkpoint_tensors()
    fp32_names = [n for n in views if n.endswith(FP32_IN_MODEL)]
    assert any("gate.weight" in n for n in fp32_names)
    assert any("e_score_correction_bias" in n for n in fp32_names)
    for name, view in views.items():
        written = written_value(name, tuple(view.shape), seed, disk_dtype)
        if name.endswith(FP32_IN_MODEL) or not matmul.search(name):
            assert view.dtype == torch.float32, name
            assert torch.equal(view, written.float()), name  # exact, not via bf16
        else:
            assert view.dtype == torch.bfloat16, name
            assert torch.equal(view, written.bfloat16()), name
    if disk_dtype == torch.float32:  # fp32 router values on disk survive unrounded
        router = views["model.layers.1.block_sparse_moe.gate.weight"]
        assert not torch.equal(router, router.bfloat16().float())


def test_transformers_save_pretrained_checkpoint_loads(tiny_ckpt: Path,
                                                       hf_tiny: torch.nn.Module,
                                                       tmp_path: Path) -> None:
    """transformers writes hub names back, but dense layers as `block_sparse_moe.*_proj` and the
    router in fp32; the result must be the same model."""
    out = tmp_path / "hf"
    hf_tiny.save_pretrained(out)
    names = file_tensor_names(out)
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names  # the alias is exercised
    assert "model.layers.0.mlp.gate_proj.weight" not in names
    assert "layer_types" in json.loads((out / "config.json").read_text())
    ours = LLM(tiny_ckpt, skip_tokenizer_init=True)
    theirs = LLM(out, skip_tokenizer_init=True)
    assert theirs.config == replace(ours.config, checkpoint_dtype="float32")
    for name, view in theirs.model.checkpoint_tensors().items():
        assert torch.equal(view, ours.model.checkpoint_tensors()[name]), name
    ids = prompt_ids(ours.config.vocab_size, 40, seed=3)
    torch.testing.assert_close(theirs.prefill_logits(ids), ours.prefill_logits(ids),
                               atol=1e-5, rtol=0)


# ---- broken checkpoints ----

LAST_EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
KV_B = "model.layers.3.self_attn.kv_b_proj.weight"
ROTARY = "model.layers.3.self_attn.rotary_emb.inv_freq"


def _drop(t: dict[str, torch.Tensor]) -> None:
    del t[LAST_EXPERT]


def _add(t: dict[str, torch.Tensor]) -> None:
    t[ROTARY] = torch.ones(4)


def _transpose(t: dict[str, torch.Tensor]) -> None:
    t[KV_B] = t[KV_B].t().contiguous()


def _int8(t: dict[str, torch.Tensor]) -> None:
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.int8)


BAD_TENSORS: list[tuple[str, Callable[[dict[str, torch.Tensor]], None], str]] = [
    ("missing", _drop, rf"missing tensors: \['{LAST_EXPERT}'\]"),
    ("unexpected", _add, rf"unexpected tensor '{ROTARY}' in model.safetensors"),
    ("wrong_shape", _transpose, rf"tensor '{KV_B}' has shape \[32, 64\], expected \[64, 32\]"),
    ("unsupported_dtype", _int8, r"tensor 'model.norm.weight' has unsupported dtype I8"),
]


@pytest.mark.parametrize("edit,message", [b[1:] for b in BAD_TENSORS],
                         ids=[b[0] for b in BAD_TENSORS])
def test_bad_tensor_is_named(tiny_ckpt: Path, tmp_path: Path,
                             edit: Callable[[dict[str, torch.Tensor]], None],
                             message: str) -> None:
    path = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    edit_tensors(path / "model.safetensors", edit)
    with pytest.raises(ValueError, match=message):
        LLM(path)


def test_duplicate_tensor_across_files(tiny_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    norm = load_file(str(path / "model.safetensors"))["model.norm.weight"]
    save_file({"model.norm.weight": norm}, str(path / "model-extra.safetensors"))
    with pytest.raises(ValueError, match="'model.norm.weight' appears twice"):
        LLM(path)


def test_truncated_file_names_the_cut_tensor(tiny_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    file = path / "model.safetensors"
    header, _ = read_header(file)
    last = max(header, key=lambda n: header[n]["data_offsets"][1])
    data = file.read_bytes()
    file.write_bytes(data[:-10])
    with pytest.raises(ValueError, match=rf"tensor '{last}': file truncated"):
        LLM(path)


@pytest.mark.parametrize("keep", [0, 5, 200], ids=["empty", "cut_in_length", "cut_in_header"])
def test_truncated_header(tiny_ckpt: Path, tmp_path: Path, keep: int) -> None:
    path = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:keep])
    with pytest.raises(ValueError, match="model.safetensors: truncated or not a safetensors"):
        LLM(path)


def test_shard_listed_in_index_but_missing(small_ckpt: Path, tmp_path: Path) -> None:
    shard = "model-00002-of-00003.safetensors"
    path = copy_ckpt(small_ckpt, tmp_path / "ckpt", skip=(shard,))
    with pytest.raises(FileNotFoundError,
                       match=rf"shard {shard} listed in model.safetensors.index.json is missing"):
        LLM(path)


def test_folder_without_safetensors(tiny_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(tiny_ckpt, tmp_path / "ckpt", skip=("model.safetensors",))
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
        LLM(path)


def test_folder_without_config(tiny_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(tiny_ckpt, tmp_path / "ckpt", skip=("config.json",))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(path)


def test_unknown_load_format(tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="unknown load_format 'pt'"):
        LLM(tiny_ckpt, load_format="pt")


# ---- dummy weights and missing tokenizers ----

def test_dummy_load_format_needs_only_config(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Dummy weights are exactly what `make_checkpoint` writes, before the cast to bf16."""
    path = copy_ckpt(tiny_ckpt, tmp_path / "ckpt", skip=("model.safetensors",))
    dummy = LLM(path, load_format="dummy", seed=0)
    fp32_ckpt = make_checkpoint(tmp_path / "fp32", "tiny", seed=0, dtype="float32",
                                with_tokenizer=False)
    loaded = LLM(fp32_ckpt, skip_tokenizer_init=True)
    for name, view in dummy.model.checkpoint_tensors().items():
        assert torch.equal(view, loaded.model.checkpoint_tensors()[name]), name
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = dummy.generate("The capital of France is", sampling_params=params)[0]
    assert len(out.token_ids) == 12 and out.text is not None
    ref = loaded.generate(prompt_token_ids=[out.prompt_token_ids], sampling_params=params)[0]
    assert out.token_ids == ref.token_ids


def test_checkpoint_without_tokenizer(tiny_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(tiny_ckpt, tmp_path / "ckpt", skip=TOKENIZER_FILES)
    with pytest.raises(FileNotFoundError, match="no tokenizer in .*tiktoken.model"):
        LLM(path)
    llm = LLM(path, skip_tokenizer_init=True)
    ids = [prompt_ids(llm.config.vocab_size, 9, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
    assert out.text is None and len(out.token_ids) == 6
    ref = LLM(tiny_ckpt).generate(prompt_token_ids=ids, sampling_params=params)[0]
    assert out.token_ids == ref.token_ids
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("hello", sampling_params=params)


# ---- memory ----

MAKE_MEDIUM = """
import json, sys
from kdaserve.checkpoint import make_checkpoint, preset_config
config = preset_config("small", hidden_size=512, intermediate_size=1024, num_experts=16,
                       moe_intermediate_size=256)
make_checkpoint(sys.argv[1], config, seed=3, dtype="bfloat16", with_tokenizer=False)
"""

MEASURE_LOAD = """
import json, resource, sys
import torch
import torch._dynamo  # imported lazily by the first meta-device init: ~70 MB, not the loader's
import kdaserve
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
llm = kdaserve.LLM(sys.argv[1], skip_tokenizer_init=True)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
params = list(llm.model.parameters())
print(json.dumps({"delta_kib": after - before,
                  "fp32_bytes": sum(p.numel() * 4 for p in params),
                  "all_fp32": all(p.dtype == torch.float32 for p in params)}))
"""


def run_python(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is KiB on Linux")
def test_peak_rss_of_load_is_about_the_model_size(tmp_path: Path) -> None:
    """bf16 on disk into an fp32 model: the loader reads tensor by tensor into place, so the
    peak is the model plus one tensor, not the model plus a whole file in memory."""
    path = tmp_path / "medium"
    run_python(MAKE_MEDIUM, str(path))
    disk_bytes = (path / "model.safetensors").stat().st_size
    report = json.loads(run_python(MEASURE_LOAD, str(path)).strip().splitlines()[-1])
    fp32_bytes = report["fp32_bytes"]
    assert report["all_fp32"]
    assert fp32_bytes >= 150e6 and disk_bytes >= fp32_bytes // 2  # big enough to see a copy
    delta = report["delta_kib"] * 1024
    limit = 1.3 * fp32_bytes + 30 * 2**20
    assert delta <= limit, (f"peak RSS grew by {delta / 2**20:.0f} MiB loading a "
                            f"{fp32_bytes / 2**20:.0f} MiB model (limit {limit / 2**20:.0f})")


def test_tokenizer_larger_than_the_vocabulary_is_refused(tiny_ckpt: Path,
                                                         tmp_path: Path) -> None:
    """A tokenizer whose ids run past the model's vocabulary (another model's tokenizer) is a
    load-time error, not an out-of-range embedding lookup later."""
    for name in ("config.json", "tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(tiny_ckpt / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] -= 512
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tmp_path, load_format="dummy")


def test_make_checkpoint_with_a_tokenizer_folder(tiny_ckpt: Path, tmp_path: Path) -> None:
    """`--tokenizer DIR`: the model's vocabulary and special ids follow the tokenizer, extra
    special tokens take free reserved ids, and the checkpoint loads and generates."""
    from kdaserve.tokenizer import Tokenizer

    out = make_checkpoint(tmp_path / "ck", "tiny", seed=2, tokenizer=tiny_ckpt,
                          extra_special_tokens=("<|open|>", "<|sep|>"))
    tok = Tokenizer.from_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == tok.vocab_size
    ids = {tok.token_to_id("<|open|>"), tok.token_to_id("<|sep|>")}
    assert None not in ids and len(ids) == 2
    assert tok.encode("<|open|>x<|sep|>")[0] == tok.token_to_id("<|open|>")
    out_ids = LLM(out).generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out_ids[0].token_ids) == 3
