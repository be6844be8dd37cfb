"""`kdaserve serve`: the engine process + the HTTP front end (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
from typing import Any

from kdaserve.config import EngineConfig

logger = logging.getLogger("kdaserve")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-num-seqs, --block-size, ...)."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("max_total_tokens", "num_state_slots"):
                kind = int
            p.add_argument(flag, type=kind, default=default)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--reasoning-parser", default=None, choices=[None, "kimi_k2"])
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (default: the checkpoint's, else built-in K2)")
    p.add_argument("--sampling-policy", default=None,
                   help="kimi-k3 or a JSON policy file (default: the checkpoint's "
                        "generation_config.json, else none); see server/sampling_policy.py")
    p.add_argument("--default-max-tokens", type=int, default=4096,
                   help="max_tokens of a chat request that gives none (bounded by the context)")
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> None:
    asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from kdaserve.engine.llm_engine import resolve_model_path
    from kdaserve.server.api import ServerState, create_app
    from kdaserve.server.chat import ChatHandler
    from kdaserve.server.engine_proc import EngineProcess
    from kdaserve.server.metrics import ServerMetrics
    from kdaserve.server.responses import ResponseStore
    from kdaserve.server.sampling_policy import load_policy
    from kdaserve.tokenizer import Tokenizer

    config = engine_config(args)
    # resolve (and for a preset, generate) the checkpoint once, before the engine process
    path = resolve_model_path(config.model)
    config = dataclasses.replace(config, model=str(path))
    if args.default_max_tokens < 1:
        raise ValueError("--default-max-tokens must be >= 1")
    # --skip-tokenizer-init: token ids in and out (/generate input_ids), as SGLang; RL
    # trainers tokenize themselves, and a checkpoint may come without tokenizer files
    tokenizer = chat = None
    if not config.skip_tokenizer_init:
        tokenizer = Tokenizer.from_pretrained(path)
        chat = ChatHandler.from_pretrained(path, tokenizer, args.reasoning_parser,
                                           args.chat_template,
                                           load_policy(args.sampling_policy, path),
                                           args.default_max_tokens)
    engine = EngineProcess(config)
    await engine.start()
    try:
        name = args.served_model_name or str(args.model)
        state = ServerState(
            client=engine, tokenizer=tokenizer, model_name=name, model_path=str(path),
            max_request_tokens=engine.info["max_request_tokens"], metrics=ServerMetrics(),
            chat=chat, api_key=args.api_key, responses=ResponseStore(),
            server_args={k: v for k, v in vars(args).items()
                         if isinstance(v, str | int | float | bool | None) and k != "api_key"})
        app = create_app(state)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level="warning", timeout_keep_alive=30))
        # Our own SIGINT/SIGTERM handling: uvicorn's re-raises the signal after its shutdown,
        # which would kill us before the engine process is stopped cleanly.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        print(f"[kdaserve] model {path}: {engine.info['summary']}", flush=True)
        if chat is None:
            print("[kdaserve] no tokenizer (--skip-tokenizer-init): token ids in and out",
                  flush=True)
        else:
            policy = chat.policy.name if chat.policy else "none"
            print(f"[kdaserve] chat template {chat.template.origin} ({chat.format.name}); "
                  f"sampling policy {policy}", flush=True)
        print(f"[kdaserve] serving {name} at http://{args.host}:{args.port} "
              f"(OpenAI API at http://{args.host}:{args.port}/v1)", flush=True)
        await server.serve()
    finally:
        await engine.shutdown()
        print("[kdaserve] shut down", flush=True)
