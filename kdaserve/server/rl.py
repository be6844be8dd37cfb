"""SGLang's RL endpoints: refit (disk, shared tensors, a torch.distributed broadcast), the
weights' version, sleep/wake and pause/continue. The engine does the work (engine/rl.py);
here, a weight update first holds new requests back and waits for the running ones to finish,
or aborts them when the caller says `abort_all_requests`, since weights change only between
requests."""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Any, Literal

from pydantic import Field

from kdaserve.server.protocol import Strict
from kdaserve.server.serving import ServerState

TagList = Annotated[list[Literal["weights", "kv_cache"]], Field(max_length=2)]


class UpdateCommon(Strict):
    flush_cache: Literal[True] = True  # cached prefixes were computed with the old weights
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["auto", "safetensors"] | None = None


class UpdateFromDisk(UpdateCommon):
    model_path: Annotated[str, Field(min_length=1)]


class UpdateFromTensor(UpdateCommon):
    serialized_named_tensors: Annotated[list[str], Field(min_length=1)]  # base64, one per rank


class InitGroup(Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"


class UpdateFromDistributed(UpdateCommon):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class GroupName(Strict):
    group_name: str = "weight_update_group"


class Tags(Strict):
    tags: TagList | None = None


class Pause(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class Continue(Strict):
    torch_empty_cache: bool = True  # advisory on CPU


async def call(state: ServerState, method: str, *args: Any) -> dict[str, Any]:
    from kdaserve.client.request_client import EngineError

    try:
        out = await state.client.call(method, *args)
    except EngineError as e:  # the engine's ValueError: a bad update, nothing changed
        raise ValueError(str(e).removeprefix("ValueError: ")) from None
    if "weight_version" in out:
        state.weight_version = out["weight_version"]
    return out


async def update(state: ServerState, req: UpdateCommon, method: str,
                 *args: Any) -> dict[str, Any]:
    """Holds new requests at the gate, lets the running ones finish (or aborts them), then
    updates; a paused engine is updated as it stands (retracted requests resume after)."""
    async with state.update_lock:  # one update at a time; the gate opens after the last
        state.gate.clear()
        try:
            if req.abort_all_requests:
                paused = state.paused
                await call(state, "pause_generation", "abort")
                if not paused:  # aborting is not un-pausing what the trainer paused
                    await call(state, "continue_generation")
            while state.in_flight and not state.paused:  # paused: updated as it stands
                await asyncio.sleep(0.02)
            return await call(state, method, *args, req.weight_version)
        finally:
            state.gate.set()


async def from_disk(state: ServerState, req: UpdateFromDisk) -> dict[str, Any]:
    return await update(state, req, "update_weights_from_disk", req.model_path)


async def from_tensor(state: ServerState, req: UpdateFromTensor) -> dict[str, Any]:
    try:
        blobs = [base64.b64decode(s, validate=True) for s in req.serialized_named_tensors]
    except ValueError:
        raise ValueError("serialized_named_tensors must be base64 strings") from None
    return await update(state, req, "update_weights_from_tensor", blobs)


async def from_distributed(state: ServerState, req: UpdateFromDistributed) -> dict[str, Any]:
    return await update(state, req, "update_weights_from_distributed", req.names, req.dtypes,
                        req.shapes, req.group_name)


async def pause(state: ServerState, req: Pause) -> dict[str, Any]:
    out = await call(state, "pause_generation", req.mode)
    state.paused = True
    return out


async def resume(state: ServerState) -> dict[str, Any]:
    out = await call(state, "continue_generation")
    state.paused = False
    return out
