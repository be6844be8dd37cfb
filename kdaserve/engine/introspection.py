"""What an engine reports about itself: its summary, metrics, pool invariants, the
prefix-cache flush (a mixin of `LLMEngine`, apart so its request path reads alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kdaserve.checkpoint import RANDOM_MARKER
from kdaserve.layers.parallel import COMM


class Introspection:
    # set by LLMEngine
    cache: Any
    spec: Any
    pd: Any
    followers: Any
    ep: Any
    scheduler: Any
    blocks: Any
    states: Any
    groups: dict[str, Any]
    counters: dict[str, int]

    config: Any
    model_config: Any
    model: Any
    device: Any
    path: Any

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    def summary(self) -> str:
        mc = self.model_config
        params = sum(p.numel() for p in self.model.parameters())
        dtypes = "/".join(sorted({str(p.dtype)[6:] for p in self.model.parameters()}))
        text = (f"{params / 1e6:.0f}M parameters ({dtypes}, "
                f"{self.device}), {mc.num_hidden_layers} layers ({len(mc.kda_layers)} KDA + "
                f"{len(mc.mla_layers)} MLA), {mc.num_experts} experts top-"
                f"{mc.num_experts_per_token}, vocab {mc.vocab_size}")
        c = self.config
        if c.tp_size > 1:
            text += f"; tensor parallel over {c.tp_size} ranks (parameters: rank 0's share)"
        if self.ep.size > 1:
            local = self.ep.experts(mc.num_experts)
            text += (f"; DP attention rank {self.ep.rank} of {self.ep.size}, experts "
                     f"{local.start}-{local.stop - 1} here")
        if self.spec is not None:
            src = f", {c.speculative_draft_model}" if c.speculative_draft_model else ""
            text += (f"; speculation {c.speculative_algorithm} (up to {self.spec.drafter.k} "
                     f"drafts{src})")
        if self.config.load_format == "dummy" or (Path(self.path) / RANDOM_MARKER).is_file():
            text += "; RANDOM WEIGHTS (a built-in test model: its text is meaningless)"
        return text

    def flush_cache(self) -> bool:
        """Empties the prefix cache (what running requests lock stays); True if emptied."""
        return self.cache.flush() if self.cache is not None else True

    def get_metrics(self) -> dict[str, int | float]:
        cache = self.cache
        return {
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_cache_queried_tokens": cache.queried_tokens if cache else 0,
            "prefix_cache_hit_rate": cache.hit_tokens / cache.queried_tokens
            if cache and cache.queried_tokens else 0.0,
            "cached_blocks": len(cache.tree_blocks()) if cache else 0,
            "cached_snapshots": cache.num_snapshots if cache else 0,
            "evictable_blocks": cache.evictable_blocks() if cache else 0,
            **(self.spec.metrics() if self.spec is not None else {}),
            **(self.pd.counters if self.pd is not None else {}),
            **(self.followers.metrics() if self.followers is not None else {}),
            **({"ep_all_gather_bytes": COMM.get("all_gather_bytes", 0),
                "ep_all_gather_ms": COMM.get("all_gather_s", 0.0) * 1e3,
                "ep_all_reduce_bytes": COMM["all_reduce_bytes"],
                "ep_all_reduce_ms": COMM["all_reduce_s"] * 1e3} if self.ep.size > 1 else {}),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "free_blocks": self.blocks.num_free,
            "total_blocks": self.blocks.num_blocks,
            "free_state_slots": self.states.num_free,
            "total_state_slots": self.states.num_slots,
            "num_preemptions": self.scheduler.num_preemptions,
            **self.counters,
        }

    def check_integrity(self) -> None:
        """Pool invariants; when idle, every block and state slot is free again or held by
        the prefix cache alone (and free after a flush)."""
        self.scheduler.check_integrity(*(self.pd.held() if self.pd is not None else ([], [])))
        if self.spec is not None:
            self.spec.drafter.check_integrity(idle=not self.has_unfinished())
        if not self.has_unfinished():
            cached_blocks = len(self.cache.tree_blocks()) if self.cache else 0
            cached_slots = self.cache.num_snapshots if self.cache else 0
            assert self.blocks.num_free + cached_blocks == self.blocks.num_blocks, "blocks leaked"
            assert self.states.num_free + cached_slots == self.states.num_slots, "slots leaked"
            assert not self.groups, "finished requests not released"
