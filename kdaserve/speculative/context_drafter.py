"""The drafter for K3's published block drafters (`context_net.py`): loaded by path from their
config.json and tensors, with a context cache per request.

The target taps every position it commits (prefill chunks, the accepted part of a verify:
`Drafter.context_stream`), and `on_context` turns those rows into the drafter's per-layer
cache entries at once: GQA keys and values, or MLA's normed latent and roped k_pe. The entries
are paged in the target's KV blocks (`context_pages.py`), so a prefix-cache hit brings the
context of the tokens it skips; a position whose taps never came (taps stopped while nothing
drafted, a request that arrived from a prefill server) is masked: drafts stay lossless, only
less often accepted. Verification is greedy against point-mass drafts, as for
every drafter (`speculative/verify.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kdaserve.cache.block_pool import BlockPool
from kdaserve.config import ModelConfig
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.kimi_linear import KimiLinearForCausalLM
from kdaserve.request import Request
from kdaserve.speculative.context_net import (
    BY_ARCHITECTURE,
    FORMATS,
    ContextDraftNet,
    DrafterFormat,
    NetConfig,
    Proj,
    Rope,
    config_dict,
    random_weights,
)
from kdaserve.speculative.context_pages import ContextPages
from kdaserve.speculative.draft_graph import DraftGraphs
from kdaserve.speculative.drafter import Drafter

# what the target shares with its drafter: skipped where a checkpoint holds a copy
SHARED = ("embed_tokens.", "lm_head.")


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    """A key from dflash_config (SGLang's place for it), else the top level."""
    inner = cfg.get("dflash_config") or {}
    return inner.get(key, cfg.get(key, default))


def read_config(cfg: dict[str, Any], target: ModelConfig, where: str = "drafter") -> NetConfig:
    """A published drafter's config.json, checked against the target; what we do not
    implement is refused by name."""
    arch = (cfg.get("architectures") or [None])[0]
    fmt = BY_ARCHITECTURE.get(arch)
    if fmt is None:
        raise ValueError(f"{where}: architectures {cfg.get('architectures')!r} is none of "
                         f"{sorted(BY_ARCHITECTURE)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} (only silu)")
    rope = read_rope(cfg, fmt, where)
    for key in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor",
                "attention_bias", "sliding_window", "final_logit_softcapping"):
        if cfg.get(key):
            raise ValueError(f"{where}: {key}={cfg[key]!r} is not implemented")
    if any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise ValueError(f"{where}: layer_types {cfg['layer_types']!r} (only full_attention)")
    if fmt.attention == "gqa" and cfg.get("rope_is_neox_style", True) is False:
        raise ValueError(f"{where}: interleaved RoPE for GQA layers is not implemented")
    if fmt.dspark and cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise ValueError(f"{where}: markov_head_type {cfg['markov_head_type']!r} (only vanilla)")
    taps = _get(cfg, "target_layer_ids")
    H, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if not isinstance(taps, list) or not taps or not isinstance(H, int) or not heads:
        raise ValueError(f"{where}: needs target_layer_ids, hidden_size, num_attention_heads")
    c = NetConfig(
        fmt=fmt, hidden_size=H, target_hidden_size=cfg.get("target_hidden_size", H),
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        intermediate_size=cfg["intermediate_size"], eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope, block_size=int(_get(cfg, "block_size", 7 if fmt.dspark else 16)),
        mask_token_id=_get(cfg, "mask_token_id"), taps=tuple(taps),
        vocab_size=cfg.get("vocab_size", target.vocab_size),
        markov_rank=cfg.get("markov_rank", 0),
        confidence=bool(cfg.get("enable_confidence_head")),
        logit_scale=float(cfg.get("logit_scale", 1.0)),
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim", H // heads),
        q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg.get("kv_lora_rank") or 0,
        qk_nope_head_dim=cfg.get("qk_nope_head_dim", 0),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim", 0), v_head_dim=cfg.get("v_head_dim", 0))
    _check(c, target, where)
    return c


def read_rope(cfg: dict[str, Any], fmt: DrafterFormat, where: str) -> Rope:
    """The default RoPE, or (MLA, as vLLM's DeepSeek scaling) YaRN; from `rope_parameters`
    or `rope_scaling` (theta defaults: 50000 for Inferact's, 10000 for SGLang's)."""
    kinds = {key: (cfg.get(key) or {}).get("rope_type", (cfg.get(key) or {}).get("type"))
             for key in ("rope_parameters", "rope_scaling")}
    scaled = {k: v for k, v in kinds.items() if v not in (None, "default")}
    r = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(r.get("rope_theta", cfg.get("rope_theta",
                                              50000.0 if fmt.attention == "mla" else 10000.0)))
    if not scaled:
        return Rope(theta)
    key, kind = next(iter(scaled.items()))
    if kind not in ("yarn", "deepseek_yarn") or fmt.attention != "mla":
        raise ValueError(f"{where}: {key} type {kind!r} is not implemented (default RoPE; "
                         "YaRN for MLA drafters)")
    r = cfg[key]
    if "factor" not in r or "original_max_position_embeddings" not in r:
        raise ValueError(f"{where}: YaRN needs factor and original_max_position_embeddings")
    return Rope(theta, float(r["factor"]), int(r["original_max_position_embeddings"]),
                float(r.get("beta_fast") or 32), float(r.get("beta_slow") or 1),
                float(r.get("mscale", 1.0)), float(r.get("mscale_all_dim", 0.0)))


def _check(c: NetConfig, target: ModelConfig, where: str) -> None:
    if c.target_hidden_size != target.hidden_size or c.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: made for hidden {c.target_hidden_size} and vocabulary "
                         f"{c.vocab_size}; the target has {target.hidden_size} and "
                         f"{target.vocab_size}")
    if c.hidden_size != target.hidden_size:  # the block starts from the target's embedding
        raise ValueError(f"{where}: hidden_size {c.hidden_size} is not the target's "
                         f"{target.hidden_size} (its embedding and lm_head are shared)")
    if list(c.taps) != sorted(set(c.taps)) or not all(
            0 <= t < target.num_hidden_layers for t in c.taps):
        raise ValueError(f"{where}: target_layer_ids {list(c.taps)} must increase within the "
                         f"target's {target.num_hidden_layers} layers")
    if not isinstance(c.mask_token_id, int) or not 0 <= c.mask_token_id < target.vocab_size:
        raise ValueError(f"{where}: mask_token_id {c.mask_token_id!r} is not a target token")
    if c.block_size < 1 + c.fmt.first_draft_row:
        raise ValueError(f"{where}: block_size {c.block_size} drafts nothing")
    if c.fmt.dspark and c.markov_rank < 1:
        raise ValueError(f"{where}: a DSpark drafter needs markov_rank >= 1")
    if c.fmt.attention == "mla" and not (c.q_lora_rank and c.kv_lora_rank
                                         and c.qk_rope_head_dim and c.v_head_dim):
        raise ValueError(f"{where}: an MLA drafter needs q_lora_rank, kv_lora_rank, "
                         "qk_rope_head_dim and v_head_dim")
    if c.fmt.attention == "gqa" and c.num_heads % c.num_kv_heads:
        raise ValueError(f"{where}: {c.num_heads} heads over {c.num_kv_heads} KV heads")


