"""kdaserve: a serving engine for Kimi Linear (KDA + MLA + MoE) models."""

from kdaserve.llm import LLM
from kdaserve.request import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
