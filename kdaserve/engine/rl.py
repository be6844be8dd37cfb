"""What an RL trainer does to a rollout engine between steps (SGLang's names and meanings),
the engine's `RLControl`: refit the weights (disk, shared tensors, a torch.distributed
broadcast), sleep and wake (release and restore the weights' and the KV cache's memory), and
pause generation.

Weights change only while no request runs: cached prefixes and running states were computed
with the old weights, so the prefix cache is flushed with every update. The server waits for
running requests (or aborts them, as the caller asks) before it calls these.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup

from kdaserve.engine import weights
from kdaserve.engine.parts import EngineParts
from kdaserve.layers.parallel import full_shape

TAGS = ("weights", "kv_cache")
PAUSE_MODES = ("abort", "retract", "in_place")


class EngineAsleep(Exception):
    """A request while memory is released: HTTP 503."""


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


RENDEZVOUS_TIMEOUT_S = 60.0  # a trainer that never joins costs this, on a side thread


def _settle(future: Future, fn: Callable[[], dict[str, Any]]) -> None:
    try:
        future.set_result(fn())
    except Exception as err:  # noqa: BLE001 - handed to the caller
        future.set_exception(err)


def _return_to_os() -> None:
    """glibc keeps freed blocks below its (adaptive, up to 32 MB) mmap threshold in its heap;
    malloc_trim hands them back, so released memory leaves the RSS whatever its history."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc is not None:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)


def _tags(tags: list[str] | None) -> list[str]:
    tags = list(TAGS) if tags is None else tags
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; the tags are {list(TAGS)}")
    return tags


