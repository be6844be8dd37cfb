"""The layout a prefill server checks a decode server's pools against, and the spans it
writes: addresses computed from the layout must be exactly the pool rows of the request."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.checkpoint import preset_config
from kdaserve.engine.disaggregation.layout import PoolLayout, PoolTensor, spans


def pools(blocks: int, slots: int, block_size: int = 4) -> tuple[BlockPool, StatePool]:
    mc = preset_config("tiny")
    return BlockPool(mc, blocks, block_size, torch.float32), StatePool(mc, slots, torch.float32)


def test_spans_copy_exactly_the_request_rows() -> None:
    """Applying the spans as memory copies moves the request's blocks of every MLA layer
    and its state slot of every KDA layer, and nothing else."""
    src_b, src_s = pools(10, 3)
    dst_b, dst_s = pools(7, 5)
    for t in (src_b.kv, src_s.recurrent, src_s.conv):
        t.copy_(torch.randn(t.shape))
    src, dst = PoolLayout.of("m", src_b, src_s), PoolLayout.of("m", dst_b, dst_s)
    assert src.mismatch(dst) is None
    blocks_from, blocks_to, slot_from, slot_to = [2, 3, 4, 8], [0, 1, 5, 6], 1, 4
    todo = spans(src, dst, blocks_from, blocks_to, slot_from, slot_to)
    # runs merge: (2,3)->(0,1) one span, 4->5 and 8->6 alone, per MLA layer; + 2 per KDA layer
    assert len(todo) == src_b.kv.shape[0] * 3 + 2 * src_s.recurrent.shape[0]
    flat = {t.data_ptr(): t for t in (src_b.kv, src_s.recurrent, src_s.conv,
                                      dst_b.kv, dst_s.recurrent, dst_s.conv)}

    def view(address: int, n: int) -> torch.Tensor:
        for base, t in flat.items():
            if base <= address < base + t.numel() * 4:
                return t.view(-1)[(address - base) // 4:(address - base + n) // 4]
        raise AssertionError("address outside every pool")

    for s, d, n in todo:
        view(d, n).copy_(view(s, n))
    assert torch.equal(dst_b.kv[:, blocks_to], src_b.kv[:, blocks_from])
    assert torch.equal(dst_s.recurrent[:, slot_to], src_s.recurrent[:, slot_from])
    assert torch.equal(dst_s.conv[:, slot_to], src_s.conv[:, slot_from])
    untouched = [b for b in range(7) if b not in blocks_to]
    assert not dst_b.kv[:, untouched].any() and not dst_s.recurrent[:, [0, 1, 2, 3]].any()


def test_mismatches_are_named() -> None:
    b, s = pools(8, 2)
    here = PoolLayout.of("model-a", b, s)
    assert "model mismatch" in (here.mismatch(dataclasses.replace(here, model="model-b")) or "")
    assert "block size" in (here.mismatch(PoolLayout.of("model-a", *pools(8, 2, 8))) or "")
    bf16 = dataclasses.replace(here, conv=dataclasses.replace(here.conv, dtype="bfloat16"))
    assert "conv dtype" in (here.mismatch(bf16) or "")
    more_layers = dataclasses.replace(here, recurrent=PoolTensor(
        0, (9, *here.recurrent.shape[1:]), "float32"))
    assert "recurrent layout" in (here.mismatch(more_layers) or "")
    # only the number of blocks and slots may differ
    assert here.mismatch(PoolLayout.of("model-a", *pools(3, 9))) is None
    assert PoolLayout.from_dict(here.to_dict()) == here
    with pytest.raises(ValueError, match="malformed"):
        PoolLayout.from_dict({"model": "x"})
    with pytest.raises(ValueError, match="outside"):
        spans(here, here, [0], [8])
