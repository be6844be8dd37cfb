"""Request schemas of the HTTP API (OpenAI and SGLang-native) and their SamplingParams.

Unknown fields are accepted and ignored (clients send many vendor extensions); known fields are
type-checked, and a wrong type or value becomes an HTTP 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kdaserve.request import SamplingParams


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool = False


class _OpenAISampling(_Lenient):
    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        values: dict[str, Any] | None = None) -> SamplingParams:
        """Raises ValueError naming the bad field. `values`: the sampling fields after a
        sampling policy filled in its defaults (None: as the request gives them)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        v = values if values is not None else self.model_dump()

        def get(name: str, default: Any) -> Any:
            return default if v.get(name) is None else v[name]

        return SamplingParams(
            n=get("n", 1),
            temperature=get("temperature", 1.0),
            top_p=get("top_p", 1.0),
            top_k=get("top_k", 0),
            min_p=get("min_p", 0.0),
            presence_penalty=get("presence_penalty", 0.0),
            frequency_penalty=get("frequency_penalty", 0.0),
            repetition_penalty=get("repetition_penalty", 1.0),
            max_tokens=max_tokens,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # checked by kdaserve.server.chat_request, whose messages name the exact problem
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    thinking: Any = None  # Kimi's {"type": "enabled"|"disabled", "effort": ..., "keep": ...}
    reasoning_effort: Any = None
    chat_template_kwargs: Any = None
    separate_reasoning: bool = True


class GenerateSampling(_Lenient):
    """SGLang's sampling_params of /generate."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = Field(default=None, alias="sampling_seed")

    def to_params(self, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_new_tokens, seed=self.seed, ignore_eos=self.ignore_eos,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)


class GenerateRequest(_Lenient):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: str | None = None


ErrorType = Literal["BadRequestError", "NotFoundError", "ServiceUnavailableError",
                    "AuthenticationError", "InternalServerError"]


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind: dict[int, ErrorType] = {400: "BadRequestError", 401: "AuthenticationError",
                                  404: "NotFoundError", 503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": kind.get(status, "InternalServerError"),
                      "param": param, "code": status}}
