"""What `train-drafter`'s two trainers share (training/drafter.py, our DSpark and block
drafters; training/context_drafter.py, K3's published formats): the prompts the target
continues, the taps' default layers, the initialisation and the optimisation step."""

from __future__ import annotations

import argparse
import logging
import math
import time

import torch

from kdaserve.training.data import record

log = logging.getLogger("kdaserve")


def prompts(rows: list[dict[str, str]], n: int, seed: int) -> list[str]:
    """One-shot prompts (another record, then a question), as `bench spec` builds them."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(rows), generator=g).tolist()
    out = []
    for i in range(min(n, len(rows) - 1)):
        shot = rows[order[(i + 1) % len(order)]]
        out.append(record(shot) + "Question: " + rows[order[i]]["question"] + "\nAnswer:")
    return out


def optimize(net: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, step: int,
             args: argparse.Namespace) -> None:
    """One step at the schedule's learning rate (50 warm-up steps, then a cosine to 0)."""
    lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()


def log_step(curve: list[dict[str, float]], step: int, args: argparse.Namespace,
             loss: torch.Tensor, first_right: torch.Tensor, t0: float) -> None:
    """Every 50 steps and the last: the loss and how often the first draft was right."""
    if step % 50 == 0 or step == args.steps - 1:
        first = first_right.float().mean().item()
        curve.append({"step": step, "loss": loss.item(), "first_draft_right": first,
                      "seconds": time.perf_counter() - t0})
        log.info("step %d/%d loss %.3f first draft right %.2f", step, args.steps,
                 loss.item(), first)


def default_taps(num_layers: int) -> tuple[int, ...]:
    """Spread over the depth, the last layer included (K3's drafters tap 2/23/47/71/89 of
    93): an early, a middle and the last layer."""
    return tuple(sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1}))


def init(net: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in net.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        elif name in ("pos_embed", "mask_embed") or name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