def load_net(path: Path, target: ModelConfig, dtype: torch.dtype,
             device: torch.device) -> ContextDraftNet:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{path} has no config.json: not a drafter checkpoint")
    c = read_config(json.loads(f.read_text()), target, str(path))
    with torch.device("meta"):
        net = ContextDraftNet(c)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        for name, t in load_file(file).items():
            name = name.removeprefix("model.")
            if not name.startswith(SHARED):
                tensors[name] = t
    want = {n: tuple(p.shape) for n, p in net.state_dict().items()}
    got = {n: tuple(t.shape) for n, t in tensors.items()}
    if want != got:
        bad = sorted(set(want) ^ set(got)) or sorted(n for n in want if want[n] != got[n])
        raise ValueError(f"{path}: tensors do not match its config.json (first: {bad[0]}: "
                         f"want {want.get(bad[0])}, file {got.get(bad[0])})")
    net.load_state_dict(tensors, assign=True)
    return net.to(device=device, dtype=dtype).eval()


def memory_plan(path: Path, target: ModelConfig, dtype: torch.dtype,
                block_size: int) -> tuple[int, int]:
    """(bytes a KV block's context pages take, bytes of the drafter's own weights) for the
    published drafter at path, before it is loaded: what the engine's memory plan leaves room
    for (engine/pools.py). The shared embedding and lm_head are the target's."""
    c = read_config(json.loads((Path(path) / "config.json").read_text()), target, str(path))
    with torch.device("meta"):
        net = ContextDraftNet(c)
    weights = sum(p.numel() for p in net.parameters()) * dtype.itemsize
    return ContextPages.bytes_per_block(c.cache_width, c.num_layers, dtype, block_size), weights


