"""`--dp-size N`: N engine processes behind one HTTP server, each a whole replica (its own
scheduler, requests, block and state pools, prefix cache; `--tp-size` ranks of its own), and
the controller that gives each request to one of them (SGLang's DataParallelController).

Policies: `shortest_queue` (fewest requests in flight, the default), `round_robin`, and
`prefix` (the same leading tokens go to the same replica, so its prefix cache sees them all,
unless that replica has twice the average load). A request's `data_parallel_rank` (what
`sglang-router --dp-aware` sends) names the replica itself. The replicas split the memory
budget (`mem_fraction` / N each). Calls that change state (flush, pause) go to every replica;
metrics are summed. With `--enable-dp-attention` the replicas are one group: each runs
attention on its own requests, and the MoE experts are spread over them (each MoE layer
gathers every replica's tokens, every step, see `ExpertParallel`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from kdaserve.client.engine_process import EngineProcess
from kdaserve.client.request_client import EngineError, RequestClient
from kdaserve.engine.tensor_parallel import free_local_addr
from kdaserve.engine_config import EngineConfig
from kdaserve.multimodal import ImageInputs
from kdaserve.request import RequestOptions, RequestOutput, SamplingParams

POLICIES = ("shortest_queue", "round_robin", "prefix")
PREFIX_TOKENS = 64  # leading tokens that choose the replica under the prefix policy
# calls that change what every replica serves; any other by-name call is refused with dp > 1
EVERY_REPLICA = ("flush_cache", "check_integrity", "pause_generation", "continue_generation")


class DataParallel(RequestClient):
    def __init__(self, config: EngineConfig, max_restarts: int,
                 on_fatal: Callable[[str], None] | None, policy: str = "shortest_queue") -> None:
        if policy not in POLICIES:
            raise ValueError(f"--load-balance-method {policy!r}: one of {', '.join(POLICIES)}")
        n = config.dp_size
        if config.enable_dp_attention:
            # one group: each engine is a rank whose MoE layers run with the others' every
            # step; a rank that dies breaks the group, so none is restarted alone
            config = with_free_addr(config)
            replicas = [dataclasses.replace(config, dp_rank=r, mem_fraction=config.mem_fraction
                                            / n) for r in range(n)]
            max_restarts = 0
        else:
            replicas = [dataclasses.replace(config, dp_size=1,
                                            mem_fraction=config.mem_fraction / n)] * n
        self.engines = [EngineProcess(r, max_restarts, on_fatal) for r in replicas]
        self.policy = policy
        self._next = itertools.cycle(range(n))
        self.owner: dict[str, int] = {}  # request id -> replica, while in flight
        self.on_restart: list[Callable[[], None]] = []
        for e in self.engines:
            e.on_restart.append(lambda: [fn() for fn in self.on_restart])
        self.info: dict[str, Any] = {}

    # ---- life cycle (EngineProcess's surface, for every replica) ----
    @property
    def stopping(self) -> bool:
        return self.engines[0].stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        for e in self.engines:
            e.stopping = value

    async def start(self) -> None:
        await asyncio.gather(*(e.start() for e in self.engines))
        first = self.engines[0].info
        self.info = {**first, "max_request_tokens": min(
            e.info["max_request_tokens"] for e in self.engines),
            "summary": f"{first['summary']}; data parallel over {len(self.engines)} replicas"}

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self.engines))

    def fail_all(self, message: str, status: int = 503) -> None:
        for e in self.engines:
            e.fail_all(message, status)

    def problem(self, stuck_after: float) -> str | None:
        for r, e in enumerate(self.engines):
            why = e.problem(stuck_after)
            if why:
                return f"data-parallel replica {r}: {why}"
        return None

    # ---- requests ----
    def pick(self, prompt: str | list[int], options: RequestOptions) -> int:
        n = len(self.engines)
        rank = options.data_parallel_rank
        if rank is not None:
            if not 0 <= rank < n:
                raise EngineError(f"data_parallel_rank {rank} outside dp_size {n}", 400)
            return rank
        loads = [len(e._streams) for e in self.engines]
        turn = next(self._next)
        if self.policy == "round_robin":
            return turn
        if self.policy == "prefix":
            head = prompt[:PREFIX_TOKENS * 4] if isinstance(prompt, str) \
                else prompt[:PREFIX_TOKENS]
            r = int.from_bytes(hashlib.blake2b(repr(head).encode(), digest_size=8).digest(),
                               "big") % n
            if loads[r] <= 2 * (sum(loads) / n) + 1:
                return r
        return min(range(n), key=lambda i: (loads[i], (i - turn) % n))  # ties take turns

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          rid: str | None = None, options: RequestOptions | None = None,
                          images: ImageInputs | None = None,
                          ) -> tuple[str, AsyncIterator[RequestOutput]]:
        options = options or RequestOptions()
        r = self.pick(prompt, options)
        # the replica is one engine of its own: the rank was for us
        rid, stream = await self.engines[r].add_request(
            prompt, params, rid, dataclasses.replace(options, data_parallel_rank=None), images)
        self.owner[rid] = r
        return rid, self._forget_when_done(rid, stream)

    async def _forget_when_done(self, rid: str, stream: AsyncIterator[RequestOutput]
                                ) -> AsyncIterator[RequestOutput]:
        try:
            async for out in stream:
                yield out
        finally:
            self.owner.pop(rid, None)
            await stream.aclose()  # type: ignore[attr-defined]

    async def abort(self, rid: str) -> None:
        r = self.owner.pop(rid, None)
        if r is not None:
            await self.engines[r].abort(rid)

    # ---- calls ----
    async def call(self, method: str, *args: Any) -> Any:
        if method in ("weight_version", "model_info"):
            return await self.engines[0].call(method, *args)
        if method == "get_metrics":
            return merge_metrics(await asyncio.gather(*(e.get_metrics() for e in self.engines)))
        if method not in EVERY_REPLICA:
            raise EngineError(f"{method} is not supported with dp_size > 1 yet", 400)
        results = await asyncio.gather(*(e.call(method, *args) for e in self.engines))
        if method == "flush_cache":
            return all(results)
        return results[0]


def with_free_addr(c: EngineConfig) -> EngineConfig:
    if c.dist_init_addr:
        return c
    return dataclasses.replace(c, dist_init_addr=free_local_addr())


def merge_metrics(per_replica: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and gauges summed over replicas; rates recomputed from the sums."""
    out: dict[str, Any] = {}
    for m in per_replica:
        for k, v in m.items():
            if isinstance(v, int | float):
                out[k] = out.get(k, 0) + v
    queried = out.get("prefix_cache_queried_tokens", 0)
    out["prefix_cache_hit_rate"] = out.get("prefix_cache_hit_tokens", 0) / queried \
        if queried else 0.0
    if "spec_mean_acceptance_length" in out:
        out["spec_mean_acceptance_length"] /= len(per_replica)
    out["dp_size"] = len(per_replica)
    out["replicas"] = per_replica  # /get_server_info's internal_states, one per replica
    return out
