"""Checkpoint loading: safetensors (single file or sharded) read tensor by tensor into place.

We parse the safetensors header ourselves and `readinto` each tensor's bytes straight into its
destination parameter (or through one tensor-sized buffer when the dtype differs). Memory-mapping
the file would count every touched page in our RSS on top of the model, doubling peak memory for
a single-file checkpoint; this keeps the peak at about the model plus its largest tensor.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from kdaserve.config import ModelConfig
from kdaserve.hub_schema import MXFP4_GROUP
from kdaserve.kernels import Kernels
from kdaserve.kernels.host_memory import advise_huge_pages
from kdaserve.kernels.ref.mxfp4 import quantize_mxfp4
from kdaserve.kernels.ref.quant import quantize_int8
from kdaserve.layers.linear import Linear
from kdaserve.layers.mla import MLAttention
from kdaserve.layers.moe import MoE
from kdaserve.layers.parallel import (
    SINGLE,
    SINGLE_EP,
    Destination,
    ExpertParallel,
    Prefix,
    Shard,
    TensorParallel,
    full_shape,
    tensor_of,
)
from kdaserve.models.kimi_linear import KimiLinearForCausalLM

Progress = Callable[[int, int], None]  # (bytes read so far, bytes in all)

DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8,  # U8: MXFP4 experts
}


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({path / name for name in weight_map.values()})
        for p in files:
            if not p.is_file():
                raise FileNotFoundError(f"shard {p.name} listed in {index.name} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte offset where tensor data starts)."""
    with open(file, "rb") as f:
        prefix = f.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        raw = f.read(n) if 0 <= n <= 100_000_000 else b""
    try:
        header = json.loads(raw)
    except ValueError:  # too short, or not safetensors at all
        raise ValueError(f"{file.name}: truncated or not a safetensors file") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def canonical_name(name: str) -> str:
    # transformers' save_pretrained writes dense layers under block_sparse_moe.{gate,up,down}_proj
    # (its MoE->mlp renaming run in reverse); Moonshot's own checkpoints use mlp.*.
    for proj in ("gate_proj", "up_proj", "down_proj"):
        marker = f".block_sparse_moe.{proj}."
        if marker in name:
            return name.replace(marker, f".mlp.{proj}.")
    return name


# what a K3 checkpoint holds beside its text model (k3_spec.md 5.1)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def _unexpected(model: KimiLinearForCausalLM, raw_name: str, file: str) -> str:
    """Why a checkpoint tensor has no place in the model, with MXFP4's cases named."""
    if raw_name.endswith((".weight_packed", ".weight_scale")):
        if ".experts." not in raw_name:
            return (f"tensor {raw_name!r} in {file}: an MXFP4-packed tensor outside the routed "
                    "experts is not supported")
        if model.config.expert_format != "mxfp4":
            return (f"tensor {raw_name!r} in {file}: packed MXFP4 experts, but config.json "
                    "has no MXFP4 quantization_config")
    if model.config.expert_format == "mxfp4" and ".experts." in raw_name:
        return (f"tensor {raw_name!r} in {file}: config.json says the routed experts are "
                "MXFP4 (weight_packed and weight_scale), this one is not")
    return f"unexpected tensor {raw_name!r} in {file}"