def new_net_config(target: ModelConfig, fmt: str, block_size: int | None = None,
                   num_layers: int = 1, intermediate_size: int | None = None,
                   taps: list[int] | None = None, markov_rank: int = 16) -> NetConfig:
    """A drafter in a published format for `target`: its width is the target's, as the
    shared embedding and lm_head require; heads of 16 (hidden <= 128) or 64."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown drafter format {fmt!r}; choose from {sorted(FORMATS)}")
    L, H = target.num_hidden_layers, target.hidden_size
    taps = taps or sorted({0, max(L // 2 - 1, 0), L - 1})
    f = FORMATS[fmt]
    heads = 4 if H <= 128 else H // 128
    head_dim = H // heads if H <= 128 else 64
    c = NetConfig(
        fmt=f, hidden_size=H, target_hidden_size=H, num_layers=num_layers, num_heads=heads,
        intermediate_size=intermediate_size or 2 * H, eps=1e-5,
        rope=Rope(50000.0 if f.attention == "mla" else 10000.0),
        block_size=block_size or (7 if f.dspark else 8), mask_token_id=target.vocab_size - 1,
        taps=tuple(taps), vocab_size=target.vocab_size,
        markov_rank=markov_rank if f.dspark else 0, confidence=f.dspark,
        num_kv_heads=max(heads // 2, 1), head_dim=head_dim, q_lora_rank=H // 2,
        kv_lora_rank=H // 2, qk_nope_head_dim=head_dim, qk_rope_head_dim=head_dim // 2,
        v_head_dim=head_dim)
    _check(c, target, "new_net_config")
    return c


def save_net(c: NetConfig, weights: dict[str, torch.Tensor], out: str | Path) -> Path:
    """A drafter's tensors and config.json, as the format's own loaders read them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous() for n, t in weights.items()},
              out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config_dict(c), indent=2))
    return out


def make_context_drafter(out: str | Path, target: ModelConfig, fmt: str, seed: int = 0,
                         block_size: int | None = None, num_layers: int = 1,
                         intermediate_size: int | None = None,
                         taps: list[int] | None = None) -> Path:
    """Writes a random-weight drafter in a published format for `target`, for tests and
    benchmarks."""
    c = new_net_config(target, fmt, block_size, num_layers, intermediate_size, taps)
    return save_net(c, random_weights(ContextDraftNet(c), seed), out)


# A request's taps wait unprojected until it drafts (or this many rows wait: K3's five taps
# are 72 KB a position in bf16, the projected entries 5.8 KB): a request that never drafts
# (its drafts stopped, a batch too large to pay) costs copies, not projections. Measured on
# k3-bench at batch 16 (16 five-shot prompts a wave): projecting every prompt row as it came
# cost 16-31 ms a step.
FLUSH_ROWS = 4096


@dataclass
class Pending:
    """A request's taps not projected yet, as (first position, rows) parts."""

    req: Request
    parts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    num: int = 0


