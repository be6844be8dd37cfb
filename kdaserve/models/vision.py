"""Kimi K3's vision tower (MoonViT-3D), its 2x2 merge and projector: images in, rows of the text
model's width out, one per `<|media_pad|>` of the image's prompt (k3_spec.md 8; the details
the spec leaves open as mlx-vlm 0.7.10 and SGLang 0.5.23 implement them).

Per image of t x h x w patches (t = 1: images; h, w even):
- patch embedding: each 3 x 14 x 14 patch, flattened (channel, row, column), times the
  conv weight [D, 3, 14, 14] as one matrix; plus the learned [64, 64, D] position grid resized
  to h x w (bilinear, half-pixel centres, no antialias: `F.interpolate`'s align_corners=False);
- blocks, attention over the image's own patches only: x += wo(attn(rope(q), rope(k), v)) on
  RMSNorm(x) (epsilon 2^-7), x += fc1(gelu_tanh(fc0(RMSNorm(x)))); a final RMSNorm;
- 2-D RoPE on interleaved pairs: pair j turns by column * f_{j/2} (j even) or row * f_{j/2}
  (j odd), f_i = 10000^(-4i / head_dim), positions from 0 in each image;
- sd2_tpool: each 2 x 2 block of patches (row-major blocks) becomes one row
  [r0c0 | r0c1 | r1c0 | r1c1] of 4D;
- patchmergerv2: post_norm(proj.2(gelu(proj.0(row)))), exact GELU, post_norm's epsilon from
  the config (1e-5).

The modules carry the released tensor names under `vision_tower.` / `mm_projector.`; this is
the plain-torch form (the reference beside any faster kernel)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from kdaserve.config import ModelConfig
from kdaserve.kernels import REF_VISION, VisionKernels, resolve_vision_kernels
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.loader import VISION_PREFIXES, checkpoint_files, random_tensor
from kdaserve.vision_config import VISION_NORM_EPS, VisionConfig

ROPE_THETA = 10000.0
MERGE = 2  # sd2_tpool's kernel, each side


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(c.hidden_size, 3, c.patch_size,
                                                    c.patch_size))
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(torch.empty(c.pos_emb_height, c.pos_emb_width,
                                                       c.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, p, p] -> [N, D]"""
        w = self.proj.weight
        return F.linear(pixels.flatten(1).to(w.dtype), w.flatten(1))

    def positions(self, h: int, w: int) -> torch.Tensor:
        """The position grid at h x w patches, row-major [h * w, D]."""
        grid = self.pos_emb.weight
        if (h, w) != tuple(grid.shape[:2]):
            grid = F.interpolate(grid.permute(2, 0, 1)[None].float(), size=(h, w),
                                 mode="bilinear", align_corners=False)[0].permute(1, 2, 0)
        return grid.reshape(h * w, -1).to(self.pos_emb.weight.dtype)


