"""kdaserve: a serving engine for Kimi Linear (KDA + MLA + MoE) models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kdaserve.llm import LLM
    from kdaserve.request import RequestOptions, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOptions", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`kdaserve.LLM` and the rest, imported on first use: a process that needs none of them
    imports no torch (the engine process's first moments, before it can watch its parent)."""
    if name == "LLM":
        from kdaserve.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOptions", "RequestOutput"):
        from kdaserve import request

        return getattr(request, name)
    raise AttributeError(f"module 'kdaserve' has no attribute {name!r}")
