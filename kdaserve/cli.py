"""The `kdaserve` command line (also `python -m kdaserve`): serve, generate, bench, ..."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _generate(args: argparse.Namespace) -> None:
    from kdaserve.llm import LLM
    from kdaserve.request import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format)
    print(f"[kdaserve] loaded {llm.path} in {time.perf_counter() - t0:.1f}s "
          f"({sum(p.numel() for p in llm.model.parameters()) / 1e6:.0f}M parameters, "
          f"{llm.dtype}, {llm.device})", file=sys.stderr)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    out = llm.generate([args.prompt], sampling_params=params)[0]
    dt = time.perf_counter() - t0
    print(args.prompt + (out.text or ""))
    print(f"[kdaserve] {len(out.token_ids)} tokens in {dt:.2f}s "
          f"({len(out.token_ids) / dt:.1f} tok/s), finish_reason={out.finish_reason}",
          file=sys.stderr)


def _make_checkpoint(args: argparse.Namespace) -> None:
    from kdaserve.checkpoint import make_checkpoint

    extra = tuple(t for t in (args.extra_special_tokens or "").split(",") if t)
    path = make_checkpoint(args.out, args.preset, seed=args.seed, dtype=args.dtype,
                           num_shards=args.shards, with_tokenizer=not args.no_tokenizer,
                           tokenizer=args.tokenizer, extra_special_tokens=extra,
                           chat_template=args.chat_template, expert_format=args.expert_format)
    print(f"wrote random-weight '{args.preset}' checkpoint to {path}")


def _make_block_drafter(args: argparse.Namespace) -> None:
    from kdaserve.checkpoint import resolve_model_path
    from kdaserve.config import ModelConfig
    from kdaserve.speculative.block import make_block_drafter

    target = ModelConfig.from_pretrained(resolve_model_path(args.target))
    if args.format == "block":
        path = make_block_drafter(args.out, target, block_size=args.block_size or 4,
                                  hidden_size=args.hidden_size or 64,
                                  num_layers=args.num_layers, seed=args.seed)
    else:  # one of K3's published formats: the target's width (shared embedding, lm_head)
        from kdaserve.speculative.context_drafter import make_context_drafter

        if args.hidden_size not in (None, target.hidden_size):
            raise SystemExit(f"--hidden-size: a {args.format} drafter has the target's "
                             f"width ({target.hidden_size})")
        path = make_context_drafter(args.out, target, args.format, seed=args.seed,
                                    block_size=args.block_size, num_layers=args.num_layers)
    print(f"wrote a random-weight {args.format} drafter for {args.target} to {path}")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[kdaserve] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(prog="kdaserve")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from one prompt")
    g.add_argument("--model", default="bench", help="checkpoint folder or preset name")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.set_defaults(func=_generate)

    from kdaserve.checkpoint import PRESETS

    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint")
    m.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    m.add_argument("--shards", type=int, default=1)
    m.add_argument("--no-tokenizer", action="store_true")
    m.add_argument("--tokenizer", default=None,
                   help="tokenizer folder to ship (e.g. the real Kimi tokenizer); the model's "
                        "vocabulary and special ids follow it")
    m.add_argument("--extra-special-tokens", default=None,
                   help="comma-separated special tokens given free reserved ids, e.g. K3's "
                        "'<|open|>,<|sep|>,<|close|>,<|end_of_msg|>'")
    m.add_argument("--chat-template", default=None, help="Jinja chat template file to include")
    m.add_argument("--expert-format", default=None, choices=["mxfp4"],
                   help="mxfp4: the routed experts packed as Kimi K3 ships them")
    m.set_defaults(func=_make_checkpoint)

    d = sub.add_parser("make-block-drafter",
                       help="write a random-weight block drafter: ours (speculative_algorithm "
                            "block) or one of K3's published formats (dspark, dflash)")
    d.add_argument("--target", default="bench", help="target checkpoint folder or preset")
    d.add_argument("--out", required=True)
    d.add_argument("--format", default="block",
                   choices=["block", "k3-dspark-mla", "k3-dspark-gqa", "dflash"])
    d.add_argument("--block-size", type=int, default=None,
                   help="the block's rows (block: 4; DSpark: 7; DFlash: 8)")
    d.add_argument("--hidden-size", type=int, default=None,
                   help="block: 64 unless set; the K3 formats take the target's")
    d.add_argument("--num-layers", type=int, default=1)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_make_block_drafter)

    b = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = b.add_subparsers(dest="bench", required=True)
    from kdaserve.bench import (
        accuracy,
        disaggregation,
        grammar,
        gsm8k,
        kernels,
        prefix_cache,
        report,
        scoring,
        serving,
        soak,
        spec,
        throughput,
        vision,
        weight_sync,
    )

    gsm8k.add_parser(bench_sub)
    grammar.add_parser(bench_sub)
    throughput.add_parser(bench_sub)
    kernels.add_parser(bench_sub)
    vision.add_parser(bench_sub)
    prefix_cache.add_parser(bench_sub)
    serving.add_parser(bench_sub)
    spec.add_parser(bench_sub)
    scoring.add_parser(bench_sub)
    soak.add_parser(bench_sub)
    weight_sync.add_parser(bench_sub)
    disaggregation.add_parser(bench_sub)
    accuracy.add_parser(bench_sub)
    report.add_parser(bench_sub)
    from kdaserve.training import drafter as train_drafter
    from kdaserve.training import lm as train_lm
    from kdaserve.training import token_map

    train_lm.add_parser(sub)
    train_drafter.add_parser(sub)
    token_map.add_parser(sub)
    from kdaserve.server import launch

    launch.add_parser(sub)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"kdaserve: error: {e}\n")


if __name__ == "__main__":
    main()
