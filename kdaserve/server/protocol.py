"""Request schemas of the HTTP API (OpenAI and SGLang-native) and their SamplingParams.

The policy is strict: a field we do not know is a 400 naming it, never silently dropped. The
few fields OpenAI documents as advisory (`user`, `metadata`, `store`, `service_tier`,
`prompt_cache_key`, `safety_identifier`; SGLang's `log_metrics`, `stream_interval`) are
accepted and ignored, and listed in docs/server.md. Types are strict: a number sent as a string
("10"), a boolean as a string ("yes") or as a number, and a number with a fraction where an
integer belongs are 400s (1.0 is 1, as JSON Schema's `integer` says), as are non-finite numbers
(Infinity, NaN); token ids are integers (`false` is not token 0); every count has bounds, so
nothing reaches the engine that could overflow there. The OpenAPI document (openapi.py) says
all of this, and where a rule is beyond what a schema can say, it names the refusal.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from kdaserve.request import (
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    Bootstrap,
    Grammar,
    RequestOptions,
)
from kdaserve.server.sampling_policy import PARAMS as POLICED

TokenId = Annotated[StrictInt, Field(ge=0, lt=2**31)]
MAX_N = 128  # OpenAI's limit on n
MAX_PROMPTS = 256  # prompts in one /v1/completions or /generate request
MAX_SEQUENCES = 256  # prompts x n in one request: more would crowd out every other client
MAX_STOPS = 16
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
Count = Annotated[int, Field(ge=0, lt=2**31)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]
NonEmpty = Annotated[str, Field(min_length=1)]
TOKEN_KEY = "[0-9]+"  # a token id as a JSON object key (logit_bias)
LogitBias = Annotated[dict[Annotated[str, Field(pattern=f"^{TOKEN_KEY}$")],
                           Annotated[float, Field(ge=-100, le=100)]],  # SamplingParams' range
                      Field(max_length=MAX_LOGIT_BIAS,
                            json_schema_extra={"additionalProperties": False})]
Stop = NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOPS)]


def _integral(value: Any) -> Any:
    """Integral floats (1.0, 1e3) as ints, inside lists too: JSON Schema's `integer` is any
    number with no fraction, so the document's integers admit them (1.5 stays a 400)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def _takes_int(annotation: Any) -> bool:
    """Whether a field's type has integers in it and no floats (a float field keeps 1.0)."""
    seen: set[Any] = set()

    def walk(t: Any) -> None:
        seen.add(t)
        for a in get_args(t):
            walk(a)

    walk(annotation)
    return int in seen and float not in seen


@functools.cache
def _int_keys(cls: type[BaseModel]) -> frozenset[str]:
    """The keys (aliases where set) of `cls`'s integer fields: read once per model class, not
    walked again for every request."""
    return frozenset(f.alias or n for n, f in cls.model_fields.items()
                     if _takes_int(f.annotation))


def _nullable_optionals(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The document says what `_null_is_unset` does: an optional field also takes null.
    A required one does not (its null is a missing field, a 400)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            continue
        options = prop.get("anyOf")
        if options is not None:
            if {"type": "null"} not in options:
                options.append({"type": "null"})
            continue
        keep = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **keep}
    rules = getattr(cls, "schema_rules", None)
    if rules is not None:
        schema.setdefault("allOf", []).extend(rules())


def given(name: str) -> dict[str, Any]:
    """JSON Schema for "field `name` is present and not null" (null is unset here)."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def exactly_one(*names: str) -> dict[str, Any]:
    return {"oneOf": [given(n) for n in names]}


def at_most_one(*names: str) -> dict[str, Any]:
    return {"not": {"anyOf": [{"allOf": [given(a), given(b)]}
                              for i, a in enumerate(names) for b in names[i + 1:]]}}


GRAMMARS = ("regex", "json_schema", "ebnf")  # constraint(): at most one


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              json_schema_extra=_nullable_optionals)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """`null` means "not given", as OpenAI's schemas type most fields `X | null`: it
        takes the field's default (and a null we do not implement is no request for it).
        Integral floats in integer fields are their integers."""
        if isinstance(data, dict):
            ints = _int_keys(cls)
            return {k: _integral(v) if k in ints else v
                    for k, v in data.items() if v is not None}
        return data


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # advisory: no obfuscation padding is added


def check_min_tokens(name: str, min_tokens: int, max_name: str, max_tokens: int) -> int:
    """A floor above the cap is a contradiction the client should hear of, not a silent clamp
    (vLLM refuses it too)."""
    if min_tokens > max_tokens:
        raise ValueError(f"{name} ({min_tokens}) is above {max_name} ({max_tokens})")
    return min_tokens


def check_sequences(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_SEQUENCES:
        raise ValueError(f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences; a "
                         f"request may ask for at most {MAX_SEQUENCES}")


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not re.fullmatch(TOKEN_KEY, key):  # not int(): that takes " 5", "-1", "1_0"
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        out[int(key)] = float(value)
    return out


def constraint(regex: str | None, json_schema: str | dict[str, Any] | None,
               ebnf: str | None) -> Grammar | None:
    """SGLang's constrained decoding parameters, as one engine grammar (at most one)."""
    given = [name for name, v in (("regex", regex), ("json_schema", json_schema),
                                  ("ebnf", ebnf)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"at most one of regex, json_schema and ebnf, got {given}")
    if regex is not None:
        return Grammar("regex", regex)
    if json_schema is not None:
        source = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        try:
            json.loads(source)
        except ValueError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        return Grammar("json_schema", source)
    if ebnf is not None:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:  # SGLang's EBNF is GBNF (`root ::= ...`); llguidance reads Lark
            return Grammar("lark", gbnf_to_lark(ebnf))
        # GbnfToLarkError, ValueError, and a bare Exception for some inputs ("No 'root' rule
        # found" for an empty grammar): each the request's fault
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"ebnf: {e}") from None
    return None


