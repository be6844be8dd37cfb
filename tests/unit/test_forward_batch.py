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
