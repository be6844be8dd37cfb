"""FastAPI application: OpenAI-compatible and SGLang-native endpoints over an EngineClient.

Prompts are tokenized here (so usage counts and length checks need no engine round trip); the
engine returns token ids and text. Every error is an OpenAI-style error object; errors found
before a stream starts are real HTTP statuses (400/404/503), since a stream cannot change its
status. The handlers live in one module per API (completions, chat, responses, native).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.routing import Match

from kdaserve.client.request_client import EngineError
from kdaserve.request import SamplingParams
from kdaserve.server import native, response_store, rl
from kdaserve.server import openapi as oa
from kdaserve.server.chat import chat_handler
from kdaserve.server.chat_template import image_parts
from kdaserve.server.completions import create_completion
from kdaserve.server.guards import ApiKeyMiddleware, BodyGuard
from kdaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    error_body,
)
from kdaserve.server.responses import ResponsesRequest, create_response
from kdaserve.server.serving import (
    ModelNotFoundError,
    QueueFullError,
    ServerState,
    check_model,
    off_loop,
    until_disconnect,
)

__all__ = ["ServerState", "create_app"]


# pydantic's names for a union's alternatives in an error's location: "str", "list[int]",
# "constrained-str", "function-after[...]"
_BRANCH = re.compile(r"^(str|int|float|bool|list|dict|constrained-\w+|function-[\w-]+)(\[.*\])?$")


def _where(loc: Sequence[Any]) -> str:
    """An error's field path as a client wrote it: no `body`, no union alternatives."""
    return ".".join(str(x) for x in loc if x != "body" and not _BRANCH.match(str(x)))


def _closest_branches(errs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A value that fits no alternative of a union gets one error per alternative; where some
    alternative took its JSON type and failed on its value ("" for a prompt: too short), only
    those are reported, not "should be a valid list" for every other one."""
    by_field: dict[str, list[dict[str, Any]]] = {}
    for e in errs:
        by_field.setdefault(_where(e.get("loc", ())), []).append(e)
    out = []
    for group in by_field.values():
        close = [e for e in group if not str(e.get("type", "")).endswith("_type")]
        out += close if len(group) > 1 and close else group
    return out


def create_app(state: ServerState) -> FastAPI:
    """The server: its error handlers (every error an OpenAI error object), guards, and
    routes by family."""
    app = FastAPI(title="kdaserve")
    app.state.kd = state
    _error_handlers(app)
    # the last added runs first: the key is checked before the body is read
    app.add_middleware(BodyGuard, max_bytes=state.limits.max_body_bytes,
                       read_timeout=state.limits.body_read_timeout)
    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, key=state.api_key)
    _operational_routes(app, state)
    _model_routes(app, state)
    _sglang_routes(app, state)
    _generation_routes(app, state)
    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = [(_where(e.get("loc", ())), e) for e in _closest_branches(exc.errors())]
        param = errs[0][0] if errs else None
        msg = "; ".join(f"{where}: {e.get('msg')}" for where, e in errs)
        return JSONResponse(error_body(msg or "invalid request", 400, param or None),
                            status_code=400)

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 400), status_code=400)

    @app.exception_handler(ModelNotFoundError)
    async def _no_model(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 404, "model"), status_code=404)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        # unknown paths and methods too get OpenAI error objects, not {"detail": ...}
        message = {404: f"no route {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names the first matching route's methods only
            headers["Allow"] = ", ".join(sorted(
                {m for r in app.routes if isinstance(r, APIRoute)
                 and r.matches(request.scope)[0] is not Match.NONE for m in r.methods}))
        return JSONResponse(error_body(message.get(exc.status_code, str(exc.detail)),
                                       exc.status_code), status_code=exc.status_code,
                            headers=headers)

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, exc: QueueFullError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 429), status_code=429,
                            headers={"Retry-After": "1"})

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.status), status_code=exc.status)


def _operational_routes(app: FastAPI, state: ServerState) -> None:
    """Health, metrics, pool invariants, the prefix-cache flush."""
    @app.get("/health", response_class=PlainTextResponse, responses={
        **oa.responses(None, {503: oa._error("the engine is down, restarting or stuck")},
                       text=True)})
    async def health() -> Response:
        problem = getattr(state.client, "problem", None)  # an engine process
        why = problem(state.limits.watchdog_timeout) if problem is not None else None
        if why:
            return JSONResponse(error_body(why, 503), status_code=503)
        return PlainTextResponse("")

    @app.get("/health_generate", response_class=PlainTextResponse, responses={
        **oa.responses(None, {500: oa._error("the engine failed this request"),
                              503: oa._error("the engine is down or restarting")},
                       text=True)})
    async def health_generate() -> Response:
        if state.server_args.get("disaggregation_mode"):  # half a request cannot run alone
            await state.client.get_metrics()
            return PlainTextResponse("")
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        async for _ in state.client.generate([0], params, f"health-{uuid.uuid4().hex}"):
            pass
        return PlainTextResponse("")

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={**oa.responses(None, {503: oa._error("the engine is down")},
                                       text=True)})
    async def metrics() -> Response:
        body = state.metrics.render(await state.client.get_metrics())
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/check_integrity", response_model=oa.RLResult, responses=oa.responses(
        oa.RLResult, {500: oa._error("a pool invariant is broken"),
                      503: oa._error("the engine is down")}))
    async def check_integrity() -> dict[str, Any]:
        """The engine's pool invariants (blocks and state slots held by exactly the requests,
        reservations and cache entries that own them): for tests and operators."""
        await state.client.call("check_integrity")
        return {"success": True, "message": "pools consistent"}

    @app.post("/flush_cache", response_class=PlainTextResponse, responses={**oa.responses(
        None, {400: oa._error("entries in use were kept"),
               415: oa._error("a bodiless POST from another site's page"),
               503: oa._error("the engine is down")}, text=True)})
    async def flush_cache() -> Response:
        """Empties the prefix cache (SGLang's endpoint); 400 while requests lock entries."""
        if await state.client.call("flush_cache"):
            return PlainTextResponse("Cache flushed.")
        return JSONResponse(error_body("cache entries in use by running requests were kept",
                                       400), status_code=400)


def _model_routes(app: FastAPI, state: ServerState) -> None:
    """OpenAI's model list and card."""
    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "kdaserve", "root": state.model_path,
                "max_model_len": state.max_request_tokens}

    @app.get("/v1/models", response_model=oa.ModelList, responses=oa.responses(oa.ModelList, {}))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", response_model=oa.ModelCard,
             responses=oa.responses(oa.ModelCard, {404: oa._error("unknown model")}))
    async def model(model: str) -> dict[str, Any]:
        check_model(state, model)  # the served name or any alias
        return model_card()