SGLANG_BOOTSTRAP_PORT = 8998  # what SGLang's decode side assumes when the router names none


class BootstrapFields(Strict):
    """Routing fields routers add: the PD router's (sglang-router --pd-disaggregation: the
    prefill server's bootstrap endpoint and the room pairing the two halves), and the
    data-parallel replica (sglang-router --dp-aware)."""

    data_parallel_rank: int | None = Field(None, ge=0, lt=1024)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, gt=0, lt=65536)
    bootstrap_room: int | None = Field(None, ge=0, lt=2**64)

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        """bootstrap() as the document says it: the room comes with a host, and a host or
        port only with a room."""
        return [{"if": given("bootstrap_room"), "then": given("bootstrap_host")},
                {"if": {"anyOf": [given("bootstrap_host"), given("bootstrap_port")]},
                 "then": given("bootstrap_room")}]

    def options(self, **records: Any) -> RequestOptions:
        """The request's routing (and, from /generate, the records it asks for)."""
        return RequestOptions(bootstrap=self.bootstrap(),
                              data_parallel_rank=self.data_parallel_rank, **records)

    def bootstrap(self) -> Bootstrap | None:
        if self.bootstrap_room is None:
            if self.bootstrap_host is not None or self.bootstrap_port is not None:
                raise ValueError("bootstrap_host/bootstrap_port without bootstrap_room")
            return None
        if self.bootstrap_host is None:
            raise ValueError("bootstrap_room without bootstrap_host")
        return Bootstrap(self.bootstrap_host, self.bootstrap_port or SGLANG_BOOTSTRAP_PORT,
                         self.bootstrap_room)


def shared_sampling_fields(m: SamplingFields | GenerateSampling) -> dict[str, Any]:
    """What every endpoint's sampling fields share, by SamplingParams' names (None: omitted,
    for the sampling policy or SamplingParams' defaults to fill)."""
    return {**{p: getattr(m, p) for p in POLICED}, "seed": m.seed,
            "stop": [m.stop] if isinstance(m.stop, str) else list(m.stop or []),
            "stop_token_ids": list(m.stop_token_ids or []), "ignore_eos": m.ignore_eos,
            "skip_special_tokens": m.skip_special_tokens,
            "logit_bias": parse_logit_bias(m.logit_bias),
            "grammar": constraint(m.regex, m.json_schema, m.ebnf)}


