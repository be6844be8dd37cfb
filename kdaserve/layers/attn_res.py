"""K3's Attention Residuals (k3_spec.md 4.2): instead of `h + f(h)`, each layer's attention and
MLP input is a softmax mix over a bank of block sums and the current block's partial sum.

The bank holds the embeddings, then the sum of each finished block of `attn_res_block_size`
layers; what passes from layer to layer is only the partial sum of the current block. Every
row of the bank is one token's own, so the bank lives for one forward (nothing is cached
across steps: a decode step's bank is built from its own token's layer outputs).
"""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.kernels import Kernels
from kdaserve.kernels.ref.attn_res import attn_res_mix_ref
from kdaserve.layers.norm import RMSNorm
from kdaserve.layers.parallel import Destination


class AttnResSite(nn.Module):
    """One mixing site: an RMSNorm weight and a [1, D] projection, whose product is the
    site's one learned query (the norm's scaling folded into it, as the math allows)."""

    def __init__(self, dim: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.proj_weight = nn.Parameter(torch.empty(1, dim))
        self.eps = eps
        self.mix_norm = kernels.attn_res_norm

    def checkpoint_tensors(self, prefix: str) -> dict[str, Destination]:
        """`prefix`: the site's name up to `_norm` / `_proj` (e.g. `...mlp_res`)."""
        return {f"{prefix}_norm.weight": self.norm_weight,
                f"{prefix}_proj.weight": self.proj_weight}

    def forward(self, bank: torch.Tensor, partial: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """bank: [NB, T, D]; partial: [T, D] -> `norm` of the mix [T, D] (every site is
        followed by an RMSNorm: the kernel does both in one pass)."""
        # recomputed each call (D multiplies): an RL weight update then needs no hook
        return self.mix_norm(bank, partial, self.w_eff(), self.eps, norm.weight, norm.eps)

    def mix(self, bank: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """The mix alone, before the norm (a drafter's aggregated tap: a few rows a step)."""
        return attn_res_mix_ref(bank, partial, self.w_eff(), self.eps)

    def w_eff(self) -> torch.Tensor:
        return self.norm_weight.float() * self.proj_weight.float().view(-1)


class Bank:
    """The bank of one forward: a [NB_max, T, D] buffer (NB_max = ceil(layers / block), a
    fixed size a CUDA graph can capture) and how many rows are filled."""

    def __init__(self, num_layers: int, block_size: int, like: torch.Tensor) -> None:
        self.block_size = block_size
        self.rows = like.new_empty(-(-num_layers // block_size), *like.shape)
        self.n = 0

    def filled(self) -> torch.Tensor:
        return self.rows[: self.n]

    def starts_block(self, layer: int) -> bool:
        return layer % self.block_size == 0

    def push(self, partial: torch.Tensor) -> None:
        self.rows[self.n] = partial
        self.n += 1
