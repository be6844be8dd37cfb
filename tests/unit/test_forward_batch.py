"""`ForwardBatch.build` packs every field into one host tensor split into views; `owning()`
copies them apart, so a pickled batch (the tensor-parallel broadcast) carries each field's
elements only, not the whole buffer once per field."""

from __future__ import annotations

import pickle

import torch

from kdaserve.forward_batch import METADATA, ForwardBatch


def test_build_fields_and_owning_copies() -> None:
    fb = ForwardBatch.build([[5, 6, 7], [8]], [0, 20], [3, 1], [[4], [0, 1]], 16,
                            num_logits=[1, 1])
    assert fb.input_ids.tolist() == [5, 6, 7, 8]
    assert fb.positions.tolist() == [0, 1, 2, 20]
    assert fb.cu_seqlens.tolist() == [0, 3, 4]
    assert fb.context_lens.tolist() == [3, 21]
    assert fb.state_slots.tolist() == [3, 1]
    assert fb.block_table.tolist() == [[4, 0], [0, 1]]
    assert fb.slot_mapping.tolist() == [64, 65, 66, 20]
    assert fb.logits_indices.tolist() == [2, 3]
    own = fb.owning()
    for name in METADATA:
        assert torch.equal(getattr(own, name), getattr(fb, name))
    big = ForwardBatch.build([list(range(4000))], [0], [0], [list(range(250))], 16)
    assert len(pickle.dumps(big.owning())) * 4 < len(pickle.dumps(big))


def test_decode_rows_pack_as_the_general_case() -> None:
    """Single-token sequences take a shorter path in `build`; their fields must be what the
    general packing gives: mixed with chunks, across block boundaries, with and without a
    logits row (logits_from 0 or 1), and with every row's logits."""
    new = [[9], [5, 6, 7], [8], [4], [3, 2]]
    cached = [15, 0, 16, 33, 7]
    tables = [[2], [4], [0, 1], [5, 6, 7], [3]]
    fb = ForwardBatch.build(new, cached, [0, 1, 2, 3, 4], tables, 16,
                            logits_from=[0, 1, 1, 0, 0])
    assert fb.input_ids.tolist() == [9, 5, 6, 7, 8, 4, 3, 2]
    assert fb.positions.tolist() == [15, 0, 1, 2, 16, 33, 7, 8]
    assert fb.cu_seqlens.tolist() == [0, 1, 4, 5, 6, 8]
    assert fb.context_lens.tolist() == [16, 3, 17, 34, 9]
    assert fb.slot_mapping.tolist() == [47, 64, 65, 66, 16, 113, 55, 56]
    assert fb.logits_indices.tolist() == [0, 2, 3, 5, 6, 7]
    every = ForwardBatch.build(new, cached, [0, 1, 2, 3, 4], tables, 16, all_logits=True)
    assert every.logits_indices.tolist() == list(range(8))
    decode = ForwardBatch.build([[1], [2]], [3, 4], [0, 1], [[0], [1]], 16)
    assert decode.is_decode and decode.logits_indices.tolist() == [0, 1]
