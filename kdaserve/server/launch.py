"""`kdaserve serve`: the engine process + the HTTP front end (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kdaserve.engine_config import EngineConfig
from kdaserve.server.media import MediaLimits, parse_mm_limit
from kdaserve.server.serving import Limits

logger = logging.getLogger("kdaserve")


# SGLang's names for a field, where ours differs
ALIASES = {"speculative_draft_model": ["--speculative-draft-model-path"]}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-num-seqs, --block-size, ...)."""
    for f in dataclasses.fields(EngineConfig):
        flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, [])]
        default = f.default
        if isinstance(default, bool):
            p.add_argument(*flags, action="store_true", default=default)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if default is None:  # `int | None` and the like: the annotation says
                kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            p.add_argument(*flags, type=kind, default=default)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in /v1/models and responses (default: the preset's "
                        "name or the checkpoint folder's); requests may also name its path")
    # SGLang's and vLLM's names; each must be the chat format's own (chat.py)
    p.add_argument("--reasoning-parser", default=None, choices=[None, "kimi_k2", "kimi_k3"])
    p.add_argument("--tool-call-parser", default=None, choices=[None, "kimi_k2", "kimi_k3"])
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (default: the checkpoint's, else built-in K2)")
    p.add_argument("--sampling-policy", default=None,
                   help="kimi-k3 or a JSON policy file (default: the checkpoint's "
                        "generation_config.json, else none); see server/sampling_policy.py")
    p.add_argument("--default-max-tokens", type=int, default=4096,
                   help="max_tokens of a chat request that gives none (bounded by the context)")
    p.add_argument("--context-length", type=int, default=None,
                   help="most tokens (prompt + output) one request may use (default: the KV "
                        "cache's size)")
    p.add_argument("--max-request-body-bytes", type=int, default=Limits.max_body_bytes)
    p.add_argument("--body-read-timeout", type=float, default=Limits.body_read_timeout,
                   help="seconds a client may take between request-body chunks (408)")
    p.add_argument("--header-read-timeout", type=float, default=10.0,
                   help="seconds a client may take to send its request headers (then the "
                        "connection is closed)")
    p.add_argument("--max-queued-requests", type=int, default=Limits.max_queued_requests,
                   help="requests in flight at once; more get 429 with Retry-After")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds from arrival to the last token; then aborted (504)")
    p.add_argument("--watchdog-timeout", type=float, default=Limits.watchdog_timeout,
                   help="/health reports 503 when no engine step ends for this many seconds "
                        "while requests wait")
    p.add_argument("--load-balance-method", default="shortest_queue",
                   choices=["shortest_queue", "round_robin", "prefix"],
                   help="with --dp-size > 1: how the controller picks a replica per request")
    p.add_argument("--max-engine-restarts", type=int, default=3,
                   help="engine crashes survived by restarting it; one more exits non-zero")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=5.0,
                   help="seconds SIGTERM lets running requests finish before aborting them "
                        "(a second signal exits at once)")
    # images (a K3 checkpoint with its vision tower; server/media.py): vLLM's flag names
    p.add_argument("--allowed-media-domains", nargs="*", default=[],
                   help="hosts http(s) image URLs may name (default none: data: URLs only)")
    p.add_argument("--limit-mm-per-prompt", default=None,
                   help=f"images per request, as JSON like '{{\"image\": 4}}' (default "
                        f"{MediaLimits.max_images})")
    p.add_argument("--max-image-pixels", type=int, default=MediaLimits.max_image_pixels,
                   help="pixels of one decoded image (width x height)")
    p.add_argument("--max-image-tokens", type=int, default=None,
                   help="prompt tokens all of one request's images may take (default: the "
                        "context's)")
    p.add_argument("--max-image-bytes", type=int, default=MediaLimits.max_image_bytes,
                   help="bytes of one image file")
    p.add_argument("--media-fetch-timeout", type=float, default=MediaLimits.fetch_timeout,
                   help="seconds to fetch one http(s) image")
    p.set_defaults(func=serve)


def media_limits(args: argparse.Namespace) -> MediaLimits:
    images = parse_mm_limit(args.limit_mm_per_prompt)
    for flag, value in (("--max-image-pixels", args.max_image_pixels),
                        ("--max-image-bytes", args.max_image_bytes),
                        ("--max-image-tokens", args.max_image_tokens or 1),
                        ("--media-fetch-timeout", args.media_fetch_timeout)):
        if value <= 0:
            raise ValueError(f"{flag} must be positive")
    return MediaLimits(MediaLimits.max_images if images is None else images,
                       args.max_image_pixels, args.max_image_tokens, args.max_image_bytes,
                       args.media_fetch_timeout,
                       tuple(d.rstrip(".").lower() for d in args.allowed_media_domains))