class RLControl:
    """The engine's RL state (the weights' version and where they last came from on disk,
    update groups, paused generation, released memory and the sizes to restore it) and the
    calls a trainer makes on it."""

    def __init__(self, engine: EngineParts) -> None:
        self.engine = engine
        self.weight_version = "default"
        self.weights_source: Path | None = Path(engine.path)
        # name -> its group, or the join's Future while the trainer has not joined
        self.update_groups: dict[str, ProcessGroup | Future] = {}
        self.paused = False
        self.released: set[str] = set()
        self.param_shapes = [p.shape for p in engine.model.parameters()]

    def _require_single(self, what: str) -> None:
        e = self.engine
        # a refit of tensor-parallel slices, or a release of a disaggregated server's registered
        # pools, is not built: refused rather than half done
        if e.config.tp_size > 1 or e.config.disaggregation_mode is not None:
            raise ValueError(f"{what}: not supported with tensor parallelism or disaggregation yet")

    def _require_unquantized(self, what: str) -> None:
        e = self.engine
        # the int8 weights are derived from the loaded floats; a refit would have to quantize the
        # trainer's tensors too, which is not built: refused rather than half done
        self._require_single(what)
        if e.config.quantization is not None:
            raise ValueError(f"{what}: the engine serves {e.config.quantization}-quantized "
                             "weights; weight updates and weight release need an unquantized "
                             "engine")

    def _require_idle(self, what: str) -> None:
        e = self.engine
        if e.scheduler.running:
            raise ValueError(f"{what} needs no running requests ({len(e.scheduler.running)} run): "
                             "finish, abort (abort_all_requests) or retract them first")
        if self.released:
            raise ValueError(f"{what}: memory is released ({', '.join(sorted(self.released))}); "
                             "resume it first")

    def _updated(self, version: str | None, flush_cache: bool) -> dict[str, Any]:
        e = self.engine
        if version is not None:
            self.weight_version = version
        if flush_cache and e.cache is not None:
            e.cache.flush()  # nothing runs, so nothing is locked: all of it goes
        e.runner.weights_replaced()  # a load may give a tensor new storage
        return {"success": True, "message": "weights updated",
                "weight_version": self.weight_version}

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 flush_cache: bool = True) -> dict[str, Any]:
        e = self.engine
        self._require_unquantized("update_weights_from_disk")
        self._require_idle("update_weights_from_disk")
        weights.update_from_disk(e.model, e.model_config, Path(model_path))
        self.weights_source = Path(model_path)
        return self._updated(weight_version, flush_cache)

    def update_weights_from_tensor(self, blobs: list[bytes], weight_version: str | None = None,
                                   flush_cache: bool = True) -> dict[str, Any]:
        e = self.engine
        self._require_unquantized("update_weights_from_tensor")
        self._require_idle("update_weights_from_tensor")
        if len(blobs) != 1:
            raise ValueError(f"serialized_named_tensors has {len(blobs)} entries; this server has "
                             "one rank (one entry)")
        pairs = weights.check_update(e.model, weights.load_named_tensors(blobs[0]))
        weights.apply(pairs)
        self.weights_source = None  # the disk copy is no longer what serves
        return self._updated(weight_version, flush_cache)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "gloo") -> Future:
        """Joins the trainer's group as `rank_offset`. The rendezvous waits for the trainer, so
        it runs on a thread and the answer comes when it completes (the engine loop sends it):
        the engine goes on serving meanwhile."""
        import torch.distributed as dist

        e = self.engine
        self._require_single("init_weights_update_group")
        if backend != "gloo" and e.device.type == "cpu":
            raise ValueError(f"backend {backend!r} needs an accelerator; use gloo on CPU")
        if group_name in self.update_groups:
            raise ValueError(f"weight update group {group_name!r} exists; destroy it first")
        if not 1 <= rank_offset < world_size:
            raise ValueError("rank_offset must be in [1, world_size): rank 0 is the trainer")
        if dist.is_initialized() or self.update_groups:
            raise ValueError("one weight update group at a time on this engine")
        future: Future = Future()
        self.update_groups[group_name] = future  # joining: taken; an update waits for it

        def join() -> dict[str, Any]:
            from torch.distributed import distributed_c10d as c10d

            try:
                dist.init_process_group(backend,
                                        init_method=f"tcp://{master_address}:{master_port}",
                                        world_size=world_size, rank=rank_offset,
                                        timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
            except Exception as err:
                self.update_groups.pop(group_name, None)
                # a failed init has counted a group already: the next default group would get
                # another store prefix than the trainer's and never meet it
                if not dist.is_initialized():
                    c10d._world.group_count = 0
                raise ValueError(f"joining {group_name!r} at {master_address}:{master_port} "
                                 f"failed: {err}") from err
            world = dist.group.WORLD
            assert world is not None  # initialized just above
            self.update_groups[group_name] = world
            return {"success": True, "message": f"joined {group_name} as rank {rank_offset}"}

        threading.Thread(target=_settle, args=(future, join), daemon=True,
                         name="weight-update-rendezvous").start()
        return future

    def _group(self, group_name: str, wait: bool = False) -> ProcessGroup:
        """The joined group. While it is still joining: with `wait`, the join is awaited (a
        trainer may send the update before the init's reply reaches it: its broadcast must meet a
        receiver), else refused."""
        if group_name not in self.update_groups:
            raise ValueError(f"no weight update group {group_name!r}: init_weights_update_group "
                             "first")
        group = self.update_groups[group_name]
        if isinstance(group, Future):
            if not wait:
                raise ValueError(f"weight update group {group_name!r} is still waiting for the "
                                 "trainer")
            group.result(timeout=RENDEZVOUS_TIMEOUT_S + 5)  # a failed join raises its error
            return self._group(group_name)
        return group

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: str | None = None,
                                        flush_cache: bool = True) -> dict[str, Any]:
        e = self.engine
        group = self._group(group_name, wait=True)
        try:
            self._require_unquantized("update_weights_from_distributed")
            if "weights" in self.released:  # (and the parameters are empty: no shapes to bound by)
                raise ValueError("update_weights_from_distributed: the weights are released; "
                                 "resume them first")
            largest = max(math.prod(full_shape(v)) for v in weights.update_views(e.model).values()
                          if v is not None)  # (K3's A_log: its stored length; EP: held ones)
            specs = weights.broadcast_specs(names, dtypes, shapes, largest)
        except ValueError as err:
            # the trainer is already broadcasting tensors nobody can receive without their
            # shapes: leaving the group makes its broadcast fail instead of waiting forever
            self.destroy_weights_update_group(group_name)
            raise ValueError(f"{err} (the weight update group was left so the trainer's broadcast "
                             "fails rather than waits: init_weights_update_group again)") from err
        named = weights.receive_distributed(group, specs, e.device)  # all, always
        self._require_idle("update_weights_from_distributed")
        weights.apply(weights.check_update(e.model, named))
        self.weights_source = None
        return self._updated(weight_version, flush_cache)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group",
                                     ) -> dict[str, Any]:
        import torch.distributed as dist

        self._group(group_name)
        del self.update_groups[group_name]
        dist.destroy_process_group()
        return {"success": True, "message": f"left {group_name}"}

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Frees the memory for real: parameters and pool tensors become empty (their sizes are
        kept to restore them); requests meanwhile are refused (503)."""
        e = self.engine
        self._require_single("release_memory_occupation")
        tags = _tags(tags)
        if "weights" in tags:
            self._require_unquantized("release_memory_occupation(weights)")
        if e.has_unfinished():
            raise ValueError("release_memory_occupation needs an idle engine: pause (abort) or "
                             "finish the requests first")
        before = rss_mb()
        if e.runner.graphs is not None:  # captured with the addresses about to be freed
            e.runner.graphs.reset()
        if "kv_cache" in tags and "kv_cache" not in self.released:
            if e.cache is not None:
                e.cache.flush()
            e.blocks.release()
            e.states.release()
            if e.spec is not None:  # a drafter's pages or pools beside the KV blocks
                e.spec.release_memory("kv_cache")
        if "weights" in tags and "weights" not in self.released:
            for p in e.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if e.spec is not None:  # the drafter's own weights (reloaded from its path)
                e.spec.release_memory("weights")
            e.runner.weights_replaced()
        self.released |= set(tags)
        _return_to_os()
        return {"success": True, "message": f"released {tags}", "rss_mb_before": before,
                "rss_mb_after": rss_mb()}

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Restores what was released: the pools zeroed; the weights reloaded from the checkpoint
        they last came from on disk (weights pushed as tensors since must be pushed again: the
        version goes back to the disk one's)."""
        e = self.engine
        tags = _tags(tags)
        before = rss_mb()
        if "kv_cache" in tags and "kv_cache" in self.released:
            e.blocks.resume()
            e.states.resume()
            if e.spec is not None:
                e.spec.resume_memory("kv_cache")
        if "weights" in tags and "weights" in self.released:
            for p, shape in zip(e.model.parameters(), self.param_shapes, strict=True):
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
            source = self.weights_source or e.path
            from kdaserve.models.loader import init_random, load_weights

            if self.weights_source is None and e.config.load_format == "dummy":
                init_random(e.model, e.config.seed)
            else:
                load_weights(e.model, Path(source))
            if self.weights_source is None:
                self.weight_version = "default"
            self.weights_source = Path(source)
            if e.spec is not None:
                e.spec.resume_memory("weights")
            e.runner.weights_replaced()
        self.released -= set(tags)
        return {"success": True, "message": f"resumed {tags}", "rss_mb_before": before,
                "rss_mb_after": rss_mb(), "weight_version": self.weight_version}

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """abort: every request ends now (finish_reason "abort"); retract: running requests go back
        to the queue, freeing their memory, and are recomputed after continue; in_place: they keep
        their caches and simply stop."""
        e = self.engine
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        e.flush()  # the overlapped step's tokens go out now, not after continue_generation
        if mode == "abort":
            for rid in list(e.out.groups):
                e.abort(rid)
        elif mode == "retract":
            e.scheduler.retract_all()
        self.paused = True
        return {"success": True, "message": f"generation paused ({mode})"}

    def continue_generation(self) -> dict[str, Any]:
        self.paused = False
        return {"success": True, "message": "generation continues"}
