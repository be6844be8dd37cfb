"""What crosses between a client and an engine loop, in both directions: commands in
(`AddRequest`, `Abort`, `Call`, `Stop`) and messages out (`Outputs`, `RequestFailed`, `Reply`,
`Tick`; an engine process also says `Ready` or `StartFailed` once). Plain dataclasses: the same
objects go through a thread's queue (`AsyncLLM`) and, pickled, through ZeroMQ (the server's
engine process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kdaserve.multimodal import ImageInputs
from kdaserve.request import RequestOptions, SamplingParams


@dataclass(frozen=True)
class AddRequest:
    rid: str
    prompt: str | list[int]
    params: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)
    images: ImageInputs | None = None  # the prompt's images, processed (multimodal.py)


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class Call:
    """A read-only or maintenance call by name (engine_loop.CALLS); answered by a `Reply`
    with the same token."""
    token: int
    method: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Stop:
    pass


Command = AddRequest | Abort | Call | Stop


@dataclass(frozen=True)
class Outputs:
    """Updates of the requests a step touched: `RequestOutput`s, or across the process
    boundary the `OutputDelta`s that rebuild them (output_delta.py)."""
    outputs: list[Any]


@dataclass(frozen=True)
class RequestFailed:
    """A request ended in an error; `status` is the HTTP status it maps to."""
    rid: str
    message: str
    status: int


@dataclass(frozen=True)
class Reply:
    token: int
    result: Any = None
    error: str | None = None  # "Type: message" when the call raised


@dataclass(frozen=True)
class Tick:
    """The loop is alive and between steps (the HTTP side's watchdog listens)."""


@dataclass(frozen=True)
class Ready:
    """An engine process started: what the server shows about it."""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StartFailed:
    message: str


Message = Outputs | RequestFailed | Reply | Tick | Ready | StartFailed