class SamplingFields(BootstrapFields):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (OpenAI's, plus
    the vLLM/SGLang extensions clients send)."""

    model: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY,
                                             le=MAX_REPETITION_PENALTY)
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOPS)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: Count = 0
    logit_bias: LogitBias | None = None
    regex: str | None = None  # SGLang's constrained decoding (one of the three)
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # advisory (OpenAI documents them as not changing the output): accepted, ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # what sglang-router sends as defaults: accepted at those values only
    no_stop_trim: Literal[False] = False  # stop strings are always trimmed
    return_hidden_states: Literal[False] = False  # /generate returns them

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        return [*super().schema_rules(), at_most_one(*GRAMMARS)]

    def sampling_fields(self, max_tokens: int) -> dict[str, Any]:
        """The sampling fields by SamplingParams' names, None where omitted (server/sampling.py
        builds the SamplingParams); ValueError naming a bad field."""
        return {**shared_sampling_fields(self), "max_tokens": max_tokens,
                "min_tokens": check_min_tokens("min_tokens", self.min_tokens, "max_tokens",
                                               max_tokens)}


class CompletionRequest(SamplingFields):
    prompt: (NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: Count | None = 16  # 0 with echo: score the prompt only
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: None = None  # insertion is not supported: only null is accepted

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        # max_tokens 0 scores the prompt (echo) and generates nothing: only with echo
        zero = {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}}
        echo = {"required": ["echo"], "properties": {"echo": {"const": True}}}
        return [*super().schema_rules(), {"if": zero, "then": echo}]

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of other than n is not supported")
        return self


class ChatMessage(BaseModel):
    # Other keys (reasoning_content, partial, ...) go to the chat template, which reads them
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]  # chat_template.ROLES
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # checked by kdaserve.server.chat_request, whose messages name the exact problem
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # false: only the first tool call is returned
    response_format: Any = None
    thinking: Any = None  # Kimi's {"type": "enabled"|"disabled", "effort": ..., "keep": ...}
    reasoning_effort: Literal["low", "high", "max"] | None = None  # chat_request.EFFORTS
    chat_template_kwargs: Any = None
    # reasoning is always reported apart (K3 channels, K2 with a reasoning parser)
    separate_reasoning: Literal[True] = True
    stream_reasoning: Literal[True] = True  # reasoning streams as it comes
    continue_final_message: Literal[False] = False
    modalities: list[Literal["text"]] | None = None


class GenerateSampling(Strict):
    """SGLang's sampling_params of /generate (null means the default, as SGLang's frontend
    sends every field)."""

    max_new_tokens: Count | None = 128  # 0: prefill only (a prefix-cache warm-up / scoring)
    min_new_tokens: Count | None = 0
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY,
                                             le=MAX_REPETITION_PENALTY)
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOPS)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int | None = Field(None, ge=1, le=MAX_N)
    seed: Seed | None = Field(default=None, alias="sampling_seed")
    logit_bias: LogitBias | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    # not supported: only null or [] (what SGLang's frontend sends when none is given)
    stop_regex: Annotated[list[str], Field(max_length=0)] | None = None
    no_stop_trim: Literal[False] = False  # stop strings are always trimmed
    spaces_between_special_tokens: Literal[True] = True
    stream_interval: int | None = None  # advisory: every step is streamed

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        return [at_most_one(*GRAMMARS)]

    def sampling_fields(self) -> dict[str, Any]:
        """As SamplingFields.sampling_fields (max_new_tokens 0, prefill only, samples one)."""
        max_tokens = max(self.max_new_tokens if self.max_new_tokens is not None else 128, 1)
        return {**shared_sampling_fields(self), "max_tokens": max_tokens,
                "min_tokens": check_min_tokens("min_new_tokens", self.min_new_tokens or 0,
                                               "max_new_tokens", max_tokens)}


class GenerateRequest(BootstrapFields):
    text: (NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)]
           | None) = None
    input_ids: (Annotated[list[TokenId], Field(min_length=1)]
                | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                            Field(min_length=1, max_length=MAX_PROMPTS)] | None) = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1, lt=2**31)  # -1: the last prompt token only
    top_logprobs_num: int = Field(0, ge=0, le=20)
    token_ids_logprob: Annotated[list[TokenId], Field(max_length=64)] | None = None
    return_text_in_logprobs: bool = False
    # SGLang's: a prompt's images (data: or http(s) URLs, or bare base64), one per
    # <|media_pad|> in it; with several prompts, one entry (an image or a list) per prompt
    image_data: str | list[str | list[str] | None] | None = None
    rid: str | None = None
    log_metrics: bool = True  # advisory
    no_logs: bool = False  # advisory: requests are not logged
    # what SGLang's clients send as defaults: accepted at those values only
    background: Literal[False] = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False
    # meta_info.hidden_states (SGLang's layout): [prompt rows] then one row per later output
    # token but the last; final-normed fp32, what the LM head sees
    return_hidden_states: bool = False
    # rollout routing replay: meta_info.routed_experts, base64 of int32 [positions, MoE
    # layers, top_k] for positions [routed_experts_start_len, prompt + output - 1)
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0, lt=2**31)

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        return [*super().schema_rules(), exactly_one("text", "input_ids")]


class TokenizeRequest(Strict):
    """SGLang's and vLLM's /tokenize: a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        return [exactly_one("prompt", "messages")]

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages is required")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]
    skip_special_tokens: bool = False


ErrorType = Literal["BadRequestError", "AuthenticationError", "NotFoundError",
                    "MethodNotAllowedError", "RequestTimeoutError", "RequestTooLargeError",
                    "UnsupportedMediaTypeError", "RateLimitError", "InternalServerError",
                    "ServiceUnavailableError", "GatewayTimeoutError"]


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind: dict[int, ErrorType] = {
        400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
        405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
        415: "UnsupportedMediaTypeError", 429: "RateLimitError",
        503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
    return {"error": {"message": message, "type": kind.get(status, "InternalServerError"),
                      "param": param, "code": status}}
