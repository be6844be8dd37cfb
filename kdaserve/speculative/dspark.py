"""DSpark drafter (DeepSeek, "Confidence-Scheduled Speculative Decoding with Semi-Autoregressive
Generation"): hidden states tapped from several target layers, a parallel backbone that drafts
a whole block of K tokens in one forward, a light sequential low-rank Markov head for the
dependency between drafted tokens, and a confidence head whose per-position acceptance
predictions choose each request's verify length against the cost of a step
(`speculative/schedule.py`).

Network (`DSparkNet`), for a request whose target residual streams after the tap layers at its
last computed position are h_1..h_n [D each] and whose pending token is t:
    c = W_fc [rms(h_1) w_1 ; ... ; rms(h_n) w_n]                          [H]
    s_0 = c + E[t] + P_0,  s_i = c + M + P_i (i = 1..K)   M: a learned "mask" embedding
    s = L pre-norm transformer layers over the K + 1 positions (attention is bidirectional:
        the block is drafted at once, every position sees every other)
    z_i = norm(s_i), base_i = W_out z_i                        one GEMM for the whole block
    Markov head, sequential over i with p_1 = t, p_i = d_{i-1}:
        m_i = A[p_i] * sigmoid(G z_i)                          [r], r = markov_rank
        logits_i = base_i + B m_i,  d_i = argmax logits_i
    confidence_i = sigmoid(w_c . [z_i ; m_i] + b_c): the predicted chance that d_i is the
        target's token given that d_1..d_{i-1} were (trained on exactly that event)
The Markov head is what fixes a purely parallel drafter's "suffix decay": base_i alone must
guess d_{i-1} to stay consistent with it; the head conditions on the guess actually made, at
the cost of K small [r] x [r, V] products. Drafts are a deterministic function of the context,
so verification stays lossless; the drafter keeps no recurrent state to roll back.

Checkpoint: a directory with config.json
    {"architecture": "kdaserve-dspark", "vocab_size": V, "hidden_size": H,
     "target_hidden_size": D, "taps": [layer, ...], "block_size": K, "num_layers": L,
     "num_heads": nh, "intermediate_size": I, "markov_rank": r, "rms_norm_eps": eps}
and model.safetensors with the parameters of `DSparkNet` under their module names. `taps` are
0-based target layer indices: the residual stream after that decoder layer (before the final
norm). `training/drafter.py` trains one by distillation from the target.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from kdaserve.config import ModelConfig
from kdaserve.kernels import Kernels, silu_mul_ref
from kdaserve.layers.norm import RMSNorm
from kdaserve.speculative.block import BlockDrafter
from kdaserve.speculative.token_map import cut_rows

ARCHITECTURE = "kdaserve-dspark"
Linear = Callable[[torch.Tensor, nn.Linear], torch.Tensor]


def torch_linear(x: torch.Tensor, mod: nn.Linear) -> torch.Tensor:
    return F.linear(x, mod.weight)


def kernel_linear(op: Callable[..., torch.Tensor]) -> Linear:
    """A bias-free projection through the engine's `linear` op (2-D inputs): decode-sized
    row counts take the native weight-streaming kernel, where torch's sgemm would repack the
    whole weight on every call (measured 4x slower for the drafter's LM head)."""
    def lin(x: torch.Tensor, mod: nn.Linear) -> torch.Tensor:
        return op(x.reshape(-1, x.shape[-1]), mod.weight, None).view(*x.shape[:-1], -1)
    return lin


class DraftLayer(nn.Module):
    """Pre-norm transformer layer over the block's K + 1 positions, no mask."""

    def __init__(self, H: int, heads: int, inter: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(H, eps)
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.o = nn.Linear(H, H, bias=False)
        self.mlp_norm = RMSNorm(H, eps)
        self.gate_up = nn.Linear(H, 2 * inter, bias=False)
        self.down = nn.Linear(inter, H, bias=False)
        self.silu_mul: Callable[[torch.Tensor], torch.Tensor] = silu_mul_ref  # or the kernel

    def forward(self, s: torch.Tensor, lin: Linear) -> torch.Tensor:
        B, N, H = s.shape
        q, k, v = lin(self.attn_norm(s), self.qkv).view(B, N, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))
        s = s + lin(a.transpose(1, 2).reshape(B, N, H), self.o)
        return s + lin(self.silu_mul(lin(self.mlp_norm(s), self.gate_up)), self.down)


class DSparkNet(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        H, V, K, D = cfg["hidden_size"], cfg["vocab_size"], cfg["block_size"], \
            cfg["target_hidden_size"]
        n, r, eps = len(cfg["taps"]), cfg["markov_rank"], cfg.get("rms_norm_eps", 1e-5)
        self.cfg, self.eps = cfg, eps
        self.tap_norm = nn.Parameter(torch.ones(n, D))  # each tap RMS-normed on its own
        self.fc = nn.Linear(n * D, H, bias=False)
        self.embed = nn.Embedding(V, H)
        self.mask_embed = nn.Parameter(torch.zeros(H))
        self.pos_embed = nn.Parameter(torch.zeros(K + 1, H))
        self.layers = nn.ModuleList(DraftLayer(H, cfg["num_heads"], cfg["intermediate_size"],
                                               eps) for _ in range(cfg["num_layers"]))
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.markov_embed = nn.Embedding(V, r)
        self.markov_gate = nn.Linear(H, r, bias=False)
        self.markov_out = nn.Linear(r, V, bias=False)
        self.confidence = nn.Linear(H + r, 1)
        # how projections run: torch's for training, the engine's `linear` op when serving
        self.lin: Linear = torch_linear
        # the token ids of the output heads' rows when they are cut to a hot-token map
        # (speculative/token_map.py); the Markov embedding keeps the whole vocabulary
        self.vocab_ids: torch.Tensor | None = None

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Cuts both output heads (the base logits and the Markov head's) to `ids`' rows."""
        self.vocab_ids = ids
        for head in (self.lm_head, self.markov_out):
            cut_rows(head, ids)

    def backbone(self, taps: torch.Tensor, tokens: torch.Tensor,
                 positions: int | None = None) -> torch.Tensor:
        """taps [B, n*D] (tap layers' rows, concatenated), tokens [B] pending -> z [B, K, H];
        with `positions`, z [B, positions, H] from a block cut to its first positions."""
        B, n = taps.shape[0], self.tap_norm.shape[0]
        t = taps.view(B, n, -1).to(self.fc.weight.dtype)
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps) * self.tap_norm
        c = self.lin(t.flatten(1), self.fc)
        K = self.pos_embed.shape[0] - 1 if positions is None else positions
        s = torch.cat([(c + self.embed(tokens))[:, None],
                       (c[:, None] + self.mask_embed).expand(B, K, -1)], dim=1) \
            + self.pos_embed[:K + 1]
        for layer in self.layers:
            s = layer(s, self.lin)
        return self.norm(s[:, 1:])

    def markov(self, z: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The Markov feature m for positions z [..., H] whose previous tokens are prev [...]."""
        return self.markov_embed(prev) * torch.sigmoid(self.lin(z, self.markov_gate))

    def confidence_logit(self, z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        # trained on the drafts' correctness without moving the features that make them
        return self.confidence(torch.cat([z.detach(), m.detach()], -1)).squeeze(-1)

    def forward(self, taps: torch.Tensor, tokens: torch.Tensor,
                prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced (training): prev [B, K] the true previous token of each position ->
        (fp32 logits [B, K, V], confidence logits [B, K])."""
        z = self.backbone(taps, tokens)
        m = self.markov(z, prev)
        return (self.lin(z, self.lm_head) + self.lin(m, self.markov_out)).float(), \
            self.confidence_logit(z, m)

    def draft(self, taps: torch.Tensor, tokens: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first k positions of the block: (drafts [B, k], confidences [B, k]). Everything
        that does not depend on the previous draft (base logits, the Markov gates, the
        confidence head's z part) runs once for the block; the sequential part per position
        is a gather, a [r] x [r, V] product and an argmax.

        The backbone runs on the block cut to its first k positions (k + 1 rows a request,
        not K + 1). Attention in the block is bidirectional, so the drafts could differ from
        the whole block's, but the positions past k are mask embeddings that carry nothing
        the first ones lack: measured on the GSM8K target, 32 prompts x 128 tokens, accepted
        length whole / cut at k = 1, 2, 3, 4: 1.828 / 1.821, 2.500 / 2.491, 3.073 / 3.052,
        3.478 / 3.479. At batch 16 and k = 2 the pass runs 48 rows instead of 128."""
        z = self.backbone(taps, tokens, k)
        base = self.lin(z, self.lm_head).float()  # the parallel part: one GEMM for the block
        gate = torch.sigmoid(self.lin(z, self.markov_gate))  # [B, k, r]
        H = z.shape[-1]
        w = self.confidence.weight[0]
        conf_z = z @ w[:H] + self.confidence.bias  # [B, k]
        prev, drafts, ms = tokens, [], []
        for i in range(k):
            m = self.markov_embed(prev) * gate[:, i]
            prev = (base[:, i] + self.lin(m, self.markov_out).float()).argmax(-1)
            if self.vocab_ids is not None:
                prev = self.vocab_ids[prev]
            drafts.append(prev)
            ms.append(m)
        conf = torch.stack(ms, 1) @ w[H:] + conf_z  # the m part of the confidence, at once
        return torch.stack(drafts, 1), torch.sigmoid(conf.float())


def load_config(path: Path, target: ModelConfig) -> dict[str, Any]:
    """config.json of a DSpark drafter, checked against the target it will serve."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{path} has no config.json: not a DSpark drafter")
    cfg = json.loads(f.read_text())
    if cfg.get("architecture") != ARCHITECTURE:
        raise ValueError(f"{path} is not a DSpark drafter (config.json architecture "
                         f"{cfg.get('architecture')!r}, expected {ARCHITECTURE!r})")
    for key, want in (("vocab_size", target.vocab_size),
                      ("target_hidden_size", target.hidden_size)):
        if cfg.get(key) != want:
            raise ValueError(f"DSpark drafter {path} has {key}={cfg.get(key)}, the target "
                             f"model needs {want}")
    taps = cfg.get("taps")
    if not isinstance(taps, list) or not taps or any(
            not isinstance(t, int) or not 0 <= t < target.num_hidden_layers for t in taps):
        raise ValueError(f"DSpark drafter {path} taps {taps!r}: need target layer indices in "
                         f"[0, {target.num_hidden_layers})")
    if sorted(set(taps)) != taps:
        raise ValueError(f"DSpark drafter {path} taps {taps!r} must be increasing")
    for key in ("hidden_size", "block_size", "num_layers", "num_heads", "intermediate_size",
                "markov_rank"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ValueError(f"DSpark drafter {path}: {key}={cfg.get(key)!r} must be a "
                             "positive integer")
    if cfg["hidden_size"] % cfg["num_heads"]:
        raise ValueError(f"DSpark drafter {path}: hidden_size {cfg['hidden_size']} is not a "
                         f"multiple of num_heads {cfg['num_heads']}")
    return cfg


class DSparkDrafter(BlockDrafter):
    """`BlockDrafter`'s bookkeeping (a row of target states per request, confidence-chosen
    verify lengths), with the tapped rows and the DSpark network."""

    def __init__(self, net: DSparkNet, k: int, device: torch.device) -> None:
        super().__init__(net, k, device)  # type: ignore[arg-type]
        self.taps = tuple(net.cfg["taps"])

    @classmethod
    def load(cls, path: Path, target: ModelConfig, k: int, dtype: torch.dtype,
             device: torch.device, kernels: Kernels | None = None) -> DSparkDrafter:
        """kernels: the engine's ops for the projections, norms and SwiGLUs (the drafting
        pass is ~90 small ops a step, so torch's dispatch is a large part of its cost);
        without them, plain torch."""
        cfg = load_config(path, target)
        with torch.device("meta"):
            net = DSparkNet(cfg)
        tensors = load_file(Path(path) / "model.safetensors")
        want = {n: tuple(p.shape) for n, p in net.state_dict().items()}
        got = {n: tuple(t.shape) for n, t in tensors.items()}
        if want != got:
            bad = sorted(set(want) ^ set(got)) or [n for n in want if want[n] != got[n]]
            raise ValueError(f"DSpark drafter {path}: tensors do not match its config.json "
                             f"(first: {bad[0]})")
        net.load_state_dict(tensors, assign=True)
        if kernels is not None:
            net.lin = kernel_linear(kernels.linear)
            for m in net.modules():
                if isinstance(m, RMSNorm):
                    m.op = kernels.rms_norm
                elif isinstance(m, DraftLayer):
                    m.silu_mul = kernels.silu_mul
        return cls(net.to(device=device, dtype=dtype).eval(), k, device)

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net.draft(hidden, tokens, k)  # type: ignore[attr-defined]


def save_drafter(net: DSparkNet, out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in net.state_dict().items()},
              out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(net.cfg, indent=2))  # last: marks completion
    return out


def new_config(target: ModelConfig, taps: list[int], block_size: int = 7,
               hidden_size: int = 256, num_layers: int = 2, num_heads: int = 4,
               markov_rank: int = 64) -> dict[str, Any]:
    return {"architecture": ARCHITECTURE, "vocab_size": target.vocab_size,
            "hidden_size": hidden_size, "target_hidden_size": target.hidden_size,
            "taps": list(taps), "block_size": block_size, "num_layers": num_layers,
            "num_heads": num_heads, "intermediate_size": 2 * hidden_size,
            "markov_rank": markov_rank, "rms_norm_eps": 1e-5}


def make_dspark_drafter(out: str | Path, target: ModelConfig, taps: list[int],
                        block_size: int = 4, hidden_size: int = 64, seed: int = 0) -> Path:
    """Writes a random-weight DSpark drafter for `target` (for tests: its drafts are noise,
    but its confidences vary, so the verify lengths it picks do too)."""
    cfg = new_config(target, taps, block_size, hidden_size, num_layers=1, num_heads=2,
                     markov_rank=16)
    g = torch.Generator().manual_seed(seed)
    net = DSparkNet(cfg)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight") or name == "tap_norm":
            p.data.fill_(1.0)
        else:
            fan_in = p.shape[-1] if p.dim() > 1 and "embed" not in name else 1
            p.data.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    return save_drafter(net, out)
