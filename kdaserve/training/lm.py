"""`kdaserve train-lm`: a small Kimi Linear or Kimi K3 model trained from scratch on GSM8K
train text, so speculative decoding has a target whose text has structure.

`--arch kimi-linear` trains transformers' `KimiLinearForCausalLM` and saves it with
`save_pretrained`, which writes Moonshot's hub tensor names back. `--arch k3` trains kdaserve's
own K3 model on its reference kernels (training/k3.py: transformers has no K3) and writes it in
K3's released layout. Both: plain torch autograd, fp32, AdamW, cosine schedule; the engine
loads the result with its ordinary loader, like any hub checkpoint. The tokenizer is the preset
one (the first 3840 cl100k ranks + Kimi's 256 specials; K3's special-token layout for K3): a
4096-token vocabulary keeps the LM head, which dominates a model this small, cheap to train.

Sizes: `target` (Kimi Linear: 6 layers, hidden 256, 8 experts top-2, the target of `bench
spec`; K3: 7 layers with AttnRes blocks of 3, hidden 256, 16 experts top-4 on a latent of 128)
and `draft` (2 layers, hidden 128: the `draft` algorithm's small model, same tokenizer). A run
is reproducible from its seed (same steps, same batches, same initialisation); the result is
cached under `~/.cache/kdaserve/gsm8k-{size}-seed{seed}` (`gsm8k-k3-...` for K3) and never
needed by the unit tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdaserve.checkpoint import RANDOM_MARKER, k3_layer_types, make_checkpoint, preset_config
from kdaserve.config import DENSE, KDA, MLA, MOE, ModelConfig
from kdaserve.training.data import gsm8k_rows, tiled, token_stream, windows
from kdaserve.training.k3 import K3Trainee

log = logging.getLogger("kdaserve")
TRAINING_LOG = "training.json"  # beside the weights: config, seed, loss curve, samples
# transformers' torch fallback for chunked KDA builds [C, C, K] decay tensors and inverts
# (I + L) row by row, both ~C work per token: chunks of 8 instead of its default 64 are the
# same math and train 4x faster on a CPU (measured 1800 vs 450 tokens/s at hidden 256)
TRAIN_CHUNK = 8


ARCHS = ("kimi-linear", "k3")


def _model_config(size: str, arch: str = "kimi-linear") -> ModelConfig:
    if arch == "k3":
        return _k3_config(size)
    if size == "target":
        layers = (KDA, KDA, KDA, MLA, KDA, MLA)
        return preset_config(
            "tiny", hidden_size=256, intermediate_size=768, num_hidden_layers=len(layers),
            layer_types=layers, mlp_types=(DENSE,) + (MOE,) * (len(layers) - 1),
            kda_num_heads=4, kda_head_dim=64, num_attention_heads=4, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=64, num_experts=8,
            num_experts_per_token=2, moe_intermediate_size=256)
    if size == "draft":
        return preset_config(
            "tiny", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
            layer_types=(KDA, MLA), mlp_types=(DENSE, MOE), kda_num_heads=2, kda_head_dim=64,
            num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=64, num_experts=4, num_experts_per_token=2, moe_intermediate_size=128)
    raise ValueError(f"unknown size {size!r} (target, draft)")


def _k3_config(size: str) -> ModelConfig:
    """K3's features at train-lm's sizes: AttnRes with a block boundary inside the model,
    LatentMoE, SiTU-GLU, the bounded KDA gate, gated q-LoRA MLA (the k3 presets' fields)."""
    if size == "target":
        n = 7
        return preset_config(
            "k3-tiny", hidden_size=256, intermediate_size=768, num_hidden_layers=n,
            layer_types=k3_layer_types(n), mlp_types=(DENSE,) + (MOE,) * (n - 1),
            kda_num_heads=4, kda_head_dim=64, num_attention_heads=4, q_lora_rank=128,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=64,
            num_experts=16, num_experts_per_token=4, moe_intermediate_size=128,
            routed_expert_hidden_size=128, attn_res_block_size=3)
    if size == "draft":
        return preset_config(
            "k3-tiny", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
            layer_types=(KDA, MLA), mlp_types=(DENSE, MOE), kda_num_heads=2, kda_head_dim=64,
            num_attention_heads=2, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=64, num_experts=4, num_experts_per_token=2,
            moe_intermediate_size=128, routed_expert_hidden_size=64, attn_res_block_size=1)
    raise ValueError(f"unknown size {size!r} (target, draft)")


class HFTrainee:
    """transformers' Kimi Linear in train-lm's loop (training/k3.py's K3Trainee's methods)."""

    def __init__(self, skeleton: Path, seed: int) -> None:
        self.model = _hf_model(skeleton, seed)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, labels=x).loss  # (transformers shifts the labels)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits

    def balance(self) -> None:
        """transformers' Kimi Linear trains no router bias."""

    def save(self, out: Path) -> None:
        self.model.save_pretrained(str(out))