def served_names(model: str, path: str, flag: str | None) -> tuple[str, tuple[str, ...]]:
    """The name /v1/models lists and responses carry, and the other names requests may give.

    By default a bare name, never a path: OpenAI clients that read a provider prefix from the
    name (openai-agents: "Unknown prefix") refuse one with a '/'. `--model` as typed (the name
    before) and the resolved path stay accepted, so old clients keep working."""
    from kdaserve.checkpoint import PRESETS

    if flag:
        name = flag
    elif model in PRESETS and not Path(model).is_dir():
        name = model
    else:
        folder = Path(os.path.abspath(path))  # not resolve(): a symlink's name is chosen
        # the Hugging Face cache's snapshots/<hash>: the repository's name, not the hash
        hub = folder.parent.parent.name
        if folder.parent.name == "snapshots" and hub.startswith("models--"):
            name = hub.split("--")[-1]
        else:
            name = folder.name or str(folder)
    aliases = tuple(dict.fromkeys(a for a in (model, path) if a != name))
    return name, aliases


def serve(args: argparse.Namespace) -> None:
    config = engine_config(args)
    if config.node_rank > 0:  # only tensor-parallel ranks here; node 0 serves HTTP
        from kdaserve.engine.tensor_parallel import local_ranks, serve_node

        ranks = local_ranks(config)
        print(f"[kdaserve] node {config.node_rank}: ranks {ranks.start}..{ranks.stop - 1} of "
              f"{config.tp_size}, joining {config.dist_init_addr}", flush=True)
        sys.exit(serve_node(config))
    fatal = asyncio.run(_serve(args))
    if fatal:  # the engine kept dying: exit non-zero so a supervisor restarts us
        print(f"[kdaserve] exiting: {fatal}", flush=True)
        sys.exit(1)


