"""`kdaserve bench vision`: K3's vision tower on this machine (`k3-bench-vl`: K3's own tower,
27 blocks of width 1024, in front of k3-bench's text model).

1. The tower alone: images per second for 1, 4 and 16 images in one call, ours (fp32, and bf16
   where the host has bf16 matmul units), as FLOP/s and a fraction of this machine's GEMM rate
   in that dtype, measured in the same run; and beside mlx-vlm 0.7.10's on the same weights
   (mlx's CPU backend, fp32) on one small image.
2. Through the engine: time to first token of one request with 1, 4 and 16 images and a short
   question (`max_tokens` 1), and how much of it the tower took.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.nn import functional as F

from kdaserve.bench import write_result
from kdaserve.config import ModelConfig
from kdaserve.image_processor import process
from kdaserve.models.vision import VisionModel, flops, tower_dtype
from kdaserve.vision_config import VisionConfig


def images(n: int, size: int) -> list[Image.Image]:
    g = np.random.RandomState(0)
    return [Image.fromarray(g.randint(0, 256, (size, size, 3), np.uint8)) for _ in range(n)]


def best_of(fn: Any, repeats: int) -> float:
    fn()  # warm-up: first-call allocations, oneDNN's primitive cache
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_rate(c: VisionConfig, dtype: torch.dtype, patches: int = 1024,
              repeats: int = 5) -> float:
    """The best GEMM rate (GFLOP/s) this host shows in `dtype`, over a square 2,048 product
    and the tower's own projections at `patches` rows: the denominator of `gemm_fraction`. (The
    square product alone had measured below the tower's own GEMMs in fp32, 154 against 169
    GFLOP/s for the whole tower, a fraction over 100%.)"""
    d, q, i = c.hidden_size, c.qkv_hidden_size, c.intermediate_size
    best = 0.0
    for m, k, n in ((2048, 2048, 2048), (patches, d, 3 * q), (patches, q, d), (patches, d, i),
                    (patches, i, d)):
        a, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        F.linear(a, w)
        best = max(best, 2 * m * k * n / best_of(lambda a=a, w=w: F.linear(a, w), repeats) / 1e9)
    return best


def mlx_tower(path: Path) -> Any:
    """mlx-vlm's tower and projector from the checkpoint (None without mlx-vlm)."""
    try:
        import mlx.core as mx
        from mlx_vlm.models import kimi_k3
        from mlx_vlm.models.kimi_k3.vision import VisionModel as MlxVision
    except ImportError:
        return None
    cfg = json.loads((path / "config.json").read_text())
    mc = kimi_k3.ModelConfig.from_dict(cfg)
    mc.text_config = kimi_k3.TextConfig.from_dict(cfg["text_config"])
    mc.vision_config = kimi_k3.VisionConfig.from_dict(cfg["vision_config"])
    model = kimi_k3.Model(mc)
    weights: dict[str, Any] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update({k: v.astype(mx.float32) for k, v in mx.load(str(file)).items()
                        if k.startswith(("vision_tower.", "mm_projector."))})
    w = MlxVision(mc.vision_config).sanitize(weights)
    for part in ("vision_tower", "mm_projector"):
        getattr(model, part).load_weights(
            [(k[len(part) + 1:], v) for k, v in w.items() if k.startswith(part + ".")],
            strict=True)

    def run(batch: list[Image.Image]) -> None:  # its processor's time included, as ours
        out = kimi_k3.ImageProcessor()(batch)
        mx.eval(model.mm_projector(model.vision_tower(
            out["pixel_values"].transpose(0, 2, 3, 1), grid_thws=out["grid_thws"])))

    return run