@dataclass(frozen=True)
class TrainArgs:
    arch: str = "kimi-linear"
    size: str = "target"
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    warmup: int = 30
    weight_decay: float = 0.1
    seed: int = 0
    eval_windows: int = 64  # held-out windows of seq_len from GSM8K test
    max_minutes: float | None = None  # a safety stop; the schedule is by steps
    data_dir: str | None = None


def cached_path(size: str, seed: int = 0, arch: str = "kimi-linear") -> Path:
    cache = Path(os.environ.get("KDASERVE_CACHE", Path.home() / ".cache" / "kdaserve"))
    return cache / (f"gsm8k-{size}-seed{seed}" if arch == "kimi-linear"
                    else f"gsm8k-{arch}-{size}-seed{seed}")


def trained_model(size: str = "target", seed: int = 0, arch: str = "kimi-linear") -> Path:
    """The cached trained model; a ValueError says how to make it when it is missing."""
    path = cached_path(size, seed, arch)
    if not (path / TRAINING_LOG).is_file():  # written last: marks a finished run
        raise ValueError(f"no trained {size} model at {path}: run `kdaserve train-lm --arch "
                         f"{arch} --size {size} --seed {seed}` first (~25 min on 2 cores)")
    return path


def _lr(step: int, args: TrainArgs) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _hf_model(skeleton: Path, seed: int) -> torch.nn.Module:
    import transformers
    import transformers.models.kimi_linear.modeling_kimi_linear as hf

    if getattr(hf.chunk_kimi_delta_attention, "func", None) is None:
        hf.chunk_kimi_delta_attention = functools.partial(hf.chunk_kimi_delta_attention,
                                                          chunk_size=TRAIN_CHUNK)
    config = transformers.AutoConfig.from_pretrained(str(skeleton))
    torch.manual_seed(seed)
    return transformers.KimiLinearForCausalLM(config).float()


Trainee = HFTrainee | K3Trainee