def _plan(model: KimiLinearForCausalLM, path: Path, skip: tuple[str, ...] = (),
          ) -> list[tuple[Path, int, list[tuple[str, dict, Destination]]]]:
    """Every tensor of the checkpoint checked against the model (known name, once, its shape,
    a supported dtype, bytes inside the file) and none missing, before any is read. Names
    starting with `skip` are passed over unread."""
    views = model.checkpoint_tensors()
    seen: set[str] = set()
    plan = []
    for file in checkpoint_files(path):
        header, data_start = read_header(file)
        size = file.stat().st_size
        tensors = []
        for raw_name, meta in header.items():
            if skip and raw_name.startswith(skip):
                continue
            name = canonical_name(raw_name)
            if name not in views:
                raise ValueError(_unexpected(model, raw_name, file.name))
            if name in seen:
                raise ValueError(f"tensor {raw_name!r} appears twice in the checkpoint")
            dest = views[name]
            seen.add(name)
            if dest is None:  # an expert another expert-parallel rank holds
                continue
            if isinstance(dest, Prefix):
                dest = dest.stored_as(meta["shape"])
            if list(meta["shape"]) != list(full_shape(dest)):
                raise ValueError(f"tensor {raw_name!r} has shape {meta['shape']}, "
                                 f"expected {list(full_shape(dest))}")
            if meta["dtype"] not in DTYPES:
                raise ValueError(f"tensor {raw_name!r} has unsupported dtype {meta['dtype']}")
            if (meta["dtype"] == "U8") != (tensor_of(dest).dtype == torch.uint8):
                raise ValueError(f"tensor {raw_name!r} has dtype {meta['dtype']}, expected "
                                 f"{tensor_of(dest).dtype}")
            begin, end = meta["data_offsets"]
            if not 0 <= begin <= end or data_start + end > size:
                raise ValueError(f"tensor {raw_name!r}: file truncated ({file.name})")
            itemsize = torch.empty(0, dtype=DTYPES[meta["dtype"]]).element_size()
            if end - begin != _numel(full_shape(dest)) * itemsize:
                raise ValueError(f"tensor {raw_name!r}: byte size does not match its shape")
            tensors.append((raw_name, meta, dest))
        plan.append((file, data_start, tensors))
    missing = sorted(set(views) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path} is missing tensors: {missing[:5]}{more}")
    return plan


def check_weights(model: KimiLinearForCausalLM, path: Path) -> None:
    """Raises ValueError if `load_weights(model, path)` could fail on the checkpoint's form."""
    _plan(model, path, _skipped(model))


def _skipped(model: KimiLinearForCausalLM) -> tuple[str, ...]:
    # a model built from a config with a vision tower was built text-only on purpose
    return VISION_PREFIXES if model.config.has_vision_tower else ()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load_weights(model: KimiLinearForCausalLM, path: Path,
                 progress: Progress | None = None) -> None:
    """`progress(done, total)`: checkpoint bytes read so far, after every tensor."""
    plan = _plan(model, path, _skipped(model))
    total = sum(meta["data_offsets"][1] - meta["data_offsets"][0]
                for _, _, tensors in plan for _, meta, _ in tensors)
    done = 0
    for file, data_start, tensors in plan:
        with open(file, "rb") as f:
            for raw_name, meta, dest in tensors:
                begin, end = meta["data_offsets"]
                src_dtype = DTYPES[meta["dtype"]]
                if isinstance(dest, Shard):
                    _read_shard(f, data_start + begin, dest, src_dtype, raw_name)
                else:
                    f.seek(data_start + begin)
                    _read_into(f, dest, src_dtype, end - begin, raw_name)
                done += end - begin
                if progress is not None:
                    progress(done, total)


def _read_shard(f, offset: int, shard: Shard, src_dtype: torch.dtype, name: str) -> None:
    """A tensor-parallel rank's slice: a slice of leading rows is read alone (one seek);
    a slice of columns is read with its whole tensor, through a buffer of that size."""
    shape = shard.full_shape
    itemsize = torch.empty(0, dtype=src_dtype).element_size()
    lead = all(d == 1 for d in shape[:shard.dim])  # the slice is contiguous in the file
    if lead:
        row = _numel(shape[shard.dim + 1:]) * itemsize
        n = shard.dest.shape[shard.dim]
        f.seek(offset + shard.rank * n * row)
        _read_into(f, shard.dest, src_dtype, n * row, name)
        return
    f.seek(offset)
    full = torch.empty(shape, dtype=src_dtype)
    _read_into(f, full, src_dtype, full.numel() * itemsize, name)
    with torch.no_grad():
        shard.dest.copy_(shard.take(full))


