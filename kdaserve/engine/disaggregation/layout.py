"""What a prefill server ships to a decode server, described once per pool.

A request's caches are its MLA latent blocks (one contiguous item per MLA layer and block in
`BlockPool.kv` [L, blocks, block_size, latent]) and its KDA state slot (one contiguous item
per KDA layer in `StatePool.recurrent` [L, slots, H, K, V] and `StatePool.conv`
[L, slots, W-1, 3P]). A `PoolLayout` names each pool tensor's address, shape and dtype and
the model it belongs to; the decode side sends its layout with every reservation, and the
prefill side checks it against its own before writing a byte (a dtype or layout mismatch
would corrupt silently).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.layers.parallel import tensor_of
from kdaserve.models.kimi_linear import KimiLinearForCausalLM


@dataclass(frozen=True, slots=True)
class PoolTensor:
    address: int
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, t: torch.Tensor) -> PoolTensor:
        assert t.is_contiguous(), "a pool tensor is registered whole: it must be contiguous"
        return cls(t.data_ptr(), tuple(t.shape), str(t.dtype).removeprefix("torch."))

    @property
    def item_bytes(self) -> int:
        """Bytes of one [layer, index] item (a block or a slot of one layer)."""
        n = 1
        for d in self.shape[2:]:
            n *= d
        return n * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.item_bytes

    def item(self, layer: int, index: int) -> int:
        return self.address + (layer * self.shape[1] + index) * self.item_bytes


@dataclass(frozen=True, slots=True)
class PoolLayout:
    model: str  # model_fingerprint(): config and weights
    block_size: int
    kv: PoolTensor
    recurrent: PoolTensor
    conv: PoolTensor

    @classmethod
    def of(cls, model: str, blocks: BlockPool, states: StatePool) -> PoolLayout:
        return cls(model, blocks.block_size, PoolTensor.of(blocks.kv),
                   PoolTensor.of(states.recurrent), PoolTensor.of(states.conv))

    def tensors(self) -> tuple[PoolTensor, PoolTensor, PoolTensor]:
        return self.kv, self.recurrent, self.conv

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolLayout:
        try:
            return cls(str(d["model"]), int(d["block_size"]),
                       *(PoolTensor(int(d[k]["address"]), tuple(int(x) for x in d[k]["shape"]),
                                    str(d[k]["dtype"])) for k in ("kv", "recurrent", "conv")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed pool layout: {e!r}") from None

    def mismatch(self, peer: PoolLayout) -> str | None:
        """Why peer's pools cannot receive ours (None if they can): same model, block size,
        layer counts, per-item shapes and dtypes; only the number of blocks and slots may
        differ."""
        if peer.model != self.model:
            return (f"model mismatch: the peer serves {peer.model[:12]}…, this server "
                    f"{self.model[:12]}… (another checkpoint, config or weights)")
        if peer.block_size != self.block_size:
            return f"block size mismatch: peer {peer.block_size}, here {self.block_size}"
        for name in ("kv", "recurrent", "conv"):
            a, b = getattr(self, name), getattr(peer, name)
            if a.dtype != b.dtype:
                return f"{name} dtype mismatch: peer {b.dtype}, here {a.dtype}"
            if a.shape[0] != b.shape[0] or a.shape[2:] != b.shape[2:]:
                return (f"{name} layout mismatch: peer [layers, n, ...] = {list(b.shape)}, "
                        f"here {list(a.shape)}")
        return None


def model_fingerprint(config: dict[str, Any], model: KimiLinearForCausalLM) -> str:
    """Identifies a model by its config and a sample of every checkpoint tensor (64 values
    each, by the checkpoint's names): two servers with the same fingerprint compute the same
    caches for the same prompt, whatever layout their kernels keep the weights in (the
    triton backend's shared expert stacked with the routed ones, say)."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, dest in sorted(model.checkpoint_tensors().items()):
        if dest is None:  # another rank's expert
            continue
        h.update(name.encode())
        h.update(tensor_of(dest).detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()


def spans(src: PoolLayout, dst: PoolLayout, src_blocks: list[int], dst_blocks: list[int],
          src_slot: int | None = None, dst_slot: int | None = None
          ) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) for the given blocks of every MLA layer
    (runs of consecutive blocks on both sides merged into one span) and, with slots, every
    KDA layer's recurrent and conv state."""
    assert len(src_blocks) == len(dst_blocks)
    out: list[tuple[int, int, int]] = []
    item = src.kv.item_bytes
    runs: list[tuple[int, int, int]] = []  # (src block, dst block, count)
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        # (the last row of a pool is its scratch row, never a request's)
        if not 0 <= d < dst.kv.shape[1] - 1:
            raise ValueError(f"destination block {d} outside the peer's {dst.kv.shape[1] - 1}")
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    for layer in range(src.kv.shape[0]):
        for s, d, n in runs:
            out.append((src.kv.item(layer, s), dst.kv.item(layer, d), n * item))
    if src_slot is not None and dst_slot is not None:
        for name in ("recurrent", "conv"):
            a, b = getattr(src, name), getattr(dst, name)
            if not 0 <= dst_slot < b.shape[1] - 1:
                raise ValueError(f"destination slot {dst_slot} outside the peer's "
                                 f"{b.shape[1] - 1}")
            for layer in range(a.shape[0]):
                out.append((a.item(layer, src_slot), b.item(layer, dst_slot), a.item_bytes))
    return out
