"""MLA prefill on a CPU (kernels/cpu/mla.py) against the absorbed-form reference over the
paged latent cache: chunks that start a sequence, chunks after cached context (the flash
form's two blocks merged by log-sum-exp), empty sequences, value widths above and below the
query-key width; each form forced, and the per-sequence choice."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.cpu import mla
from kdaserve.kernels.ref.mla import mla_attention_ref

# new tokens / cached tokens incl. them, per sequence: a first chunk, chunks after context
# (one a single token), an empty sequence, a long first chunk
NEWS, CTXS = [20, 7, 0, 1, 33, 60], [20, 50, 12, 70, 90, 60]


def case(H: int, Dn: int, Dr: int, Dv: int, R: int):
    g = torch.Generator().manual_seed(H + Dv)
    BS, NB = 16, 64
    kv = torch.randn(NB, BS, R + Dr, generator=g)
    perm = torch.randperm(NB, generator=g)
    table = torch.stack([perm[i * 8:(i + 1) * 8] for i in range(len(NEWS))])
    cu = torch.tensor([0, *torch.tensor(NEWS).cumsum(0).tolist()])
    T = sum(NEWS)
    q_nope, q_pe = torch.randn(T, H, Dn, generator=g), torch.randn(T, H, Dr, generator=g)
    w = torch.randn(H, Dn + Dv, R, generator=g) * 0.1
    return q_nope, q_pe, kv, table, cu, torch.tensor(CTXS), w[:, :Dn], w[:, Dn:], 0.1


@pytest.mark.parametrize("form", ["flash", "absorbed", "chosen"])
@pytest.mark.parametrize(("H", "Dn", "Dr", "Dv", "R"), [(4, 32, 16, 64, 64),
                                                        (3, 64, 32, 64, 128)])
def test_mla_prefill_matches_reference(form: str, H: int, Dn: int, Dr: int, Dv: int, R: int,
                                       monkeypatch) -> None:
    args = case(H, Dn, Dr, Dv, R)
    chosen: list[bool] = []
    cost_model = mla.flash_pays

    def pays(*shape: int) -> bool:
        chosen.append(cost_model(*shape) if form == "chosen" else form == "flash")
        return chosen[-1]

    monkeypatch.setattr(mla, "flash_pays", pays)
    got = mla.mla_prefill_cpu(*args)
    torch.testing.assert_close(got, mla_attention_ref(*args), atol=2e-5, rtol=1e-5)
    assert len(chosen) == sum(n > 0 for n in NEWS)
    if form == "chosen":  # the long first chunk expands, the single token stays absorbed
        assert chosen[-1] and not chosen[3]


def test_flash_pays_at_bench_shapes() -> None:
    """The choice where it was measured (`bench` MLA shapes, one thread team): a 2,048-token
    prompt 4x faster in the flash form, 8 x 256 first chunks 1.3x, 64 tokens after 1,000
    twice as slow."""
    shape = (6, 128, 64, 128, 256)  # H, Dn, Dr, Dv, R
    assert mla.flash_pays(2048, 2048, *shape)
    assert mla.flash_pays(256, 256, *shape)
    assert not mla.flash_pays(64, 1000, *shape)
    assert not mla.flash_pays(1, 1000, *shape)


def test_mla_prefill_keeps_the_query_dtype() -> None:
    q_nope, q_pe, kv, table, cu, lens, w_uk, w_uv, scale = case(4, 32, 16, 64, 64)
    args = (q_nope.bfloat16(), q_pe.bfloat16(), kv.bfloat16(), table, cu, lens,
            w_uk.bfloat16(), w_uv.bfloat16(), scale)
    got = mla.mla_prefill_cpu(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, mla_attention_ref(*args), atol=2e-2, rtol=2e-2)