def tower_rows(path: Path, config: ModelConfig, batches: list[int], size: int,
               peer_size: int, repeats: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Ours at `size` for each batch, in fp32 and (where it pays) bf16; ours and mlx-vlm's
    on one image of `peer_size` (its CPU backend takes minutes at `size`)."""
    assert config.vision is not None
    c = config.vision
    peaks = {"float32": gemm_rate(c, torch.float32), "bfloat16": gemm_rate(c, torch.bfloat16)}
    dtypes = [torch.float32]
    if tower_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16:
        dtypes.append(torch.bfloat16)
    rows = []

    def row(impl: str, dtype: str, ims: list[Image.Image], s: float) -> dict[str, Any]:
        work = sum(flops(c, process(im).grid) for im in ims)
        return {"impl": impl, "dtype": dtype, "images": len(ims), "size": ims[0].size[0],
                "s": s, "images_per_s": len(ims) / s, "gflops": work / s / 1e9,
                "gemm_fraction": work / s / 1e9 / peaks[dtype],
                "flops_per_image": work // len(ims)}

    for dtype in dtypes:
        model = VisionModel.load(c, path, dtype, torch.device("cpu"))
        name = str(dtype).removeprefix("torch.")
        for b, px in [(b, size) for b in batches] + [(1, peer_size)]:
            ims = images(b, px)

            def run(m: VisionModel = model, ims: list[Image.Image] = ims) -> None:
                processed = [process(im) for im in ims]  # as mlx-vlm's run: processing too
                m(torch.cat([p.pixels for p in processed]), [p.grid for p in processed])

            rows.append(row("kdaserve", name, ims, best_of(run, repeats)))
        del model
    peer = mlx_tower(path)
    if peer is not None:
        ims = images(1, peer_size)
        rows.append(row("mlx-vlm", "float32", ims, best_of(lambda: peer(ims), 1)))
    for r in rows:
        r["vs_mlx"] = next((p["s"] / r["s"] for p in rows if p["impl"] == "mlx-vlm"
                            and (p["images"], p["size"]) == (r["images"], r["size"])), None)
    return peaks, rows


def ttft_rows(path: Path, batches: list[int], size: int, dtype: str | None,
              repeats: int) -> list[dict[str, Any]]:
    from kdaserve import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_num_batched_tokens=8192)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    vision = llm.engine.vision
    assert vision is not None
    calls: list[float] = []
    forward = vision.forward

    def timed_tower(*a: Any) -> torch.Tensor:  # the tower's share of the TTFT
        t0 = time.perf_counter()
        out = forward(*a)
        calls.append(time.perf_counter() - t0)
        return out

    vision.forward = timed_tower  # type: ignore[method-assign]
    rows = []
    for b in batches:
        ims = images(b, size)
        text = "Compare" + "<|media_pad|>" * b + " and say what differs."
        llm.engine.flush_cache()  # each run computes the whole prompt
        llm.generate([text], params, image_data=[ims])
        best, tower = float("inf"), 0.0
        for _ in range(repeats):
            llm.engine.flush_cache()
            calls.clear()
            t0 = time.perf_counter()
            out = llm.generate([text], params, image_data=[ims])[0]
            s = time.perf_counter() - t0
            if s < best:
                best, tower = s, sum(calls)
        rows.append({"images": b, "prompt_tokens": len(out.prompt_token_ids), "ttft_s": best,
                     "tower_s": tower, "tower_share": tower / best})
    return rows


def main(args: argparse.Namespace) -> None:
    from kdaserve.checkpoint import resolve_model_path

    path = Path(resolve_model_path(args.model))
    config = ModelConfig.from_pretrained(path)
    if config.vision is None:
        raise SystemExit(f"{args.model}: no vision tower (try --model k3-bench-vl)")
    batches = [int(b) for b in args.images.split(",")]
    peaks, tower = tower_rows(path, config, batches, args.size, args.peer_size, args.repeats)
    print(f"GEMM rate here: fp32 {peaks['float32']:.0f}, bf16 {peaks['bfloat16']:.0f} GFLOP/s")
    print(f"{'impl':9} {'dtype':9} {'images':>6} {'pixels':>6} {'GFLOP/img':>9} {'s':>8} "
          f"{'img/s':>7} {'GFLOP/s':>8} {'of GEMM':>8} {'vs mlx':>7}")
    for r in tower:
        vs = f"{r['vs_mlx']:.1f}x" if r["vs_mlx"] else "-"
        print(f"{r['impl']:9} {r['dtype']:9} {r['images']:6} {r['size']:6} "
              f"{r['flops_per_image'] / 1e9:9.1f} {r['s']:8.2f} {r['images_per_s']:7.2f} "
              f"{r['gflops']:8.0f} {r['gemm_fraction']:8.0%} {vs:>7}")
    ttft = ttft_rows(path, batches, args.size, args.dtype, args.repeats)
    print(f"engine ({args.dtype or 'float32'} weights): time to first token")
    for r in ttft:
        print(f"  {r['images']:2} images, {r['prompt_tokens']:5} prompt tokens: "
              f"TTFT {r['ttft_s']:.2f} s, tower {r['tower_s']:.2f} s ({r['tower_share']:.0%})")
    out = write_result(args.out, {"model": args.model, "size": args.size,
                                  "threads": torch.get_num_threads(),
                                  "gemm_gflops_fp32": peaks["float32"],
                                  "gemm_gflops_bf16": peaks["bfloat16"], "tower": tower,
                                  "ttft": ttft})
    print(f"wrote {out}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("vision", help="K3's vision tower: images/s vs mlx-vlm, TTFT by images")
    p.add_argument("--model", default="k3-bench-vl")
    p.add_argument("--images", default="1,4,16", help="images per call / request")
    p.add_argument("--size", type=int, default=448, help="square images of this many pixels")
    p.add_argument("--peer-size", type=int, default=112,
                   help="the image size ours and mlx-vlm's tower are compared at (mlx's CPU "
                        "backend took 96 s for one 224-pixel image here)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                   help="the engine's --dtype for the TTFT runs")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench_results/vision.json")
    p.set_defaults(func=main)