def _read_into(f, dest: torch.Tensor, src_dtype: torch.dtype, nbytes: int, name: str) -> None:
    if nbytes != dest.numel() * torch.empty(0, dtype=src_dtype).element_size():
        raise ValueError(f"tensor {name!r}: byte size does not match its shape")
    if src_dtype == dest.dtype and dest.is_contiguous() and dest.device.type == "cpu":
        buf = dest.detach().view(torch.uint8).reshape(-1).numpy()
        if f.readinto(memoryview(buf)) != nbytes:
            raise ValueError(f"tensor {name!r}: file truncated")
        return
    data = bytearray(f.read(nbytes))
    if len(data) != nbytes:
        raise ValueError(f"tensor {name!r}: file truncated")
    src = torch.frombuffer(data, dtype=src_dtype) if nbytes else torch.empty(0, dtype=src_dtype)
    with torch.no_grad():
        dest.copy_(src.view(dest.shape))


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic random fp32 value for one checkpoint tensor, independent of load order.

    Scales keep activations O(1) through the tiny test models, so logits are spread out and
    greedy parity is not decided by near-ties. Decay parameters follow fla's initialisation.
    """
    if name.endswith((".weight_packed", ".weight_scale")):
        # MXFP4: the float weight this name's weight would hold, quantized (so a preset with
        # MXFP4 experts is its float self, rounded)
        rows, cols = shape[:-1], shape[-1] * (2 if name.endswith("packed") else MXFP4_GROUP)
        packed, scales = quantize_mxfp4(random_tensor(name.rsplit(".", 1)[0] + ".weight",
                                                      (*rows, cols), seed))
        return packed if name.endswith("packed") else scales
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(-6.9, -2.3, generator=g).exp()
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=g) * 0.1
    if "norm" in name.rsplit(".", 2)[-2] if "." in name else False:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if "conv1d" in name:
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    # a conv's inputs are all but its first dimension (the vision tower's patch embedding)
    fan_in = math.prod(shape[1:]) if name.endswith("patch_embed.proj.weight") else shape[-1]
    return torch.randn(shape, generator=g) / fan_in ** 0.5


def init_random(model: KimiLinearForCausalLM, seed: int) -> None:
    """`load_format="dummy"`: every tensor random (same values `make-checkpoint` writes; a
    tensor-parallel rank keeps its slice of each)."""
    with torch.no_grad():
        for name, dest in model.checkpoint_tensors().items():
            if dest is None:
                continue
            value = random_tensor(name, full_shape(dest), seed)
            if isinstance(dest, Shard):
                dest.dest.copy_(dest.take(value))
            else:
                dest.copy_(value)


def checkpoint_bytes(path: Path, dtype: torch.dtype) -> int:
    """What the checkpoint at `path` takes once loaded in `dtype`, from its headers alone:
    floating tensors at dtype's size, the others (MXFP4's uint8) as stored."""
    total = 0
    for file in checkpoint_files(Path(path)):
        for meta in read_header(file)[0].values():
            stored = DTYPES.get(meta.get("dtype", ""))
            if stored is None:  # __metadata__, or a dtype _plan refuses
                continue
            size = dtype.itemsize if stored.is_floating_point else stored.itemsize
            total += math.prod(meta["shape"]) * size
    return total


def build_model(config: ModelConfig, kernels: Kernels, dtype: torch.dtype,
                device: torch.device, path: Path | None, load_format: str = "auto",
                seed: int = 0, weight_dtype: torch.dtype | None = None,
                quantization: str | None = None, tp: TensorParallel = SINGLE,
                ep: ExpertParallel = SINGLE_EP,
                progress: Progress | None = None) -> KimiLinearForCausalLM:
    """Builds on the meta device (no init cost), materialises, then fills every parameter.
    `weight_dtype` (default `dtype`): the projections' and experts' weights only, the bytes a
    decode step streams (weight-only bf16 on a CPU); norms, embeddings and the rest `dtype`.
    `quantization="int8"`: those weights quantized per row once loaded (weight-only int8).
    `tp`: this tensor-parallel rank's shard of the model (reading only its slices).
    `progress`: see load_weights. The text model only: a K3 checkpoint's vision tower is
    `models/vision.py`'s."""
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config, kernels, tp, ep)
    # by name, after to_empty: moving off the meta device replaces the Parameter objects
    fp32_suffixes = ("A_log", "dt_bias", "gate_weight", "e_score_correction_bias")
    model.to_empty(device=device)
    matmul_weights = {id(m.weight) for m in streamed_linears(model)}
    matmul_weights |= {id(p) for m in model.modules() if isinstance(m, MoE) for p in (m.w13, m.w2)}
    for n, p in model.named_parameters():
        if not p.is_floating_point():  # MXFP4 experts: held as stored
            continue
        target = p.dtype if n.endswith(fp32_suffixes) else \
            weight_dtype or dtype if id(p) in matmul_weights else dtype
        if p.dtype != target:  # nothing to convert: the values come next
            p.data = torch.empty(p.shape, dtype=target, device=p.device)
        advise_huge_pages(p.data)  # before the values are written (where memory is the host's)
    model.requires_grad_(False)
    if load_format == "dummy":
        init_random(model, seed)
    elif load_format == "auto":
        if path is None:
            raise ValueError("a checkpoint path is needed unless load_format='dummy'")
        load_weights(model, path, progress)
    else:
        raise ValueError(f"unknown load_format {load_format!r} (auto or dummy)")
    if quantization == "int8":
        quantize_weights(model)
    elif quantization == "mxfp4":
        pack_experts(model)
    elif quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r} (int8, mxfp4)")
    return model.eval()


