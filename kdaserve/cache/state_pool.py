"""KDA state pool: fixed slots, each holding every KDA layer's recurrent and conv state.

A KDA layer's state is a point value of constant size, so a request needs exactly one slot for
its whole life; kernels update slots in place by index. A slot is zeroed when handed out, so a
reused slot never leaks its previous owner's state.
"""

from __future__ import annotations

import torch

from kdaserve.config import ModelConfig
from kdaserve.kernels import registry


class StatePool:
    """`tp_size`: a tensor-parallel rank holds the states of its 1/tp_size of the heads."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", tp_size: int = 1) -> None:
        L, H, K = len(config.kda_layers), config.kda_num_heads // tp_size, config.kda_head_dim
        self.num_slots = num_slots
        # one slot past the pool, never handed out: a replayed CUDA graph's padding rows run
        # their KDA steps there (engine/cuda_graph.py)
        self.scratch = num_slots
        # recurrent state always fp32 [L, N + 1, H, K, V]; conv state in the model dtype
        # [L, N + 1, W-1, 3P], time-major so a decode step shifts whole rows.
        self.recurrent = torch.zeros(L, num_slots + 1, H, K, K, dtype=torch.float32,
                                     device=device)
        self.conv = torch.zeros(L, num_slots + 1, config.kda_conv_size - 1, 3 * H * K,
                                dtype=dtype, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()
        # when a list: every change made outside a forward, ("zero", slot) / ("copy", src,
        # dst), for tensor-parallel followers to apply to their own heads' pool
        self.log: list[tuple[int | str, ...]] | None = None
        self._copy_slots = registry.resolve("copy_slots", self.recurrent.device)

    def release(self) -> None:
        """Frees the states' memory (RL's release of the KV cache, the pool idle); `resume`
        brings them back zeroed, in the same shapes."""
        self._shapes = (tuple(self.recurrent.shape), tuple(self.conv.shape))
        self.recurrent, self.conv = (torch.empty(0, dtype=t.dtype, device=t.device)
                                     for t in (self.recurrent, self.conv))

    def resume(self) -> None:
        self.recurrent, self.conv = (
            torch.zeros(shape, dtype=t.dtype, device=t.device)
            for shape, t in zip(self._shapes, (self.recurrent, self.conv), strict=True))

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
        L, H, K = len(config.kda_layers), config.kda_num_heads // tp_size, config.kda_head_dim
        conv = (config.kda_conv_size - 1) * 3 * H * K * torch.empty(0, dtype=dtype).element_size()
        return L * (H * K * K * 4 + conv)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, zero: bool = True) -> int:
        """A free slot, zeroed unless the caller overwrites it at once (snapshot copies)."""
        if not self._free:
            raise RuntimeError("state pool exhausted")
        slot = self._free.pop()
        self._used.add(slot)
        if zero:
            self.zero(slot)
        return slot

    def zero(self, slot: int) -> None:
        self.recurrent[:, slot].zero_()
        self.conv[:, slot].zero_()
        if self.log is not None:
            self.log.append(("zero", slot))

    def copy(self, src: int, dst: int) -> None:
        """Every KDA layer's recurrent and conv state of slot src into slot dst."""
        self.recurrent[:, dst].copy_(self.recurrent[:, src])
        self.conv[:, dst].copy_(self.conv[:, src])
        if self.log is not None:
            self.log.append(("copy", src, dst))

    def copy_many(self, pairs: list[tuple[int, int]]) -> None:
        """`copy(src, dst)` for every pair, no slot both a source and a destination: one
        `copy_slots` call per pool tensor (the kernel op the pool resolved at build)."""
        if self.log is not None:  # each copy logged for the other ranks
            for src, dst in pairs:
                self.copy(src, dst)
            return
        self._copy_slots(self.recurrent, pairs)
        self._copy_slots(self.conv, pairs)

    def apply(self, log: list[tuple[int | str, ...]]) -> None:
        """Replays another pool's logged changes on this one (same slots, own heads)."""
        for op in log:
            if op[0] == "zero":
                self.zero(int(op[1]))
            else:
                self.copy(int(op[1]), int(op[2]))

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        assert len(self._free) == len(set(self._free)), "duplicate free slots"
        assert not (set(self._free) & self._used), "slot both free and used"
        assert len(self._free) + len(self._used) == self.num_slots, "slots leaked"