async def _serve(args: argparse.Namespace) -> str | None:
    """Serves until a signal; returns why it gave up, if the engine could not be kept up."""
    import uvicorn

    from kdaserve.checkpoint import resolve_model_path
    from kdaserve.client.data_parallel import DataParallel
    from kdaserve.client.engine_process import EngineProcess
    from kdaserve.server.api import ServerState, create_app
    from kdaserve.server.chat import ChatHandler
    from kdaserve.server.header_timeout import with_header_timeout
    from kdaserve.server.media import MediaLoader
    from kdaserve.server.metrics import ServerMetrics
    from kdaserve.server.responses import ResponseStore
    from kdaserve.server.sampling import Sampling
    from kdaserve.server.sampling_policy import load_policy
    from kdaserve.tokenizer import Tokenizer

    loop = asyncio.get_running_loop()
    signals = 0
    server: Any = None
    engine: Any = None
    starting: asyncio.Future | None = None

    def on_signal() -> None:
        """The first drains: no new connections, running requests get
        --graceful-shutdown-timeout seconds, then end with a 503 (streams: an error event);
        a second exits at once. During start-up: stop starting."""
        nonlocal signals
        signals += 1
        if engine is not None:
            engine.stopping = True  # an engine dying now is not restarted
        if server is None:
            if starting is not None:
                starting.cancel()
            return
        if signals == 1:
            grace = args.graceful_shutdown_timeout
            # just before uvicorn cancels the handlers, which would answer a bare 500
            loop.call_later(max(grace - 0.3, 0.0), engine.fail_all,
                            "the server is shutting down", 503)
        else:
            server.force_exit = True
        server.should_exit = True

    # Our own SIGINT/SIGTERM handling, from the start: uvicorn's re-raises the signal after
    # its shutdown, which would kill us before the engine process is stopped cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    config = engine_config(args)
    start = time.perf_counter()
    # resolve (and for a preset, generate) the checkpoint once, before the engine process
    path = resolve_model_path(config.model)
    config = dataclasses.replace(config, model=str(path))
    # one group's rendezvous (tensor-parallel ranks, or DP attention's), never on our HTTP
    # port; replicas of their own (dp_size > 1 without DP attention) each pick theirs
    one_group = config.enable_dp_attention or (config.tp_size > 1 and config.dp_size == 1)
    if one_group and not config.dist_init_addr and config.nnodes == 1:
        from kdaserve.engine.tensor_parallel import free_local_addr

        config = dataclasses.replace(config, dist_init_addr=free_local_addr(args.port))
    if args.default_max_tokens < 1:
        raise ValueError("--default-max-tokens must be >= 1")
    image_limits = media_limits(args)
    # --skip-tokenizer-init: token ids in and out (/generate input_ids), as SGLang; RL
    # trainers tokenize themselves, and a checkpoint may come without tokenizer files
    tokenizer = chat = None
    policy = load_policy(args.sampling_policy, path)
    if not config.skip_tokenizer_init:
        tokenizer = Tokenizer.from_pretrained(path)
        chat = ChatHandler.from_pretrained(path, tokenizer, args.reasoning_parser,
                                           args.chat_template, policy,
                                           args.default_max_tokens, args.tool_call_parser)
    name, aliases = served_names(str(args.model), str(path), args.served_model_name)
    logger.info("start-up config: checkpoint %s%s (%.1f s)", path,
                "" if chat is None else ", tokenizer and chat template",
                time.perf_counter() - start)
    fatal: list[str] = []

    def on_fatal(why: str) -> None:
        fatal.append(why)
        if server is not None:
            server.should_exit = server.force_exit = True

    # a tensor-parallel engine that dies lost a rank (or killed them all): the server exits
    # for a supervisor to restart the whole group, rather than waiting for a remote node
    restarts = 0 if config.tp_size > 1 else args.max_engine_restarts
    engine = EngineProcess(config, restarts, on_fatal) if config.dp_size == 1 else \
        DataParallel(config, restarts, on_fatal, args.load_balance_method)
    if signals:  # asked to stop while loading the tokenizer
        await engine.shutdown()
        print("[kdaserve] stopped during start-up", flush=True)
        return None
    starting = asyncio.ensure_future(engine.start())
    try:
        try:
            await starting
        except asyncio.CancelledError:
            print("[kdaserve] stopped during start-up", flush=True)
            return None
        context = engine.info["max_request_tokens"]
        if args.context_length is not None:
            if args.context_length < 2:
                raise ValueError("--context-length must be >= 2")
            context = min(context, args.context_length)
        limits = Limits(args.max_request_body_bytes, args.body_read_timeout,
                        args.max_queued_requests, args.request_timeout,
                        args.watchdog_timeout)
        state = ServerState(
            client=engine, tokenizer=tokenizer, model_name=name, model_path=str(path),
            max_request_tokens=context, metrics=ServerMetrics(), limits=limits,
            chat=chat, api_key=args.api_key, responses=ResponseStore(),
            model_aliases=aliases, sampling=Sampling(policy),  # (the chat handler's, if any)
            server_args={k: v for k, v in vars(args).items()
                         if isinstance(v, str | int | float | bool | None) and k != "api_key"})
        if tokenizer is not None:
            state.media = MediaLoader(image_limits, engine.info.get("media_pad_id"),
                                      engine.info.get("image_refusal"), tokenizer.encode,
                                      engine.info["image_processor"])
        engine.on_restart.append(state.engine_restarted)
        app = create_app(state)
        server = _server_class()(uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30,
            http=with_header_timeout(args.header_read_timeout),
            timeout_graceful_shutdown=args.graceful_shutdown_timeout))
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        if fatal or signals:  # the engine gave up, or a signal came, before we got here
            server.should_exit = server.force_exit = True
        print(f"[kdaserve] model {path}: {engine.info['summary']}", flush=True)
        if chat is None:
            print("[kdaserve] no tokenizer (--skip-tokenizer-init): token ids in and out",
                  flush=True)
        else:
            print(f"[kdaserve] chat template {chat.template.origin} ({chat.format.name}); "
                  f"sampling policy {policy.name if policy else 'none'}", flush=True)
        also = f" (requests may also name {', '.join(map(repr, aliases))})" if aliases else ""
        print(f"[kdaserve] served model name {name!r}{also}", flush=True)
        await server.serve()
    finally:
        await engine.shutdown()
        print("[kdaserve] shut down", flush=True)
    return fatal[0] if fatal else None


def _ready(server: Any) -> None:
    """The last start-up line, once the port listens (its real number, also for --port 0)."""
    host, port = server.config.host, server.config.port
    if server.servers:  # asyncio servers: the bound sockets
        port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    print(f"[kdaserve] ready at {url} (OpenAI API at {url}/v1)", flush=True)


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:  # uvicorn exits on a failed bind; a signal may have come
                _ready(self)

    return Server