def _sglang_routes(app: FastAPI, state: ServerState) -> None:
    """SGLang's RL calls, model and server info, tokenize and detokenize."""
    rl_errors = {400: oa._error("a bad update (nothing changed) or bad request"),
                 503: oa._error("the engine is down")}

    def rl_route(path: str, handler: Any, body: type[Any] | None) -> None:
        """One SGLang RL endpoint: POST, a JSON body (or none), {"success", "message"}."""
        if body is None:
            async def endpoint() -> dict[str, Any]:
                return await handler(state)
        else:
            async def endpoint(req: Any) -> dict[str, Any]:
                return await handler(state, req)
            endpoint.__annotations__["req"] = body  # a real class: FastAPI reads the body
        app.post(path, response_model=oa.RLResult, name=path.strip("/"),
                 responses=oa.responses(oa.RLResult, {**oa.BODY, **rl_errors}))(endpoint)

    rl_route("/update_weights_from_disk", rl.from_disk, rl.UpdateFromDisk)
    rl_route("/update_weights_from_tensor", rl.from_tensor, rl.UpdateFromTensor)
    rl_route("/update_weights_from_distributed", rl.from_distributed,
             rl.UpdateFromDistributed)
    rl_route("/init_weights_update_group", lambda s, r: rl.call(
        s, "init_weights_update_group", r.master_address, r.master_port, r.rank_offset,
        r.world_size, r.group_name, r.backend), rl.InitGroup)
    rl_route("/destroy_weights_update_group", lambda s, r: rl.call(
        s, "destroy_weights_update_group", r.group_name), rl.GroupName)
    rl_route("/release_memory_occupation", lambda s, r: rl.call(
        s, "release_memory_occupation", r.tags), rl.Tags)
    rl_route("/resume_memory_occupation", lambda s, r: rl.call(
        s, "resume_memory_occupation", r.tags), rl.Tags)
    rl_route("/pause_generation", rl.pause, rl.Pause)
    rl_route("/continue_generation", lambda s, r: rl.resume(s), rl.Continue)

    @app.get("/get_weight_version", response_model=oa.WeightVersion,
             responses=oa.responses(oa.WeightVersion, {503: oa._error("the engine is down")}))
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": await state.client.call("weight_version")}

    @app.get("/get_model_info", response_model=oa.ModelInfo,
             responses=oa.responses(oa.ModelInfo, {}))
    @app.get("/model_info", response_model=oa.ModelInfo,
             responses=oa.responses(oa.ModelInfo, {}))
    async def model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path,
                "is_generation": True, "weight_version": "default"}

    @app.get("/get_server_info", response_model=oa.ServerInfo,
             responses=oa.responses(oa.ServerInfo, {503: oa._error("the engine is down")}))
    @app.get("/server_info", response_model=oa.ServerInfo,
             responses=oa.responses(oa.ServerInfo, {503: oa._error("the engine is down")}))
    async def server_info() -> dict[str, Any]:
        return await native.server_info(state)

    @app.post("/tokenize", response_model=oa.TokenizeResponse,
              responses=oa.responses(oa.TokenizeResponse, {**oa.BODY, 404: oa._error(
                  "unknown model")}))
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await off_loop(state, bool(image_parts(req.messages or [])), native.tokenize,
                              state, req)

    @app.post("/detokenize", response_model=oa.DetokenizeResponse,
              responses=oa.responses(oa.DetokenizeResponse, {**oa.BODY, 404: oa._error(
                  "unknown model")}))
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return native.detokenize(state, req)


