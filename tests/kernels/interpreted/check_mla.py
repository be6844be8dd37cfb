"""Run by tests/kernels/test_triton_interpreted.py under Triton's interpreter: the paged MLA
attention kernel against `mla_attention_ref` on scattered blocks, mixed decode / verify /
prefill rows, and contexts split in several parts."""

from __future__ import annotations

import pytest
import torch

from kdaserve.kernels.ref.mla import mla_attention_ref
from kdaserve.kernels.triton import mla
from kdaserve.kernels.triton.mla import mla_attention_triton


@pytest.mark.parametrize("new,ctx,H", [
    ([1, 1, 1], [1, 9, 30], 3),  # decodes, one with a single key
    ([1, 4, 7], [5, 18, 40], 2),  # a decode, a verify, a prefill chunk on a cached prefix
    ([3], [3], 20),  # a fresh prompt; more heads than a program's block
    # chunks past VERIFY_MAX_TOKENS (expanded form) beside a decode and a verify (absorbed)
    ([1, 20, 3, 40], [9, 50, 7, 40], 3),
    ([17], [17], 2),  # only a chunk
])
@pytest.mark.parametrize("split_len,programs", [(256, 264), (8, 1), (8, 10 ** 6)],
                         ids=["one-split", "capped", "many-splits"])
@pytest.mark.parametrize("wide", [0, 9], ids=["fitted-table", "graph-wide-table"])
def test_mla_matches_reference(new: list[int], ctx: list[int], H: int, split_len: int,
                               programs: int, wide: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """capped: splits of 8 keys asked for, but the tokens already fill the programs wanted.
    graph-wide-table: the block table has columns past every context (a CUDA graph's static
    table, stale block ids in them), so the splits cover more keys than any token sees."""
    monkeypatch.setattr(mla, "SPLIT_LEN", split_len)
    monkeypatch.setattr(mla, "TARGET_PROGRAMS", programs)
    g = torch.Generator().manual_seed(sum(ctx) + H)
    Dn, Dr, R, Dv, page = 16, 8, 32, 16, 4
    T, B = sum(new), len(new)
    pages = [-(-c // page) for c in ctx]
    num_blocks = sum(pages) + 5
    kv = torch.randn(num_blocks, page, R + Dr, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered pages
    table = torch.randint(0, num_blocks, (B, max(pages) + wide), generator=g)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(perm[used:used + n])
        used += n
    cu = torch.tensor([0] + new).cumsum(0)
    q_nope, q_pe = torch.randn(T, H, Dn, generator=g), torch.randn(T, H, Dr, generator=g)
    w_uk, w_uv = torch.randn(H, Dn, R, generator=g) / 4, torch.randn(H, Dv, R, generator=g)
    args = (q_nope, q_pe, kv, table, cu, torch.tensor(ctx), w_uk, w_uv, 0.2)
    torch.testing.assert_close(mla_attention_triton(*args), mla_attention_ref(*args),
                               atol=2e-5, rtol=2e-5)
