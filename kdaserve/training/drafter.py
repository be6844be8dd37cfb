"""`kdaserve train-drafter`: block drafters distilled from a target, on the target's own text.

1. Data: the target continues GSM8K train prompts greedily (the engine, batched), then one
   plain forward over each prompt + continuation gives, at every position, the tapped residual
   streams, the final-normed hidden state and the target's next-token distribution.
2. A sample is an anchor position p of the continuation: the drafter sees the target's rows
   at p and the pending token x[p+1], and must draft the target's greedy tokens
   x[p+2..p+1+K] (the labels are the target's argmax there, which is what greedy
   verification accepts; its top-16 distribution adds a soft term, the distillation).
3. DSpark (`--kind dspark`) trains drafts teacher-forced through its Markov head, plus its
   confidence head on whether each draft was right; `--kind block` trains the older
   final-hidden-only block drafter on the same samples, for comparison.

Trained on its target's greedy text, acceptance measured here (held-out continuations of
GSM8K test prompts) is what greedy speculative decoding will see; `training.json` beside the
weights keeps it, per block position.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from kdaserve.speculative.context_net import FORMATS
from kdaserve.training.data import gsm8k_rows
from kdaserve.training.distill import default_taps, init, log_step, optimize, prompts

log = logging.getLogger("kdaserve")
TOP = 16  # target probabilities kept per position for the soft loss


@dataclass
class Samples:
    taps: torch.Tensor  # [N, n*D] tapped rows at the anchor
    hidden: torch.Tensor  # [N, D] final-normed row at the anchor (the block drafter's input)
    tokens: torch.Tensor  # [N] pending token x[p+1]
    labels: torch.Tensor  # [N, K] target greedy tokens x[p+2..p+1+K]
    top_ids: torch.Tensor  # [N, K, TOP] target's most likely tokens there
    top_p: torch.Tensor  # [N, K, TOP] and their probabilities

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, idx: torch.Tensor) -> Samples:
        return Samples(*(t[idx] for t in (self.taps, self.hidden, self.tokens, self.labels,
                                          self.top_ids, self.top_p)))


def make_samples(llm: Any, texts: list[str], taps: tuple[int, ...], block: int,
                 max_tokens: int) -> Samples:
    """The target's greedy continuations of `texts`, turned into anchor samples."""
    from kdaserve.request import SamplingParams

    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                              ignore_eos=True))
    parts: list[list[torch.Tensor]] = [[] for _ in range(6)]
    for text, out in zip(texts, outs, strict=True):
        prompt = llm.tokenizer.encode(text)
        ids = prompt + list(out.token_ids)
        hidden, tapped = llm.prefill_taps(ids, taps)
        logits = llm.engine.model.compute_logits(hidden)
        top_p, top_ids = logits.softmax(-1).topk(TOP, dim=-1)
        greedy = top_ids[:, 0]
        P, T = len(prompt), len(ids)
        # anchor p: the row whose logits chose x[p+1]; labels are argmax rows p+1..p+K
        anchors = torch.arange(P - 1, T - block)  # the last: labels end at row T - 1
        if anchors.numel() == 0:
            continue
        rows = anchors[:, None] + 1 + torch.arange(block)
        parts[0].append(tapped[anchors])
        parts[1].append(hidden[anchors])
        parts[2].append(torch.tensor(ids)[anchors + 1])
        parts[3].append(greedy[rows])
        parts[4].append(top_ids[rows])
        parts[5].append(top_p[rows])
    return Samples(*(torch.cat(p) for p in parts))


def losses(kind: str, net: torch.nn.Module, s: Samples,
           soft: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, drafts [B, K]) for one batch, teacher-forced on the target's tokens."""
    if kind == "dspark":
        prev = torch.cat([s.tokens[:, None], s.labels[:, :-1]], dim=1)
        logits, conf = net(s.taps, s.tokens, prev)
    else:
        logits, conf = net(s.hidden, s.tokens), None
    logp = logits.log_softmax(-1)
    hard = F.nll_loss(logp.flatten(0, 1), s.labels.flatten())
    soft_loss = -(s.top_p * logp.gather(-1, s.top_ids)).sum(-1).mean()
    loss = hard + soft * soft_loss
    drafts = logits.argmax(-1)
    if conf is not None:
        loss = loss + F.binary_cross_entropy_with_logits(conf, (drafts == s.labels).float())
    return loss, drafts


@torch.no_grad()
def acceptance(kind: str, net: torch.nn.Module, s: Samples, k: int) -> dict[str, Any]:
    """Free-running drafts (the Markov head fed its own drafts) against the labels: per
    position the chance a draft is right given every earlier one was, and the mean
    accepted length per verify of all k drafts (accepted drafts + the target's token)."""
    net.eval()
    if kind == "dspark":
        drafts, conf = net.draft(s.taps, s.tokens, k)
    else:
        logits = net(s.hidden, s.tokens)[:, :k]
        conf, drafts = logits.softmax(-1).max(-1)
    right = (drafts == s.labels[:, :k]).float()
    alive = right.cumprod(1)  # every draft up to here right
    before = torch.cat([torch.ones_like(alive[:, :1]), alive[:, :-1]], 1)
    per_pos = (alive.sum(0) / before.sum(0).clamp_min(1)).tolist()
    net.train()
    return {"acceptance_length": 1.0 + alive.sum(1).mean().item(),
            "conditional_accept_rate": per_pos,
            "mean_confidence": conf.float().mean(0).tolist()}