def rope_angles(h: int, w: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """[h * w, head_dim / 2] angles of the pairs: column on even pairs, row on odd ones."""
    freqs = ROPE_THETA ** (-torch.arange(0, head_dim, 4, device=device)[:head_dim // 4]
                           .float() / head_dim)
    rows, cols = torch.meshgrid(torch.arange(h, device=device).float(),
                                torch.arange(w, device=device).float(), indexing="ij")
    return torch.stack([cols.reshape(-1, 1) * freqs, rows.reshape(-1, 1) * freqs],
                       -1).reshape(h * w, head_dim // 2)


class Mlp(nn.Module):
    def __init__(self, d: int, inter: int, ops: VisionKernels) -> None:
        super().__init__()
        self.fc0 = nn.Linear(d, inter, bias=False)
        self.fc1 = nn.Linear(inter, d, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.ops.gelu_tanh(self.fc0(x)))


class Block(nn.Module):
    def __init__(self, c: VisionConfig, ops: VisionKernels) -> None:
        super().__init__()
        self.c = c
        self.ops = ops
        self.norm0 = RMSNorm(c.hidden_size, VISION_NORM_EPS)
        self.wqkv = nn.Linear(c.hidden_size, 3 * c.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(c.qkv_hidden_size, c.hidden_size, bias=False)
        self.norm1 = RMSNorm(c.hidden_size, VISION_NORM_EPS)
        self.mlp = Mlp(c.hidden_size, c.intermediate_size, ops)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                sizes: list[int]) -> torch.Tensor:
        """The patches of several images, x [sum L, D], image after image (`sizes`: each
        one's L); rope: the cos and sin [sum L, head_dim / 2] of their pairs' angles. The
        projections run on all rows at once; attention within each image."""
        c, n, ops = self.c, x.shape[0], self.ops
        q, k, v = self.wqkv(self.norm0(x)).view(n, 3, c.num_heads, c.head_dim).unbind(1)
        q, k = ops.rope_pairs(q, *rope), ops.rope_pairs(k, *rope)
        x = x + self.wo(torch.cat([ops.image_attention(*part) for part in zip(
            q.split(sizes), k.split(sizes), v.split(sizes), strict=True)]).view(n, -1))
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, c: VisionConfig, ops: VisionKernels) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(c, ops) for _ in range(c.num_layers))
        self.final_layernorm = RMSNorm(c.hidden_size, VISION_NORM_EPS)


class VisionTower(nn.Module):
    def __init__(self, c: VisionConfig, ops: VisionKernels) -> None:
        super().__init__()
        self.c = c
        self.patch_embed = PatchEmbed(c)
        self.encoder = Encoder(c, ops)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [sum t h w, 3, p, p] of the images in `grids` (t, h, w) -> merged rows
        [sum h w / 4, 4D], image after image."""
        for t, h, w in grids:
            if t != 1 or h % MERGE or w % MERGE:
                raise ValueError(f"an image grid of (t, h, w) = {(t, h, w)} patches: images "
                                 "only (t = 1), with an even number of patches each side")
        sizes = [h * w for _, h, w in grids]
        x = self.patch_embed(pixels) + torch.cat([self.patch_embed.positions(h, w)
                                                  for _, h, w in grids])
        angles = torch.cat([rope_angles(h, w, self.c.head_dim, x.device) for _, h, w in grids])
        rope = (angles.cos(), angles.sin())  # once for every block's q and k
        for block in self.encoder.blocks:
            x = block(x, rope, sizes)
        x = self.encoder.final_layernorm(x)
        return torch.cat([xi.view(h // MERGE, MERGE, w // MERGE, MERGE, -1)
                          .permute(0, 2, 1, 3, 4).reshape(h * w // MERGE ** 2, -1)
                          for xi, (_, h, w) in zip(x.split(sizes), grids, strict=True)])


class Projector(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        d = MERGE * MERGE * c.mm_hidden_size
        self.proj = nn.Sequential(nn.Linear(d, d, bias=False), nn.GELU(),
                                  nn.Linear(d, c.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(c.text_hidden_size, c.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x))


# the most patches one pass through the blocks takes (one larger image goes alone): its MLP's
# activations are this x 4,096 values (256 MiB in fp32), whatever a request sends
CALL_PATCHES = 16384


def tower_calls(grids: list[tuple[int, int, int]], per_image: bool = False,
                ) -> list[tuple[int, int]]:
    """The images [i, j) of each tower call, in order: as many as fit CALL_PATCHES, or each
    alone with `per_image` (deterministic inference: an image's rows then depend on nothing
    else, so a prefix-cache hit on it holds the same bits as computing it)."""
    calls: list[tuple[int, int]] = []
    start, patches = 0, 0
    for i, (t, h, w) in enumerate(grids):
        if i > start and (per_image or patches + t * h * w > CALL_PATCHES):
            calls.append((start, i))
            start, patches = i, 0
        patches += t * h * w
    if grids:
        calls.append((start, len(grids)))
    return calls


class VisionModel(nn.Module):
    """Tower + projector: `forward(pixels, grids)` gives each image's rows for its pads."""

    def __init__(self, c: VisionConfig, ops: VisionKernels = REF_VISION) -> None:
        super().__init__()
        self.config = c
        self.vision_tower = VisionTower(c, ops)
        self.mm_projector = Projector(c)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.mm_projector(self.vision_tower(pixels, grids))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Released tensor name -> parameter."""
        return dict(self.named_parameters())

    @classmethod
    def load(cls, c: VisionConfig, path: Path, dtype: torch.dtype, device: torch.device,
             backend: str | None = None) -> VisionModel:
        """The tower and projector of the checkpoint at `path`: every tensor under
        `vision_tower.` / `mm_projector.` checked (known, right shape, none missing); its
        kernels the registry's choice for `device` (or `backend`'s)."""
        with torch.device("meta"):
            model = cls(c, resolve_vision_kernels(device, backend))
        model.to_empty(device=device)
        views = model.checkpoint_tensors()
        seen: set[str] = set()
        for file in checkpoint_files(Path(path)):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if not name.startswith(VISION_PREFIXES):
                        continue
                    if name not in views:
                        raise ValueError(f"unexpected vision tensor {name!r} in {file.name}")
                    t = f.get_tensor(name)
                    if tuple(t.shape) != tuple(views[name].shape):
                        raise ValueError(f"vision tensor {name!r} has shape {list(t.shape)}, "
                                         f"expected {list(views[name].shape)}")
                    with torch.no_grad():
                        views[name].copy_(t)
                    seen.add(name)
        missing = sorted(set(views) - seen)
        if missing:
            raise ValueError(f"{path}: the vision tower misses {len(missing)} tensors "
                             f"(first: {missing[0]})")
        return model.to(dtype).eval().requires_grad_(False)


def tower_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the tower computes in: bf16 where bf16 weights are asked for and the matmuls have
    bf16 units (an accelerator, or a CPU with AVX512-BF16 or AMX, which oneDNN uses: 1.65x
    fp32 on a 448-pixel image on a Zen 4), fp32 elsewhere (a CPU without them runs bf16
    matmuls far slower than fp32). Unlike the text model's weight-only bf16 on a CPU, the
    tower's activations are bf16 too, as GPU engines run it: it is GEMM-bound throughout."""
    if weight_dtype != torch.bfloat16:
        return weight_dtype
    if device.type != "cpu":
        return weight_dtype
    from kdaserve.kernels.native.isa import cpu_flags, host_level

    return weight_dtype if host_level(cpu_flags()) in ("avx512_bf16", "amx") else torch.float32


