"""`kdaserve train-drafter --format k3-dspark-mla|k3-dspark-gqa|dflash`: K3's published drafter
formats (speculative/context_net.py) distilled from a target, on the target's own text.

1. Data, as `--kind dspark` gathers it (training/drafter.py): the target continues GSM8K train
   prompts greedily (the engine, batched); one plain forward over each prompt + continuation
   gives the taps at every position in the format's stream (`LLM.prefill_taps`) and the
   target's top-16 next-token distribution at every row.
2. A sample is an anchor position P of a continuation, as the engine drafts
   (speculative/context_drafter.py): the context is the taps at positions < P, the block the
   anchor token x[P] then mask tokens at positions P, P + 1, ...; draft j's label is the
   target's greedy token at P + 1 + j (DSpark's row j predicts it, DFlash's row j + 1).
3. Training runs the drafter's own modules (`ContextDraftNet.context`, `block`, the heads),
   with the target's embedding and lm_head frozen: hard and top-16 soft cross-entropy, DSpark's
   Markov head teacher-forced on the labels, its confidence head on whether each draft was
   right. The result is written in the format's released layout (`save_net`).

Held-out acceptance runs the drafter as the engine does (`ContextDraftNet.draft`: the Markov
head fed its own drafts) on continuations of GSM8K test prompts.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from kdaserve.speculative.context_drafter import new_net_config, save_net
from kdaserve.speculative.context_net import ContextDraftNet
from kdaserve.training.data import gsm8k_rows
from kdaserve.training.distill import default_taps, init, log_step, optimize, prompts

log = logging.getLogger("kdaserve")
TOP = 16  # target probabilities kept per position for the soft loss


@dataclass
class Continuation:
    """One prompt + greedy continuation, as the drafter will see it."""

    ids: torch.Tensor  # [T]
    taps: torch.Tensor  # [T, n * D] in the format's stream
    top_ids: torch.Tensor  # [T, TOP] the target's likeliest next tokens at each row
    top_p: torch.Tensor  # [T, TOP] and their probabilities
    first: int  # the first anchor: the prompt's length

    def anchors(self, k: int) -> torch.Tensor:
        """Every anchor whose k labels lie inside the sequence."""
        return torch.arange(self.first, self.ids.numel() - k)


def make_sequences(llm: Any, texts: list[str], taps: tuple[int, ...], stream: str,
                   max_tokens: int) -> list[Continuation]:
    from kdaserve.request import SamplingParams

    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                              ignore_eos=True))
    seqs = []
    for text, out in zip(texts, outs, strict=True):
        prompt = llm.tokenizer.encode(text)
        ids = prompt + list(out.token_ids)
        hidden, tapped = llm.prefill_taps(ids, taps, stream)
        top_p, top_ids = llm.engine.model.compute_logits(hidden).softmax(-1).topk(TOP, -1)
        seqs.append(Continuation(torch.tensor(ids), tapped.float(), top_ids, top_p, len(prompt)))
    return seqs


class Frozen:
    """The target's embedding and lm_head, fp32, outside autograd's parameters."""

    def __init__(self, llm: Any) -> None:
        views = llm.engine.model.checkpoint_tensors()
        prefix = llm.engine.model_config.tensor_prefix
        self.embed = views[prefix + "model.embed_tokens.weight"].detach().float()
        head = views.get(prefix + "lm_head.weight")
        self.head = self.embed if head is None else head.detach().float()

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h.float(), self.head)


@dataclass
class AnchorBatch:
    """A batch of anchors: the drafter's rows and what they are trained towards."""

    h: torch.Tensor  # [M, N, H] final-normed block rows
    anchors: torch.Tensor  # [M] the anchor tokens
    labels: torch.Tensor  # [M, k] the target's greedy tokens after the anchor
    top_ids: torch.Tensor  # [M, k, TOP]
    top_p: torch.Tensor  # [M, k, TOP]


def run_blocks(net: ContextDraftNet, frozen: Frozen, seqs: list[Continuation],
               picks: list[torch.Tensor], k: int) -> AnchorBatch:
    """The drafter over each sequence's anchors `picks[i]`: the context projected once per
    sequence, each anchor's block reading the positions before it."""
    c = net.c
    T = max(s.ids.numel() for s in seqs)
    taps = torch.zeros(len(seqs), T, seqs[0].taps.shape[1])
    for i, s in enumerate(seqs):
        taps[i, :s.ids.numel()] = s.taps
    pos = torch.arange(T)
    ctx = [e.unflatten(0, (len(seqs), T))
           for e in net.context(taps.flatten(0, 1), pos.repeat(len(seqs)))]
    which = torch.cat([torch.full((p.numel(),), i) for i, p in enumerate(picks)])
    at = torch.cat(picks)
    ids = torch.cat([seqs[i].ids[p] for i, p in enumerate(picks)])
    block = torch.full((at.numel(), c.block_size), c.mask_token_id)
    block[:, 0] = ids
    bpos = at[:, None] + torch.arange(c.block_size)
    mask = pos[None, :] < at[:, None]
    h = net.block(F.embedding(block, frozen.embed), bpos, [e[which] for e in ctx], mask)
    rows = at[:, None] + torch.arange(k)  # the target's rows whose next token draft j is
    top_ids = torch.cat([seqs[i].top_ids[r] for i, r in zip(which.tolist(), rows,
                                                            strict=True)]).view(-1, k, TOP)
    top_p = torch.cat([seqs[i].top_p[r] for i, r in zip(which.tolist(), rows,
                                                        strict=True)]).view(-1, k, TOP)
    return AnchorBatch(h, ids, top_ids[..., 0], top_ids, top_p)


