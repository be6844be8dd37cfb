"""The OpenAPI document, made honest: response models for every route (documentation only, the
handlers build their JSON themselves), the error statuses each route can answer with OpenAI's
error object, streaming and plain-text bodies under their real media types, and no 422 (a
validation error is a 400 here). Schemathesis runs over this document in the test suite."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # documented fields; more may come


class ErrorDetail(Open):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(Open):
    error: ErrorDetail


class ModelCard(Open):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Open):
    object: str
    data: list[ModelCard]


class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(Open):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class CompletionResponse(Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatChoice(Open):
    index: int
    message: dict[str, Any]
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ResponseObject(Open):
    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseDeleted(Open):
    id: str
    object: str
    deleted: bool


class ResponseItemList(Open):
    object: str
    data: list[dict[str, Any]]
    first_id: str | None  # null on an empty page
    last_id: str | None
    has_more: bool


class GenerateResult(Open):
    output_ids: list[int]
    meta_info: dict[str, Any]
    text: str | None = None


class ModelInfo(Open):
    model_path: str
    is_generation: bool


class ServerInfo(Open):
    model_path: str
    internal_states: list[dict[str, Any]]
    version: str


class TokenizeResponse(Open):
    tokens: list[int]
    count: int
    max_model_len: int


class RLResult(Open):
    success: bool
    message: str


class WeightVersion(Open):
    weight_version: str


class DetokenizeResponse(Open):
    text: str


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "model": ErrorResponse}


COMMON = {401: _error("invalid or missing API key (with --api-key)"),
          405: _error("method not allowed")}
BODY = {400: _error("invalid request (any field, named in the message)"),
        413: _error("request body too large"), 415: _error("request body is not JSON"),
        408: _error("request body not received in time")}
GENERATION = {**BODY, 404: _error("unknown model"), 429: _error("too many requests in flight"),
              500: _error("this request failed in the engine (the others go on)"),
              503: _error("the engine is down or restarting"),
              504: _error("request timed out (--request-timeout)")}
STORED = {404: _error("no such stored response (unknown, store: false, deleted or dropped)")}
SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def responses(model: type[BaseModel] | None, errors: dict[int, Any],
              stream: bool = False, text: bool = False) -> dict[int | str, Any]:
    """The `responses=` of a route: its success body and its error statuses."""
    ok: dict[str, Any] = {"description": "success"}
    if text:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif stream:
        ok["content"] = {**SSE}  # the JSON body's schema comes from response_model
    if model is None and not text:
        ok["content"] = {"application/json": {"schema": {}}}
    return {200: ok, **COMMON, **errors}


def install(app: FastAPI) -> None:
    """Replaces FastAPI's default 422 responses (never sent: validation errors are 400)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in doc.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
