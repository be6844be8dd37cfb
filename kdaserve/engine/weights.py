"""Weight sync for RL (SGLang's refit API): new weights from a checkpoint on disk, from named
tensors a trainer shares, or broadcast by a trainer over torch.distributed; and the weights'
version. Every update is checked whole before a byte is written (names, shapes, dtypes,
completeness), so a bad one leaves the old weights serving.

Named tensors arrive pickled the way SGLang's `MultiprocessingSerializer` sends them
(`ForkingPickler`, so a CPU tensor travels as a shared-memory handle, not a copy). Unpickling
what a client sent would run any code it names, so only the few torch functions that rebuild
tensors and storages are allowed (`SafeUnpickler`); file-descriptor passing, which needs a
shared parent process, is refused with a hint to use the `file_system` sharing strategy.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdaserve.kernels.ref.mxfp4 import quantize_mxfp4
from kdaserve.layers.parallel import Prefix, Shard, full_shape, tensor_of
from kdaserve.models.loader import check_weights, load_weights

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "float64": torch.float64}
SAFE_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    *(("torch", name) for name in FLOAT_DTYPES),
    ("torch", "uint8"),  # MXFP4 experts' codes and scales, sent as stored
}


# torch's own shared-memory segment names (`file_system` strategy) and its manager's socket:
# nothing else in /dev/shm may be mapped (another process's segment, or a path trick)
TORCH_SHM = re.compile(rb"/torch_\d+_\d+_\d+")
MAX_SHARED_BYTES = 1 << 36


def _shared_storage(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
    from torch.multiprocessing.reductions import rebuild_storage_filename

    if not (isinstance(handle, bytes) and TORCH_SHM.fullmatch(handle)
            and isinstance(manager, bytes) and manager.endswith(b"/manager.sock")
            and isinstance(size, int) and 0 <= size <= MAX_SHARED_BYTES):
        raise ValueError("serialized_named_tensors: not a torch shared-memory tensor handle")
    return rebuild_storage_filename(cls, manager, handle, size, dtype)


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
            return _shared_storage
        if (module, name) == ("multiprocessing.resource_sharer", "DupFd"):
            raise ValueError("tensors shared by file descriptor can only reach a child process; "
                             "call torch.multiprocessing.set_sharing_strategy('file_system') "
                             "before serializing")
        if (module, name) not in SAFE_GLOBALS:
            raise ValueError(f"serialized_named_tensors may hold tensors only, not {module}."
                             f"{name}")
        return super().find_class(module, name)


def load_named_tensors(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    import torch.multiprocessing  # noqa: F401 - registers the shared-memory rebuilders

    try:
        named = SafeUnpickler(io.BytesIO(blob)).load()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed payload, whatever broke
        raise ValueError(f"serialized_named_tensors: not a serialized tensor list ({e})") from None
    if isinstance(named, dict):
        named = list(named.items())
    if not isinstance(named, list) or not all(
            isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
            and isinstance(x[1], torch.Tensor) for x in named):
        raise ValueError("serialized_named_tensors must hold (name, tensor) pairs")
    return named


@dataclass(frozen=True)
class PackInto:
    """An MXFP4 expert weight (its codes and scales) that a trainer sends as floats under the
    weight's own name (`...w1.weight`): packed on arrival, as `--quantization mxfp4` packs."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:  # the float weight's
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 2)


def update_views(model: Any) -> dict[str, Any]:
    """Name -> destination of every tensor an update may carry: checkpoint names (MXFP4
    experts also by their float names: PackInto), or those of transformers' module a trainer
    holds in memory (Kimi Linear only: transformers has no K3 model)."""
    views = model.checkpoint_tensors()
    for name in [n for n in views if n.endswith(".weight_packed")]:
        base = name.removesuffix("_packed")
        codes, scales = views[name], views.get(base + "_scale")
        if isinstance(codes, torch.Tensor) and isinstance(scales, torch.Tensor):  # not TP
            views[base] = PackInto(codes, scales)
    if model.config.tensor_prefix:
        return views
    return {**views, **model.transformers_tensors()}


