"""Request lifecycle objects: `SamplingParams` and `Request` in, `RequestOutput` out."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kdaserve.multimodal import ImageInputs

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True, slots=True)
class Grammar:
    """A structured-output constraint: `source` is a JSON Schema (as JSON text), a regex or a
    Lark grammar (llguidance's dialect, which names special tokens as `<|name|>`)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """Where a disaggregated request's prefill runs (the prefill server's bootstrap endpoint)
    and the room number pairing its prefill and decode halves: set by the PD router."""

    host: str
    port: int
    room: int


# Temperatures below this sample greedily, as in vLLM: dividing the logits by 1e-300 makes them
# infinite, and a softmax of infinities is NaN (token 0 every step).
GREEDY_BELOW_TEMPERATURE = 1e-5
# The logits are divided (positive) or multiplied (negative) by the penalty: outside this range
# they overflow or vanish (SGLang caps it at 2, vLLM only asks > 0).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # return the sampled token's logprob plus this many top ones
    # prompt log-probabilities: each prompt token's logprob from logprob_start_len on, plus
    # this many top ones per position (the first prompt token has none: nothing predicts it)
    prompt_logprobs: int | None = None
    logprob_start_len: int = 0
    token_ids_logprob: list[int] = field(default_factory=list)  # always reported, per position
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) banned until this many are out
    skip_special_tokens: bool = True
    keep_special_ids: tuple[int, ...] = ()  # decoded even with skip_special_tokens (markers)
    grammar: Grammar | None = None  # constrain the output (structured outputs)
    # thinking models: once the output holds this many tokens without `reasoning_end`, the
    # engine forces `reasoning_end` (the token ids that close the reasoning channel)
    reasoning_budget: int | None = None
    reasoning_end: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if 0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (0 <= self.temperature < math.inf,
             f"temperature must be >= 0 and finite, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.top_k < 2**31, f"top_k must be in [0, 2**31) or -1, got {self.top_k}"),
            (self.n <= 1024, f"n must be <= 1024, got {self.n}"),
            (self.seed is None or -(2**63) <= self.seed < 2**64,
             f"seed must be a 64-bit integer, got {self.seed}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (self.logprob_start_len >= 0,
             f"logprob_start_len must be >= 0, got {self.logprob_start_len}"),
            (len(self.token_ids_logprob) <= 64,
             f"token_ids_logprob takes at most 64 ids, got {len(self.token_ids_logprob)}"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (self.reasoning_budget is None or (self.reasoning_budget >= 0
                                                and bool(self.reasoning_end)),
             "reasoning_budget must be >= 0 and comes with reasoning_end token ids"),
            (not (self.grammar and self.ignore_eos),
             "ignore_eos cannot be combined with a grammar: the grammar decides where it ends"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What a request asks beyond how its tokens are chosen: records returned with its final
    output, and where it runs (set by routers). SGLang passes these beside sampling_params."""

    # rollout routing replay: each forwarded position's experts per MoE layer, from this one
    return_routed_experts: bool = False
    routed_experts_start: int = 0
    # the final-normed hidden state (what the LM head sees) of every forwarded position:
    # the prompt's, then each output token's but the last (SGLang's return_hidden_states)
    return_hidden_states: bool = False
    bootstrap: Bootstrap | None = None  # prefill/decode disaggregation (set by the PD router)
    # the data-parallel replica to run on (sglang-router --dp-aware); the server's DP
    # controller routes by it, an engine of its own accepts only 0
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if self.routed_experts_start < 0:
            raise ValueError("routed_experts_start must be >= 0, got "
                             f"{self.routed_experts_start}")
        if self.data_parallel_rank is not None and self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_rid_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. (`n` > 1 becomes n requests sharing a prompt.)"""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    num_computed_tokens: int = 0  # tokens whose effect is in the caches
    arrival: int = field(default_factory=lambda: next(_rid_counter))
    generator: torch.Generator | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    # prefix cache
    cache_node: Any = None  # radix node whose path this request locks
    prefix_hint: int | None = None  # cached tokens found when first queued (queue order)
    num_cached_prompt: int = 0  # tokens reused from the cache at admission
    snapshot_points: list[int] = field(default_factory=list)  # prefill positions to snapshot
    track_slot: int | None = None  # latest grid-aligned state copy during decode
    track_pos: int = 0
    # speculative decoding
    draft_ids: list[int] = field(default_factory=list)  # proposed, verified in the next step
    num_drafted: int = 0
    num_accepted: int = 0
    num_verifies: int = 0  # steps that verified drafts
    matcher: Any = None  # GrammarMatcher of a constrained request
    reasoning_done: bool = False  # reasoning_end seen (or no reasoning budget)
    # prompt logprobs, one entry per prompt position from params.logprob_start_len (None for
    # position 0); None when not wanted (only the first of n siblings computes them)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # [n, layers, k] chunks
    num_routed: int = 0  # positions recorded, from options.routed_experts_start
    hidden_states: list[torch.Tensor] = field(default_factory=list)  # [n, D] chunks from 0
    num_hidden: int = 0  # positions in hidden_states
    images: ImageInputs | None = None  # the prompt's images (K3), shared by n siblings
    passed_images: bool = False  # has run (or been given from the cache) past the last pad

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def key_ids(self) -> list[int]:
        """What the prefix cache keys the request by: `all_ids`, each image's pads replaced by
        the image's content key (multimodal.py)."""
        return self.all_ids if self.images is None else self.images.key_ids(self.all_ids)

    @property
    def prompt_key(self) -> list[int]:
        """The prompt as `key_ids` has it: two sides of a disaggregated request compare it,
        so that the same tokens with other images never pass for the same prompt."""
        return self.prompt_ids if self.images is None else self.images.prompt_key

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Positions [start, end) of prompt + output + drafts, without building the whole
        list (`all_ids` copies every token: a step's inputs need one or a few)."""
        if end - start == 1 and end == len(self.prompt_ids) + len(self.output_ids) \
                and self.output_ids:  # a decode's input: its last output token
            return [self.output_ids[-1]]
        out: list[int] = []
        for part in (self.prompt_ids, self.output_ids, self.draft_ids):
            if start < len(part) and end > 0:
                out.extend(part[max(start, 0):end])
            start -= len(part)
            end -= len(part)
        return out

    @property
    def last_token_pending(self) -> bool:
        """Its last output token is still on the device (a placeholder, engine/overlap.py)."""
        return bool(self.output_ids) and self.output_ids[-1] < 0

    @property
    def ends_when_read(self) -> bool:
        """Its pending last token is its max_tokens-th: whatever it is, the request ends when
        it is read, so no step runs it again."""
        return self.last_token_pending and len(self.output_ids) >= self.params.max_tokens

    @property
    def known_output_ids(self) -> list[int]:
        """The output tokens the host has read (all but a pending last one)."""
        return self.output_ids[:-1] if self.last_token_pending else self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def prompt_logits_row(self) -> int | None:
        """The next prompt position whose logits are still needed for prompt logprobs (row p
        predicts token p + 1); None when none are."""
        lps = self.prompt_logprobs
        if lps is None:
            return None
        pos = self.params.logprob_start_len + len(lps)  # the next token to score
        return pos - 1 if pos < len(self.prompt_ids) else None

    @property
    def max_cached_prefix(self) -> int:
        """How many leading tokens may come from the prefix cache: one token must always run
        (to produce logits), and rows still needed for prompt logprobs must run too."""
        caps = [self.num_tokens - 1]
        row = self.prompt_logits_row
        if row is not None:
            caps.append(row)
        if self.options.return_routed_experts:  # routing is recorded only by a forward
            caps.append(self.options.routed_experts_start + self.num_routed)
        if self.options.return_hidden_states:
            caps.append(self.num_hidden)
        return max(min(caps), 0)

    @property
    def is_prefilling(self) -> bool:
        """Some of its tokens are not in the caches yet beyond the one decode token."""
        # num_tokens spelled out: asked several times per request per step
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed_tokens > 1


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # speculative decoding: drafts verified / accepted, over spec_num_verifies steps
    spec_num_drafted: int = 0
    spec_num_accepted: int = 0
    spec_num_verifies: int = 0
    # with return_routed_experts, in the final output: [positions, MoE layers, top_k] int32
    routed_experts: torch.Tensor | None = None
    # with return_hidden_states, in the final output: [prompt + output - 1, hidden] fp32
    hidden_states: torch.Tensor | None = None

    @property
    def spec_acceptance_length(self) -> float:
        """Mean tokens emitted per verify step (accepted drafts + the target's token); 0
        when nothing was verified."""
        v = self.spec_num_verifies
        return (self.spec_num_accepted + v) / v if v else 0.0


@dataclass(slots=True)
class RequestOutput:
    """Output of one prompt; `.token_ids`, `.text` and `.finish_reason` are those of the first
    completion (the common `n == 1` case). In streaming, `outputs` carry the full text so far
    and `finished` tells whether this is the last update."""

    rid: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # one entry per prompt position from logprob_start_len (None for position 0), when asked
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
