"""Block drafter in the spirit of DSpark: one forward of a small network proposes a whole block
of K tokens from the target's last hidden state, with per-position confidences from which the
engine's schedule (`speculative/schedule.py`) picks each request's verify length.

Network (`BlockDraftNet`), for a request whose target hidden state at its last computed
position is h [D] and whose pending (sampled, not yet run) token is t:
    x = E[t] + W_in h                                   [H]
    z_i = x + P_i, i < K; z_i += W_down silu(W_up norm(z_i)) per layer
    logits_i = W_out norm(z_i), draft_i = argmax, confidence_i = max softmax_i
The drafts are a deterministic function of the context (point masses), so verification stays
lossless. It has no recurrent state: nothing of the drafter needs rolling back.

Checkpoint: a directory with config.json
    {"architecture": "kdaserve-block-drafter", "vocab_size": V, "hidden_size": H,
     "target_hidden_size": D, "block_size": K, "num_layers": L, "intermediate_size": I,
     "rms_norm_eps": eps}
and model.safetensors with embed.weight [V, H], fc_in.weight [H, D], pos_embed [K, H],
layers.{l}.norm.weight [H], layers.{l}.up.weight [I, H], layers.{l}.down.weight [H, I],
norm.weight [H], lm_head.weight [V, H]. `make_block_drafter` writes a random (seeded) one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kdaserve.config import ModelConfig
from kdaserve.layers.norm import RMSNorm
from kdaserve.request import Request
from kdaserve.speculative.drafter import Drafter
from kdaserve.speculative.token_map import cut_rows

ARCHITECTURE = "kdaserve-block-drafter"


class BlockDraftNet(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        H, V, K = cfg["hidden_size"], cfg["vocab_size"], cfg["block_size"]
        inter, eps = cfg["intermediate_size"], cfg.get("rms_norm_eps", 1e-5)
        self.cfg = cfg
        self.embed = nn.Embedding(V, H)
        self.fc_in = nn.Linear(cfg["target_hidden_size"], H, bias=False)
        self.pos_embed = nn.Parameter(torch.zeros(K, H))
        self.layers = nn.ModuleList(nn.ModuleDict({
            "norm": RMSNorm(H, eps), "up": nn.Linear(H, inter, bias=False),
            "down": nn.Linear(inter, H, bias=False)}) for _ in range(cfg["num_layers"]))
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, V, bias=False)
        # the token ids of lm_head's rows once cut to a hot-token map (speculative/token_map.py)
        self.vocab_ids: torch.Tensor | None = None

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        self.vocab_ids = ids
        cut_rows(self.lm_head, ids)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor,
                positions: int | None = None) -> torch.Tensor:
        """hidden [B, D] (target), tokens [B] pending -> fp32 logits [B, K, V], or of the
        first `positions` positions only (each position is computed on its own)."""
        x = self.embed(tokens) + self.fc_in(hidden.to(self.fc_in.weight.dtype))
        z = x[:, None, :] + self.pos_embed[None, :positions]
        for layer in self.layers:
            z = z + layer["down"](nn.functional.silu(layer["up"](layer["norm"](z))))
        return self.lm_head(self.norm(z)).float()


class BlockDrafter(Drafter):
    wants_hidden = True

    def __init__(self, net: BlockDraftNet, k: int, device: torch.device) -> None:
        self.net, self.device = net, device
        self.k = min(k, net.cfg["block_size"])
        self.hidden: dict[int, torch.Tensor] = {}  # id(req) -> target hidden state [D]
        self._survival: dict[int, list[float]] = {}  # id(req) -> of its last proposal

    @classmethod
    def load(cls, path: Path, target: ModelConfig, k: int, dtype: torch.dtype,
             device: torch.device) -> BlockDrafter:
        cfg = json.loads((Path(path) / "config.json").read_text())
        if cfg.get("architecture") != ARCHITECTURE:
            raise ValueError(f"{path} is not a block drafter (config.json architecture "
                             f"{cfg.get('architecture')!r}, expected {ARCHITECTURE!r})")
        for key, want in (("vocab_size", target.vocab_size),
                          ("target_hidden_size", target.hidden_size)):
            if cfg[key] != want:
                raise ValueError(f"block drafter {path} has {key}={cfg[key]}, the target "
                                 f"model needs {want}")
        with torch.device("meta"):
            net = BlockDraftNet(cfg)
        net.load_state_dict(load_file(Path(path) / "model.safetensors"), assign=True)
        return cls(net.to(device=device, dtype=dtype).eval(), k, device)

    @torch.inference_mode()
    def propose(self, reqs: list[Request]) -> None:
        ready = [r for r in reqs if id(r) in self.hidden]
        self._survival.clear()
        for req in reqs:
            req.draft_ids = []
        if not ready:
            return
        k = max(self.max_draft_tokens(r) for r in ready)
        if k == 0:
            return
        hidden = torch.stack([self.hidden[id(r)] for r in ready])
        tokens = torch.tensor([r.all_ids[-1] for r in ready], device=self.device)
        drafts, conf = self.draft(hidden, tokens, k)
        # a block's drafts survive together: the chance of the first i is the product of
        # their confidences (each the predicted chance of its position given the previous)
        survival = conf.double().cumprod(-1).tolist()
        for req, d, s in zip(ready, drafts.tolist(), survival, strict=True):
            n = self.max_draft_tokens(req)
            req.draft_ids, self._survival[id(req)] = d[:n], s[:n]

    def survival(self, req: Request) -> list[float] | None:
        return self._survival.get(id(req))

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Cuts the network's output heads to the rows of `ids` (a hot-token map): drafts
        are then always among them, and a head costs len(ids) / V of the whole vocabulary's."""
        self.net.restrict_vocab(ids.to(self.device))

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [B, *] and pending tokens [B] -> (drafts [B, k], confidences [B, k]). With
        a token map the confidence is the max over the hot tokens' softmax."""
        conf, drafts = self.net(hidden, tokens, k).softmax(-1).max(-1)
        ids = self.net.vocab_ids
        return (drafts if ids is None else ids[drafts]), conf

    def on_accept(self, req: Request, num_accepted: int,
                  hidden: torch.Tensor | None = None) -> None:
        assert hidden is not None, "the engine passes hidden states to a wants_hidden drafter"
        self.hidden[id(req)] = hidden

    def on_finish(self, req: Request) -> None:
        self.hidden.pop(id(req), None)

    def check_integrity(self, idle: bool = False) -> None:
        assert not (idle and self.hidden), "hidden states of finished requests not released"


def make_block_drafter(out: str | Path, target: ModelConfig, block_size: int = 4,
                       hidden_size: int = 64, num_layers: int = 1, seed: int = 0,
                       logit_scale: float = 6.0) -> Path:
    """Writes a random-weight block drafter for `target`. logit_scale sets the spread of its
    logits, hence of its confidences (random drafts are almost never accepted, but the
    confidence-chosen verify lengths then vary, which is what tests need)."""
    cfg = {"architecture": ARCHITECTURE, "vocab_size": target.vocab_size,
           "hidden_size": hidden_size, "target_hidden_size": target.hidden_size,
           "block_size": block_size, "num_layers": num_layers,
           "intermediate_size": 2 * hidden_size, "rms_norm_eps": 1e-5}
    g = torch.Generator().manual_seed(seed)
    net = BlockDraftNet(cfg)
    tensors = {}
    for name, p in net.state_dict().items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones_like(p)
            continue
        scale = logit_scale if name == "lm_head.weight" else 1.0
        fan_in = p.shape[-1] if name not in ("embed.weight", "pos_embed") else 1
        tensors[name] = torch.randn(p.shape, generator=g) * scale / fan_in ** 0.5
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, out / "model.safetensors")
    return out