class ContextDrafter(Drafter):
    wants_hidden = True

    def __init__(self, net: ContextDraftNet, target: KimiLinearForCausalLM,
                 device: torch.device, pool: BlockPool) -> None:
        self.net, self.target, self.device = net, target, device
        self.path: Path | None = None  # where `load` read it (RL reloads its weights there)
        self.fmt: DrafterFormat = net.c.fmt
        self.taps = net.c.taps
        self.context_stream = net.c.fmt.tap_stream
        dtype = next(net.parameters()).dtype
        # the projected context, in the target's blocks (context_pages.py)
        self.pages = ContextPages(pool, net.c.cache_width, net.c.num_layers, dtype, device)
        self.pending: dict[int, Pending] = {}  # id(req) -> its taps not projected yet
        # requests that have drafted: their last taps are projected before their blocks go
        # to the prefix cache (one that never drafted leaves its positions empty there)
        self.drafting: set[int] = set()
        self._survival: dict[int, list[float]] = {}
        self.graphs: DraftGraphs | None = None  # the drafting pass's CUDA graphs (a GPU's)
        self.configure(None, None)

    def use_graphs(self, capture: bool = True) -> None:
        """Drafting passes from CUDA graphs (`capture` False: their static-buffer pass run
        eagerly, the CPU tests' check of it)."""
        self.graphs = DraftGraphs(self.net, self.target.embed_tokens, self.target.compute_logits,
                                  self.block_size, self.device, capture)

    @classmethod
    def load(cls, path: Path, target: KimiLinearForCausalLM, dtype: torch.dtype,
             device: torch.device, pool: BlockPool) -> ContextDrafter:
        """The projections and norms run the target's kernels (its `linear` and
        `rms_norm` ops, chosen at its build); the context is paged in `pool`'s blocks."""
        net = load_net(path, target.config, dtype, device)
        for m in net.modules():
            if isinstance(m, Proj):
                m.op = target.kernels.linear
            elif isinstance(m, RMSNorm):
                m.op = target.kernels.rms_norm
        drafter = cls(net, target, device, pool)
        drafter.path = Path(path)
        return drafter

    def configure(self, num_draft_tokens: int | None, dspark_block_size: int | None) -> None:
        """SGLang's meaning of the flags: DSpark's block has gamma rows
        (`dspark_block_size`, else its config's), each a draft, and num_draft_tokens is the
        verify width gamma + 1; DFlash's block is num_draft_tokens rows (else its config's),
        the anchor's then one draft each."""
        if self.fmt.dspark:
            self.block_size = dspark_block_size or self.net.c.block_size
            if num_draft_tokens not in (None, self.block_size + 1):
                raise ValueError(f"speculative_num_draft_tokens={num_draft_tokens}: for DSpark "
                                 f"it is gamma + 1 = {self.block_size + 1} (its block of "
                                 f"{self.block_size} and the anchor)")
        else:
            self.block_size = num_draft_tokens or self.net.c.block_size
            if self.block_size < 2:
                raise ValueError("speculative_num_draft_tokens: DFlash's block needs at least "
                                 "the anchor and one mask")
        self.k = self.block_size - self.fmt.first_draft_row

    def on_context(self, req: Request, rows: torch.Tensor, start: int) -> None:
        p = self.pending.get(id(req))
        if p is None:  # not setdefault: that would build a Pending every tapped step
            p = self.pending[id(req)] = Pending(req)
        p.parts.append((start, rows.clone()))  # not a view that keeps the whole forward's taps
        p.num += rows.shape[0]
        if p.num >= FLUSH_ROWS:
            self.project([p])

    @torch.inference_mode()
    def project(self, waiting: list[Pending]) -> None:
        """Pending taps into context entries in their requests' pages, in one pass for all
        of them (the requests hold the blocks of every pending position)."""
        waiting = [p for p in waiting if p.num]
        if not waiting:
            return
        rows = torch.cat([r for p in waiting for _, r in p.parts])
        pos = torch.cat([torch.arange(s, s + r.shape[0], device=self.device)
                         for p in waiting for s, r in p.parts])
        entries = self.net.context(rows, pos)
        at = 0
        for p in waiting:
            self.pages.write(p.req.block_ids, pos[at:at + p.num],
                             [e[at:at + p.num] for e in entries])
            at += p.num
            p.parts, p.num = [], 0

    @torch.inference_mode()
    def propose(self, reqs: list[Request]) -> None:
        self._survival.clear()
        for req in reqs:
            req.draft_ids = []
        k = max((self.max_draft_tokens(r) for r in reqs), default=0)
        if k == 0:
            return
        self.drafting.update(id(r) for r in reqs)
        self.project([p for p in (self.pending.get(id(r)) for r in reqs) if p is not None])
        read = [self.pages.read(r.block_ids, r.num_computed_tokens) for r in reqs]
        anchor_ids = [r.all_ids[-1] for r in reqs]
        key = None if self.graphs is None else self.graphs.key(
            len(reqs), max(r.num_computed_tokens for r in reqs), k)
        out = None if key is None or self.graphs is None else self.graphs.run(
            key, anchor_ids, [r.num_computed_tokens for r in reqs], read)
        drafts, conf = out if out is not None else self._draft(reqs, read, anchor_ids, k)
        survival = conf.double().cumprod(-1).tolist() if conf is not None else None
        for b, req in enumerate(reqs):
            n = self.max_draft_tokens(req)
            req.draft_ids = drafts[b, :n].tolist()
            if survival is not None:
                self._survival[id(req)] = survival[b][:n]

    def _draft(self, reqs: list[Request], read: list[tuple[list[torch.Tensor], torch.Tensor]],
               anchor_ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafting pass, eagerly: drafts [B, k] and confidences [B, k] (or None)."""
        B, N, S = len(reqs), self.block_size, max(r.num_computed_tokens for r in reqs)
        if B == 1:  # one request: its entries as read, no padded copy
            ctx = [e[None] for e in read[0][0]]
            mask = read[0][1][None]
        else:
            mask = torch.zeros(B, S, dtype=torch.bool, device=self.device)
            ctx = [layer.new_zeros(B, S, *layer.shape[2:]) for layer in self.pages.layers]
            for b, (entries, valid) in enumerate(read):
                for dst, src in zip(ctx, entries, strict=True):
                    dst[b, :src.shape[0]] = src
                mask[b, :valid.shape[0]] = valid
        return self.net.drafting_pass(
            torch.tensor(anchor_ids, device=self.device),
            torch.tensor([r.num_computed_tokens for r in reqs], device=self.device), ctx, mask,
            N, k, self.target.embed_tokens, self.target.compute_logits)

    def survival(self, req: Request) -> list[float] | None:
        return self._survival.get(id(req))

    def on_release(self, req: Request) -> None:
        """req's blocks are about to go (to the prefix cache, or free): a request that has
        drafted projects its last taps into them, for a later turn or its own recompute."""
        p = self.pending.get(id(req))
        if p is not None and id(req) in self.drafting:
            self.project([p])

    def on_finish(self, req: Request) -> None:
        self.pending.pop(id(req), None)
        self.drafting.discard(id(req))

    def release_memory(self, tag: str) -> None:
        if self.graphs is not None:  # they hold the addresses about to be freed
            self.graphs.reset()
        if tag == "kv_cache":
            self.pages.release()
        elif tag == "weights":  # its own; the embedding and lm_head are the target's
            for p in self.net.parameters():
                p.data = p.data.new_empty(0)

    def resume_memory(self, tag: str) -> None:
        if tag == "kv_cache":
            self.pages.resume()
        elif tag == "weights" and self.path is not None:
            p0 = next(self.net.parameters())
            fresh = load_net(self.path, self.target.config, p0.dtype, self.device)
            for p, q in zip(self.net.parameters(), fresh.parameters(), strict=True):
                p.data = q.data

    def check_integrity(self, idle: bool = False) -> None:
        assert not (idle and (self.pending or self.drafting)), \
            "drafter state of finished requests not released"