def streamed_linears(model: KimiLinearForCausalLM) -> list[Linear]:
    """The projections a forward streams through the `linear` op: every Linear but MLA's
    kv_b_proj, which is only read as the small absorbed W_UK / W_UV (kept fp32, so nothing
    widens or dequantizes it every step)."""
    absorbed = {id(m.kv_b_proj) for m in model.modules() if isinstance(m, MLAttention)}
    return [m for m in model.modules() if isinstance(m, Linear) and id(m) not in absorbed]


def quantize_weights(model: KimiLinearForCausalLM) -> None:
    """Every streamed projection and expert weight to int8 with per-row scales, in place (the
    loaded float values are the source)."""
    for m in streamed_linears(model):
        q, m.scale = quantize_int8(m.weight.data)
        m.weight = torch.nn.Parameter(_on_huge_pages(q), requires_grad=False)
    for m in model.modules():
        if isinstance(m, MoE):
            q13, m.w13_scale = quantize_int8(m.w13.data)
            q2, m.w2_scale = quantize_int8(m.w2.data)
            m.w13 = torch.nn.Parameter(_on_huge_pages(q13), requires_grad=False)
            m.w2 = torch.nn.Parameter(_on_huge_pages(q2), requires_grad=False)


def pack_experts(model: KimiLinearForCausalLM) -> None:
    """`quantization="mxfp4"`: every MoE layer's routed experts packed to MXFP4 (as K3 ships
    its own) from the loaded float values, expert by expert (one expert's float temporaries
    at a time); experts stored packed stay as they are."""
    for m in model.modules():
        if not isinstance(m, MoE) or m.mxfp4:
            continue
        inter, width = m.w2.shape[-1], m.w2.shape[1]
        for name, n in (("the experts' input width", width), ("moe_intermediate_size", inter)):
            if n % MXFP4_GROUP:
                raise ValueError(f"--quantization mxfp4: {name} = {n} (per rank) is not a "
                                 f"multiple of {MXFP4_GROUP}")
        packed = [[quantize_mxfp4(w[e]) for e in range(w.shape[0])] for w in (m.w13, m.w2)]
        (w13, s13), (w2, s2) = ((torch.stack([p for p, _ in ws]), torch.stack([s for _, s in ws]))
                                for ws in packed)
        m.w13 = torch.nn.Parameter(_on_huge_pages(w13), requires_grad=False)
        m.w2 = torch.nn.Parameter(_on_huge_pages(w2), requires_grad=False)
        m.w13_scale, m.w2_scale, m.mxfp4 = s13, s2, True


def _on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t copied into memory advised for huge pages (host_memory.advise_huge_pages) before
    the copy writes it; t as it is where the advice does not apply."""
    out = torch.empty_like(t)
    return out.copy_(t) if advise_huge_pages(out) else t