def _generation_routes(app: FastAPI, state: ServerState) -> None:
    """Completions, chat completions, the Responses API, SGLang's /generate."""
    @app.post("/v1/completions", response_model=oa.CompletionResponse,
              responses=oa.responses(oa.CompletionResponse, oa.GENERATION, stream=True))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await until_disconnect(request, create_completion(state, req))

    @app.post("/v1/chat/completions", response_model=oa.ChatCompletionResponse,
              responses=oa.responses(oa.ChatCompletionResponse, oa.GENERATION, stream=True))
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await until_disconnect(request, chat_handler(state).handle(state, req))

    @app.post("/v1/responses", response_model=oa.ResponseObject,
              responses=oa.responses(oa.ResponseObject, oa.GENERATION, stream=True))
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        return await until_disconnect(request, create_response(state, req))

    @app.get("/v1/responses/{response_id}", response_model=oa.ResponseObject,
             responses=oa.responses(oa.ResponseObject, {**oa.STORED, 400: oa._error(
                 "a query parameter not documented here (OpenAI's stream, starting_after "
                 "and include are not supported)")}))
    async def get_response(request: Request, response_id: str,
                           include_obfuscation: bool = True) -> Response:
        """A stored response as it was returned (`include_obfuscation`: a stream option, and
        no stream is replayed here)."""
        return response_store.unknown_query(request, {"include_obfuscation"}) \
            or response_store.retrieve(state.responses, response_id)

    @app.delete("/v1/responses/{response_id}", response_model=oa.ResponseDeleted,
                responses=oa.responses(oa.ResponseDeleted, oa.STORED))
    async def delete_response(response_id: str) -> Response:
        return response_store.delete(state.responses, response_id)

    @app.get("/v1/responses/{response_id}/input_items", response_model=oa.ResponseItemList,
             responses=oa.responses(oa.ResponseItemList, {**oa.STORED, 400: oa._error(
                 "a bad limit, order or after, or a query parameter not documented here "
                 "(OpenAI's include is not supported)")}))
    async def response_input_items(
            request: Request, response_id: str,
            limit: Annotated[int, Query(ge=1, le=response_store.MAX_PAGE)] = 20,
            order: Literal["asc", "desc"] = "desc", after: str | None = None) -> Response:
        """A stored response's input context (the responses it continues, then its input)."""
        return response_store.unknown_query(request, {"limit", "order", "after"}) or \
            response_store.list_input_items(state.responses, response_id, limit, order, after)

    @app.post("/generate", response_model=oa.GenerateResult | list[oa.GenerateResult],
              responses=oa.responses(oa.GenerateResult, oa.GENERATION, stream=True))
    async def generate(req: GenerateRequest, request: Request) -> Response:
        return await until_disconnect(request, native.generate(state, req))

    oa.install(app)
