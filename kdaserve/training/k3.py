"""The model `train-lm --arch k3` trains: kdaserve's own K3 text model on its plain-torch
reference kernels, under autograd.

transformers has no K3 model, and mlx-lm's (the K3 oracle) would need its weights mapped back
to the released names; kdaserve's model already maps every released tensor name to the
parameter it fills (`checkpoint_tensors`), and its reference kernels (kernels/ref: chunked KDA,
MLA attention, the routed experts) are plain torch, so one forward over full sequences on
fresh caches differentiates as it is. The skeleton written by `make-checkpoint` is loaded by
the real loader, trained, and written back under the same names, dtypes and shapes: the
result is a checkpoint in K3's released layout that the engine (and mlx-lm) load like any
other.

The router's `e_score_correction_bias` selects experts but carries no gradient; it is trained
as DeepSeek-V3 trains it (auxiliary-loss-free balancing): after each step, each MoE layer's
bias moves by BALANCE_RATE towards the experts that were picked less than their share.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import ModelConfig
from kdaserve.forward_batch import ForwardBatch
from kdaserve.kernels import resolve_kernels
from kdaserve.kernels.registry import use_backend
from kdaserve.layers.moe import MoE
from kdaserve.layers.parallel import Shard, tensor_of
from kdaserve.models.loader import build_model, checkpoint_files

BALANCE_RATE = 1e-3  # DeepSeek-V3's bias update speed
BLOCK = 16  # MLA cache block size of the training forward's private pools
CPU = torch.device("cpu")


class K3Trainee:
    """A K3 checkpoint's text model with gradients: `loss` / `logits` over [B, T] windows
    (each row a sequence from position 0), `balance` after an optimizer step, `save`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = ModelConfig.from_pretrained(path)
        if not self.config.tensor_prefix:
            raise ValueError(f"{path} is not a K3 checkpoint")
        with use_backend("ref"):  # differentiable: plain torch throughout
            kernels = resolve_kernels(CPU, features=self.config.kernel_features)
        self.model = build_model(self.config, kernels, torch.float32, CPU, path)
        self.biases = [m.e_score_correction_bias for m in self.model.modules()
                       if isinstance(m, MoE)]
        self.model.requires_grad_(True)
        for b in self.biases:
            b.requires_grad_(False)
        self.model.train()

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def logits(self, x: torch.Tensor,
               routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """fp32 logits [B, T, vocab] of windows x [B, T], each on fresh caches; `routing`
        (a list) gets each MoE layer's chosen experts [B * T, k]."""
        B, T = x.shape
        c = self.config
        states = StatePool(c, B, torch.float32, CPU)
        blocks = BlockPool(c, B * -(-T // BLOCK), BLOCK, torch.float32, CPU)
        batch = ForwardBatch.build(x.tolist(), [0] * B, [states.allocate() for _ in range(B)],
                                   [blocks.allocate(-(-T // BLOCK)) for _ in range(B)], BLOCK,
                                   all_logits=True)
        batch.routing = routing
        return self.model.forward(batch, states, blocks).view(B, T, -1)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the windows; the step's routing is kept for
        `balance`."""
        self.routing: list[torch.Tensor] = []
        logits = self.logits(x, self.routing)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 x[:, 1:].flatten())

    @torch.no_grad()
    def balance(self) -> None:
        """Each MoE layer's bias up for experts picked below their share, down above it."""
        for bias, chosen in zip(self.biases, self.routing, strict=True):
            load = torch.bincount(chosen.flatten(), minlength=bias.numel()).float()
            bias += BALANCE_RATE * torch.sign(load.mean() - load)

    @torch.no_grad()
    def save(self, out: Path) -> None:
        """The trained values under the skeleton's names, dtypes and shapes (a tensor the
        model uses a prefix of, K3's longer A_log, keeps the rest of what was stored)."""
        out.mkdir(parents=True, exist_ok=True)
        views = self.model.checkpoint_tensors()
        for file in checkpoint_files(self.path):
            tensors = load_file(str(file))
            for name, stored in tensors.items():
                dest = views[name]
                assert dest is not None, "a single-process model holds every tensor"
                value = tensor_of(dest).detach()
                if isinstance(dest, Shard):
                    dest.take(stored).copy_(value)
                else:
                    stored.copy_(value)
            save_file(tensors, str(out / file.name), metadata={"format": "pt"})
