"""`kdaserve token-map`: a hot-token map (speculative/token_map.py) for a target, from the
frequencies of its tokenizer's tokens over GSM8K train text, the text the trained target
imitates (the drafts it accepts are its own greedy tokens, which stay close to it)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kdaserve.speculative.token_map import hot_tokens, save_token_map
from kdaserve.tokenizer import Tokenizer
from kdaserve.training.data import gsm8k_rows, record


def main(args: argparse.Namespace) -> None:
    from kdaserve.training.lm import trained_model

    target = Path(args.model) if args.model else trained_model("target")
    if args.size < 1:
        raise ValueError("--size must be >= 1")
    tok = Tokenizer.from_pretrained(target)
    rows = gsm8k_rows("train", args.data_dir)
    ids, covered = hot_tokens((tok.encode(record(r)) for r in rows), args.size)
    out = save_token_map(ids, args.out or Path(f"{target}.token_map.pt"))
    print(f"wrote {out}: {len(ids)} tokens covering {covered:.2%} of GSM8K train's tokens")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("token-map", help="hot-token map for a block/dspark drafter's head")
    p.add_argument("--model", default=None, help="target (default: train-lm's trained target)")
    p.add_argument("--size", type=int, default=1024, help="tokens kept")
    p.add_argument("--data-dir", default=None, help="folder with GSM8K train.jsonl")
    p.add_argument("--out", default=None, help="a .pt or .json path (default: TARGET.token_map.pt)")
    p.set_defaults(func=main)
