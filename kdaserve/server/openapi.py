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
# Before OpenAPI 3.2's itemSchema, an event stream's `schema` describes each event
SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}}}


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


# What a request schema cannot say: rules on the tokens a text becomes, on the engine's state
# or the model's weights, on one field against another. A request the schema admits is refused
# (400) only with one of its route's messages here; the document lists them under
# `x-kdaserve-refusals`, and the suite's schemathesis run holds the server to them.
CONTEXT = ("the prompt and max_tokens together exceed the context",
           r"exceeds the context of \d+ tokens|the context holds \d+")
VOCAB = ("a token id outside the vocabulary", r"token id -?\d+ outside the")
PD_MODE = ("bootstrap fields sent to a server not in disaggregation mode",
           r"not in disaggregation mode")
ONE_PROMPT = ("a disaggregated request (bootstrap_room) with several prompts",
              r"a disaggregated request \(bootstrap_room\) takes one prompt")
GRAMMAR = ("a grammar (regex, json_schema, ebnf, response_format) that does not compile",
           r"^(regex|json_schema|ebnf|response_format)\b|grammar")
MESSAGES = ("a message the chat template cannot render (tool calls, content parts, order)",
            r"^messages\[\d+\]|^the chat template")
TOOLS = ("tools, tool_choice or thinking options that do not fit together",
         r"^(tools|tool_choice|thinking|chat_template_kwargs)\b")
UPDATE = ("weights that are not this model's (tensor names, shapes, dtypes; a folder that is no "
          "checkpoint of this architecture)",
          r"^(serialized_named_tensors|model_path|checkpoint|tensor|unknown tensor name|"
          r"names, dtypes|dtype)\b|^FileNotFoundError: no config\.json")
UPDATE_STATE = ("an engine that takes no weights now (memory released, quantized or parallel "
                "serving, requests running) or no such weight update group",
                r"^update_weights_from_\w+\b|weight update group")
DP_RANK = ("a data_parallel_rank this server does not have", r"^data_parallel_rank \d+:")
SEQUENCES = ("prompts x n above the sequences one request may ask for",
             r"sequences; a request may ask for at most \d+")
MIN_TOKENS = ("min_tokens above max_tokens (given or default)", r"min_tokens \(\d+\) is above")
GENERATION_REFUSALS = (CONTEXT, MIN_TOKENS, VOCAB, DP_RANK, PD_MODE, ONE_PROMPT, GRAMMAR)
REFUSALS: dict[str, tuple[tuple[str, str], ...]] = {
    "POST /v1/completions": (*GENERATION_REFUSALS, SEQUENCES,
                             ("best_of other than n", r"best_of other than n")),
    "POST /v1/chat/completions": (*GENERATION_REFUSALS, MESSAGES, TOOLS),
    "POST /v1/responses": (CONTEXT, MIN_TOKENS, VOCAB, GRAMMAR, MESSAGES, TOOLS,
                           ("an input item this server cannot read", r"^input\[\d+\]"),
                           ("previous_response_id not stored here",
                            r"previous_response_id .* is not stored here")),
    "POST /generate": (*GENERATION_REFUSALS, SEQUENCES,
                       ("logprob_start_len past the prompt", r"logprob_start_len")),
    "POST /tokenize": (MESSAGES, TOOLS),
    "POST /detokenize": (VOCAB,),
    "GET /v1/responses/{response_id}/input_items": (
        ("after naming no input item of this response", r"after .* is no input item"),),
    "POST /update_weights_from_disk": (UPDATE, UPDATE_STATE),
    "POST /update_weights_from_tensor": (UPDATE, UPDATE_STATE),
    "POST /update_weights_from_distributed": (UPDATE, UPDATE_STATE),
    "POST /destroy_weights_update_group": (UPDATE_STATE,),
}


def _integer_bounds(node: Any) -> None:
    """Integer bounds written as integers: pydantic writes `lt=2**64` as 1.8446744073709552e19,
    and a client computing the largest value from that float gets one the server refuses."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(key), float) and node[key].is_integer():
                    node[key] = int(node[key])
        for v in node.values():
            _integer_bounds(v)
    elif isinstance(node, list):
        for v in node:
            _integer_bounds(v)


def install(app: FastAPI) -> None:
    """Replaces FastAPI's default 422 responses (never sent: validation errors are 400),
    writes integer bounds as integers and each route's refusals (REFUSALS)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for route, path in doc.get("paths", {}).items():
            for method, op in path.items():
                op.get("responses", {}).pop("422", None)
                refusals = REFUSALS.get(f"{method.upper()} {route}")
                if refusals:
                    op["x-kdaserve-refusals"] = [{"when": w, "message": m} for w, m in refusals]
        _integer_bounds(doc)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