def losses(net: ContextDraftNet, frozen: Frozen, b: AnchorBatch, k: int,
           soft: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, teacher-forced drafts [M, k])."""
    rows, logits = net.base_logits(b.h, k, frozen.lm_head)
    prev = torch.cat([b.anchors[:, None], b.labels[:, :-1]], 1)
    if net.c.fmt.dspark:
        logits = net.markov_logits(logits, prev)
    logp = logits.log_softmax(-1)
    loss = F.nll_loss(logp.flatten(0, 1), b.labels.flatten())
    loss = loss - soft * (b.top_p * logp.gather(-1, b.top_ids)).sum(-1).mean()
    drafts = logits.argmax(-1)
    if net.c.confidence:
        loss = loss + F.binary_cross_entropy_with_logits(
            net.confidence_logits(rows, prev), (drafts == b.labels).float())
    return loss, drafts


@torch.no_grad()
def acceptance(net: ContextDraftNet, frozen: Frozen, seqs: list[Continuation],
               k: int) -> dict[str, Any]:
    """Free-running drafts at every anchor of `seqs` against the labels: per position the
    chance a draft is right given every earlier one was, the mean accepted length per verify
    of k drafts (kept drafts + the target's token) and the mean confidence."""
    net.eval()
    alive, conf = [], []
    for s in seqs:
        b = run_blocks(net, frozen, [s], [s.anchors(k)], k)
        drafts, c = net.draft(b.h, b.anchors, k, frozen.lm_head)
        alive.append((drafts == b.labels).float().cumprod(1))
        if c is not None:
            conf.append(c)
    net.train()
    a = torch.cat(alive)
    before = torch.cat([torch.ones_like(a[:, :1]), a[:, :-1]], 1)
    return {"acceptance_length": 1.0 + a.sum(1).mean().item(), "anchors": a.shape[0],
            "conditional_accept_rate": (a.sum(0) / before.sum(0).clamp_min(1)).tolist(),
            "mean_confidence": torch.cat(conf).mean(0).tolist() if conf else None}


def train_context_drafter(args: argparse.Namespace) -> dict[str, Any]:
    from kdaserve.llm import LLM

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    llm = LLM(args.target, disable_prefix_cache=True, max_num_seqs=64)
    target = llm.engine.model_config
    if args.hidden_size not in (None, target.hidden_size):
        raise ValueError(f"--hidden-size {args.hidden_size}: a {args.format} drafter has its "
                         f"target's width ({target.hidden_size}), as it shares its embedding")
    taps = [int(t) for t in args.taps.split(",")] if args.taps else \
        list(default_taps(target.num_hidden_layers))
    c = new_net_config(target, args.format, args.block_size, args.num_layers, taps=taps,
                       markov_rank=args.markov_rank)
    k = c.block_size - c.fmt.first_draft_row
    data = make_sequences(llm, prompts(gsm8k_rows("train", args.data_dir), args.num_prompts,
                                       args.seed), c.taps, c.fmt.tap_stream, args.max_tokens)
    held = make_sequences(llm, prompts(gsm8k_rows("test", args.data_dir), args.eval_prompts,
                                       args.seed), c.taps, c.fmt.tap_stream, args.max_tokens)
    gen_s = time.perf_counter() - t0
    samples = sum(s.anchors(k).numel() for s in data)
    log.info("train-drafter --format %s: %d sequences (%d anchors, +%d held out) in %.0f s",
             args.format, len(data), samples, len(held), gen_s)
    frozen = Frozen(llm)
    net = ContextDraftNet(c)
    init(net, args.seed)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    start = acceptance(net, frozen, held, k)
    per_seq = max(args.batch_size // args.sequences_per_step, 1)
    curve: list[dict[str, float]] = []
    for step in range(args.steps):
        chosen = [data[i] for i in torch.randint(0, len(data), (args.sequences_per_step,),
                                                 generator=gen).tolist()]
        picks = [a[torch.randint(0, a.numel(), (per_seq,), generator=gen)]
                 for a in (s.anchors(k) for s in chosen)]
        b = run_blocks(net, frozen, chosen, picks, k)
        loss, drafts = losses(net, frozen, b, k, args.soft)
        optimize(net, opt, loss, step, args)
        log_step(curve, step, args, loss, drafts[:, 0] == b.labels[:, 0], t0)
    final = acceptance(net, frozen, held, k)
    out = save_net(c, net.state_dict(), args.out)
    result = {"format": args.format, "target": str(args.target), "taps": list(c.taps),
              "block_size": c.block_size, "drafts": k, "args": vars(args) | {"func": None},
              "sequences": len(data), "samples": samples, "held_out_sequences": len(held),
              "data_seconds": gen_s, "seconds": time.perf_counter() - t0,
              "held_out_start": start, "held_out": final, "curve": curve}
    (out / "training.json").write_text(json.dumps(result, indent=2, default=str))
    log.info("held-out acceptance length at %d drafts: %.2f -> %.2f; per position %s", k,
             start["acceptance_length"], final["acceptance_length"],
             " ".join(f"{x:.2f}" for x in final["conditional_accept_rate"]))
    return result
