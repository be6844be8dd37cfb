"""What an engine reports about itself: its summary, metrics, pool invariants, the
prefix-cache flush (an object the engine holds, apart so its request path reads alone)."""

from __future__ import annotations

from pathlib import Path

from kdaserve.checkpoint import RANDOM_MARKER
from kdaserve.engine.parts import EngineParts
from kdaserve.layers.parallel import COMM


class Introspection:
    """What an engine reports about itself, read from the engine it is given."""

    def __init__(self, engine: EngineParts) -> None:
        self.engine = engine

    def summary(self) -> str:
        e = self.engine
        mc = e.model_config
        params = sum(p.numel() for p in e.model.parameters())
        dtypes = "/".join(sorted({str(p.dtype)[6:] for p in e.model.parameters()}))
        text = (f"{params / 1e6:.0f}M parameters ({dtypes}, "
                f"{e.device}), {mc.num_hidden_layers} layers ({len(mc.kda_layers)} KDA + "
                f"{len(mc.mla_layers)} MLA), {mc.num_experts} experts top-"
                f"{mc.num_experts_per_token}, vocab {mc.vocab_size}")
        c = e.config
        if c.tp_size > 1:
            text += f"; tensor parallel over {c.tp_size} ranks (parameters: rank 0's share)"
        if e.ep.size > 1:
            local = e.ep.experts(mc.num_experts)
            text += (f"; DP attention rank {e.ep.rank} of {e.ep.size}, experts "
                     f"{local.start}-{local.stop - 1} here")
        if e.spec is not None:
            src = f", {c.speculative_draft_model}" if c.speculative_draft_model else ""
            text += (f"; speculation {c.speculative_algorithm} (up to {e.spec.drafter.k} "
                     f"drafts{src})")
        if e.config.load_format == "dummy" or (Path(e.path) / RANDOM_MARKER).is_file():
            text += "; RANDOM WEIGHTS (a built-in test model: its text is meaningless)"
        return text

    def flush_cache(self) -> bool:
        """Empties the prefix cache (what running requests lock stays); True if emptied."""
        e = self.engine
        return e.cache.flush() if e.cache is not None else True

    def metrics(self) -> dict[str, int | float]:
        e = self.engine
        cache = e.cache
        return {
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_cache_queried_tokens": cache.queried_tokens if cache else 0,
            "prefix_cache_hit_rate": cache.hit_tokens / cache.queried_tokens
            if cache and cache.queried_tokens else 0.0,
            "cached_blocks": len(cache.tree_blocks()) if cache else 0,
            "cached_snapshots": cache.num_snapshots if cache else 0,
            "evictable_blocks": cache.evictable_blocks() if cache else 0,
            **(e.spec.metrics() if e.spec is not None else {}),
            **(e.pd.counters if e.pd is not None else {}),
            **(e.followers.metrics() if e.followers is not None else {}),
            **({"ep_all_gather_bytes": COMM.get("all_gather_bytes", 0),
                "ep_all_gather_ms": COMM.get("all_gather_s", 0.0) * 1e3,
                "ep_all_reduce_bytes": COMM["all_reduce_bytes"],
                "ep_all_reduce_ms": COMM["all_reduce_s"] * 1e3} if e.ep.size > 1 else {}),
            "num_running": len(e.scheduler.running),
            "num_waiting": len(e.scheduler.waiting),
            "free_blocks": e.blocks.num_free,
            "total_blocks": e.blocks.num_blocks,
            "free_state_slots": e.states.num_free,
            "total_state_slots": e.states.num_slots,
            "num_preemptions": e.scheduler.num_preemptions,
            **e.out.counters,
        }

    def check_integrity(self) -> None:
        """Pool invariants; when idle, every block and state slot is free again or held by
        the prefix cache alone (and free after a flush)."""
        e = self.engine
        e.scheduler.check_integrity(*(e.pd.held() if e.pd is not None else ([], [])))
        if e.spec is not None:
            e.spec.drafter.check_integrity(idle=not e.has_unfinished())
        if not e.has_unfinished():
            cached_blocks = len(e.cache.tree_blocks()) if e.cache else 0
            cached_slots = e.cache.num_snapshots if e.cache else 0
            assert e.blocks.num_free + cached_blocks == e.blocks.num_blocks, "blocks leaked"
            assert e.states.num_free + cached_slots == e.states.num_slots, "slots leaked"
            assert not e.out.groups, "finished requests not released"