@torch.no_grad()
def held_out_loss(trainee: Trainee, data: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over every window of `data` [N, T]."""
    trainee.model.eval()
    total, count = 0.0, 0
    for i in range(0, data.shape[0], batch_size):
        x = data[i:i + batch_size]
        logits = trainee.logits(x)[:, :-1].float()
        total += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    trainee.model.train()
    return total / count


def train_lm(out: str | Path, args: TrainArgs) -> dict[str, Any]:
    """Trains one model, saves it to `out` (hub format + tokenizer + training.json)."""
    from kdaserve.tokenizer import Tokenizer

    out = Path(out)
    skeleton = out.with_name(out.name + ".skeleton")  # config.json and tokenizer files
    shutil.rmtree(skeleton, ignore_errors=True)
    make_checkpoint(skeleton, _model_config(args.size, args.arch), seed=args.seed,
                    dtype="float32")
    tok = Tokenizer.from_pretrained(skeleton)
    train = token_stream(gsm8k_rows("train", args.data_dir), tok.encode)
    test = tiled(token_stream(gsm8k_rows("test", args.data_dir), tok.encode),
                 args.seq_len)[:args.eval_windows]
    trainee = K3Trainee(skeleton) if args.arch == "k3" else HFTrainee(skeleton, args.seed)
    params = trainee.parameters()
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    curve: list[dict[str, float]] = []
    t0 = time.perf_counter()
    initial = held_out_loss(trainee, test, args.batch_size)
    log.info("train-lm %s %s: %.2fM parameters, %d train tokens, held-out loss %.3f at start",
             args.arch, args.size, sum(p.numel() for p in params) / 1e6, train.numel(),
             initial)
    step, running = 0, 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, args)
        x = windows(train, args.seq_len, args.batch_size, gen)
        loss = trainee.loss(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        trainee.balance()
        running = loss.item() if step == 0 else 0.9 * running + 0.1 * loss.item()
        if step % 10 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - t0
            curve.append({"step": step, "loss": loss.item(), "smoothed": running,
                          "seconds": elapsed})
            log.info("step %d/%d loss %.3f (smoothed %.3f) %.0fs", step, args.steps,
                     loss.item(), running, elapsed)
            if args.max_minutes is not None and elapsed > 60 * args.max_minutes:
                log.info("stopping at step %d: --max-minutes %.1f reached", step,
                         args.max_minutes)
                break
    final = held_out_loss(trainee, test, args.batch_size)
    seconds = time.perf_counter() - t0
    # a previous run's output is replaced; anything else at `out` is not ours to delete
    if out.exists() and any(out.iterdir()) and not (out / TRAINING_LOG).is_file():
        raise ValueError(f"{out} is not empty and holds no {TRAINING_LOG}: not replacing it")
    shutil.rmtree(out, ignore_errors=True)
    trainee.save(out)
    for f in skeleton.iterdir():  # the tokenizer (and config) the save did not write
        if not (f.name == RANDOM_MARKER or f.name.endswith(".safetensors")
                or (out / f.name).exists()):
            shutil.copyfile(f, out / f.name)
    shutil.rmtree(skeleton)
    result = {"arch": args.arch, "size": args.size, "args": args.__dict__, "steps_run": step + 1,
              "train_tokens_seen": (step + 1) * args.batch_size * args.seq_len,
              "train_stream_tokens": train.numel(), "seconds": seconds,
              "held_out_loss_start": initial, "held_out_loss": final,
              "held_out_perplexity": math.exp(final), "curve": curve,
              "torch_threads": torch.get_num_threads()}
    result["samples"] = samples(out, args.data_dir)
    (out / TRAINING_LOG).write_text(json.dumps(result, indent=2))  # last: marks completion
    log.info("held-out loss %.3f -> %.3f (perplexity %.1f) in %.0f s; saved %s", initial,
             final, math.exp(final), seconds, out)
    return result


def samples(path: Path, data_dir: str | None, n: int = 3,
            max_tokens: int = 96) -> list[dict[str, str]]:
    """Greedy continuations, by the engine on the saved checkpoint, of GSM8K test
    questions: what the model learned, in the format it learned."""
    from kdaserve.llm import LLM
    from kdaserve.request import SamplingParams

    rows = gsm8k_rows("test", data_dir)[:n]
    prompts = ["Question: " + r["question"] + "\nAnswer:" for r in rows]
    llm = LLM(path, disable_prefix_cache=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [{"prompt": p, "completion": o.text or ""} for p, o in zip(prompts, outs,
                                                                       strict=True)]


def plot_curve(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [c["step"] for c in result["curve"]]
    ax.plot(steps, [c["loss"] for c in result["curve"]], alpha=0.35, label="batch loss")
    ax.plot(steps, [c["smoothed"] for c in result["curve"]], label="smoothed")
    ax.axhline(result["held_out_loss"], color="k", ls="--",
               label=f"held-out {result['held_out_loss']:.2f} "
                     f"(ppl {result['held_out_perplexity']:.1f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"train-lm --arch {result['arch']} --size {result['size']} on GSM8K train")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(ns: argparse.Namespace) -> None:
    args = TrainArgs(arch=ns.arch, size=ns.size, steps=ns.steps, batch_size=ns.batch_size,
                     seq_len=ns.seq_len, lr=ns.lr, seed=ns.seed, max_minutes=ns.max_minutes,
                     data_dir=ns.data_dir, warmup=min(TrainArgs.warmup, max(ns.steps // 10, 1)))
    out = Path(ns.out) if ns.out else cached_path(ns.size, ns.seed, ns.arch)
    result = train_lm(out, args)
    if ns.plot:
        plot_curve(result, Path(ns.plot))
    for s in result["samples"]:
        print(f"--- {s['prompt']}{s['completion']}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train-lm", help="train a small Kimi Linear or K3 model on GSM8K text")
    p.add_argument("--arch", default="kimi-linear", choices=ARCHS)
    p.add_argument("--size", default="target", choices=["target", "draft"])
    p.add_argument("--steps", type=int, default=TrainArgs.steps)
    p.add_argument("--batch-size", type=int, default=TrainArgs.batch_size)
    p.add_argument("--seq-len", type=int, default=TrainArgs.seq_len)
    p.add_argument("--lr", type=float, default=TrainArgs.lr)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=30.0,
                   help="stop early past this (the schedule is by steps: a safety)")
    p.add_argument("--data-dir", default=None, help="folder with GSM8K train/test.jsonl")
    p.add_argument("--out", default=None,
                   help="default: ~/.cache/kdaserve/gsm8k-SIZE-seedN (gsm8k-k3-SIZE-seedN)")
    p.add_argument("--plot", default=None, help="write the loss curve PNG here")
    p.set_defaults(func=main)