def train_drafter(args: argparse.Namespace) -> dict[str, Any]:
    from kdaserve.llm import LLM
    from kdaserve.speculative.block import BlockDraftNet, make_block_drafter
    from kdaserve.speculative.dspark import DSparkNet, new_config, save_drafter

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    llm = LLM(args.target, disable_prefix_cache=True, max_num_seqs=64)
    cfg = llm.engine.model_config
    taps = tuple(int(t) for t in args.taps.split(",")) if args.taps else \
        default_taps(cfg.num_hidden_layers)
    train_rows = gsm8k_rows("train", args.data_dir)
    test_rows = gsm8k_rows("test", args.data_dir)
    data = make_samples(llm, prompts(train_rows, args.num_prompts, args.seed), taps,
                        args.block_size, args.max_tokens)
    held = make_samples(llm, prompts(test_rows, args.eval_prompts, args.seed), taps,
                        args.block_size, args.max_tokens)
    gen_s = time.perf_counter() - t0
    log.info("train-drafter: %d samples (+%d held out) from the target in %.0f s",
             len(data), len(held), gen_s)
    if args.kind == "dspark":
        net: torch.nn.Module = DSparkNet(new_config(
            cfg, list(taps), args.block_size, args.hidden_size, args.num_layers,
            markov_rank=args.markov_rank))
    else:
        tmp = make_block_drafter(Path(args.out), cfg, block_size=args.block_size,
                                 hidden_size=args.hidden_size, num_layers=args.num_layers,
                                 seed=args.seed)
        net = BlockDraftNet(json.loads((tmp / "config.json").read_text()))
    init(net, args.seed)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    start = acceptance(args.kind, net, held, args.block_size)
    curve = []
    for step in range(args.steps):
        batch = data.take(torch.randint(0, len(data), (args.batch_size,), generator=gen))
        loss, drafts = losses(args.kind, net, batch, args.soft)
        optimize(net, opt, loss, step, args)
        log_step(curve, step, args, loss, drafts[:, 0] == batch.labels[:, 0], t0)
    final = acceptance(args.kind, net, held, args.block_size)
    out = Path(args.out)
    if args.kind == "dspark":
        save_drafter(net, out)  # type: ignore[arg-type]
    else:
        from safetensors.torch import save_file
        save_file({n: t.contiguous() for n, t in net.state_dict().items()},
                  out / "model.safetensors")
    result = {"kind": args.kind, "target": str(args.target), "taps": list(taps),
              "args": vars(args) | {"func": None}, "samples": len(data),
              "held_out_samples": len(held), "data_seconds": gen_s,
              "seconds": time.perf_counter() - t0, "held_out_start": start,
              "held_out": final, "curve": curve}
    (out / "training.json").write_text(json.dumps(result, indent=2, default=str))
    log.info("held-out acceptance length at K=%d: %.2f -> %.2f; per position %s",
             args.block_size, start["acceptance_length"], final["acceptance_length"],
             " ".join(f"{x:.2f}" for x in final["conditional_accept_rate"]))
    return result


def main(args: argparse.Namespace) -> None:
    if args.format:  # K3's published formats: training/context_drafter.py
        from kdaserve.training.context_drafter import train_context_drafter

        result = train_context_drafter(args)
        keys: tuple[str, ...] = ("format", "samples", "seconds", "held_out")
    else:
        args.block_size = args.block_size or 7
        args.hidden_size = args.hidden_size or 256
        result = train_drafter(args)
        keys = ("kind", "samples", "seconds", "held_out")
    print(json.dumps({k: result[k] for k in keys}, indent=1))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train-drafter", help="distil a DSpark (or block) drafter from a target")
    p.add_argument("--target", required=True, help="the target checkpoint (train-lm's)")
    p.add_argument("--out", required=True)
    p.add_argument("--kind", default="dspark", choices=["dspark", "block"])
    p.add_argument("--format", default=None, choices=sorted(FORMATS),
                   help="one of K3's published drafter formats (a K3 target; instead of "
                        "--kind)")
    p.add_argument("--taps", default=None, help="target layers, e.g. 1,3,5 (default: spread)")
    p.add_argument("--block-size", type=int, default=None,
                   help="drafts per block (default 7; --format: its block, 7 drafts)")
    p.add_argument("--hidden-size", type=int, default=None,
                   help="default 256 (--format: the target's, which it must be)")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=768)
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--sequences-per-step", type=int, default=16,
                   help="--format: sequences whose contexts a step's anchors share")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--soft", type=float, default=0.5, help="weight of the top-16 soft loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.set_defaults(func=main)