def check_update(model: Any, named: list[tuple[str, torch.Tensor]],
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs after checking every name, shape and dtype."""
    from kdaserve.models.loader import canonical_name

    views = update_views(model)
    pairs, seen = [], set()
    for name, tensor in named:
        name = canonical_name(name)
        dest = views.get(name)
        if dest is None:
            raise ValueError(f"unknown tensor name {name!r} (expected checkpoint or "
                             f"transformers names such as {next(iter(views))!r})")
        if name in seen:
            raise ValueError(f"tensor {name!r} given twice")
        seen.add(name)
        if isinstance(dest, PackInto):
            if tuple(tensor.shape) != dest.shape or not tensor.is_floating_point():
                raise ValueError(f"tensor {name!r} ({tensor.dtype} {list(tensor.shape)}) is "
                                 f"packed to MXFP4 from a float {list(dest.shape)}")
            codes, scales = quantize_mxfp4(tensor)
            pairs += [(dest.codes, codes), (dest.scales, scales)]
            continue
        if isinstance(dest, Prefix):
            dest = dest.stored_as(tensor.shape)  # any stored length, as loading
        if tuple(tensor.shape) != full_shape(dest):
            raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, expected "
                             f"{list(full_shape(dest))}")
        stored = tensor_of(dest).dtype
        packed = stored == torch.uint8  # MXFP4 codes or scales: sent as they are stored
        if (tensor.dtype == torch.uint8) != packed or not (packed or tensor.is_floating_point()):
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, expected "
                             f"{'uint8 (MXFP4)' if packed else 'a float dtype'}")
        pairs.append((dest.dest, dest.take(tensor)) if isinstance(dest, Shard)
                     else (dest, tensor))
    return pairs


@torch.no_grad()
def apply(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dest, src in pairs:
        dest.copy_(src)


def update_from_disk(model: Any, config: Any, path: Path) -> None:
    """Same architecture (config), every tensor present with its shape and bytes, then
    loaded."""
    import dataclasses

    from kdaserve.config import ModelConfig

    if not Path(path).is_dir():
        raise ValueError(f"model_path {str(path)!r} is not a checkpoint folder")
    new = ModelConfig.from_pretrained(Path(path))
    # what the weights' shapes and the forward depend on; not the on-disk dtype or the special
    # token ids a retrained checkpoint may change
    ignore = {"checkpoint_dtype", "bos_token_id", "eos_token_ids", "pad_token_id", "extra"}
    diff = [f.name for f in dataclasses.fields(config) if f.name not in ignore
            and getattr(config, f.name) != getattr(new, f.name)]
    if diff:
        raise ValueError(f"checkpoint {path} has another architecture (differs in "
                         f"{', '.join(diff[:5])})")
    check_weights(model, Path(path))
    load_weights(model, Path(path))


Spec = tuple[str, torch.dtype, list[int]]


def broadcast_specs(names: list[str], dtypes: list[str], shapes: list[list[int]],
                    max_numel: int) -> list[Spec]:
    """What a broadcast will carry, all checked before the first tensor is received: equal
    lengths, float dtypes, shapes of at most `max_numel` elements (the model's largest
    tensor: nothing bigger can be a weight, and it bounds what a request makes us allocate)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes must have the same length")
    specs = []
    for name, d, shape in zip(names, dtypes, shapes, strict=True):
        dtype = FLOAT_DTYPES.get(str(d).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"dtype {d!r} is not a float dtype ({', '.join(FLOAT_DTYPES)})")
        dims = [int(x) for x in shape]
        if any(x < 0 for x in dims) or math.prod(dims) > max_numel:
            raise ValueError(f"tensor {name!r}: shape {shape} is no weight of this model")
        specs.append((name, dtype, dims))
    return specs


def receive_distributed(group: Any, specs: list[Spec], device: torch.device,
                        ) -> list[tuple[str, torch.Tensor]]:
    """The tensors rank 0 of `group` (the trainer) broadcasts, in order. Every broadcast is
    received even when a name is wrong (checked after), so the group stays in step with the
    trainer and usable for the next update."""
    import torch.distributed as dist

    out = []
    for name, dtype, dims in specs:
        buf = torch.empty(dims, dtype=dtype, device=device)
        dist.broadcast(buf, src=0, group=group)
        out.append((name, buf))
    return out
