"""What the engine's own objects (`RLControl`, `Introspection`) read of the engine they serve:
its parts, read-only, and the three calls they make. A Protocol, so they know this surface and
not the `LLMEngine` class (which imports them)."""

from __future__ import annotations

import os
from typing import Protocol

import torch

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.radix_cache import RadixCache
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import ModelConfig
from kdaserve.engine.disaggregation import DecodeSide, PrefillSide
from kdaserve.engine.model_runner import ModelRunner
from kdaserve.engine.outputs import OutputProcessor
from kdaserve.engine.scheduler import Scheduler
from kdaserve.engine.tensor_parallel import Followers
from kdaserve.engine_config import EngineConfig
from kdaserve.layers.parallel import ExpertParallel
from kdaserve.models.kimi_linear import KimiLinearForCausalLM
from kdaserve.speculative.verify import Speculator


class EngineParts(Protocol):
    @property
    def config(self) -> EngineConfig: ...
    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def path(self) -> os.PathLike: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def model(self) -> KimiLinearForCausalLM: ...
    @property
    def runner(self) -> ModelRunner: ...
    @property
    def blocks(self) -> BlockPool: ...
    @property
    def states(self) -> StatePool: ...
    @property
    def cache(self) -> RadixCache | None: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def out(self) -> OutputProcessor: ...
    @property
    def spec(self) -> Speculator | None: ...
    @property
    def pd(self) -> PrefillSide | DecodeSide | None: ...
    @property
    def followers(self) -> Followers | None: ...
    @property
    def ep(self) -> ExpertParallel: ...

    def has_unfinished(self) -> bool: ...

    def flush(self) -> None: ...

    def abort(self, rid: str) -> bool: ...