def flops(c: VisionConfig, grid: tuple[int, int, int]) -> int:
    """Multiply-add FLOPs (2 each) of one image through the tower and projector: patch
    embedding, each block's projections, MLP and attention (scores and values over the
    image's own patches), the projector on the merged rows; norms and activations left out."""
    t, h, w = grid
    n, d, q = t * h * w, c.hidden_size, c.qkv_hidden_size
    block = 2 * n * (d * 3 * q + q * d + 2 * d * c.intermediate_size) + 4 * n * n * q
    merged, wide = n // MERGE ** 2, MERGE ** 2 * c.hidden_size
    return (2 * n * 3 * c.patch_size ** 2 * d + c.num_layers * block
            + 2 * merged * (wide * wide + wide * c.text_hidden_size))


def load_vision(config: ModelConfig, path: Path, load_format: str, seed: int,
                dtype: torch.dtype, device: torch.device,
                backend: str | None = None) -> VisionModel | None:
    """The checkpoint's vision tower, if it declares one: read from `path`, or with
    load_format "dummy" the random values `make-checkpoint` would write."""
    if config.vision is None:
        return None
    if load_format != "dummy":
        return VisionModel.load(config.vision, path, dtype, device, backend)
    with torch.device(device):
        model = VisionModel(config.vision, resolve_vision_kernels(device, backend))
    with torch.no_grad():
        for name, p in model.checkpoint_tensors().items():
            p.copy_(random_tensor(name, tuple(p.shape), seed))
    return model.to(dtype).eval().requires_grad_(False)
