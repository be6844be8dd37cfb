"""Prometheus metrics of the server: engine gauges read at scrape time, latency histograms
measured in the HTTP process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ENGINE_GAUGES = {
    "num_running": "Requests running in the engine",
    "num_waiting": "Requests waiting for admission",
    "free_blocks": "Free MLA latent cache blocks",
    "total_blocks": "MLA latent cache blocks",
    "free_state_slots": "Free KDA state slots",
    "total_state_slots": "KDA state slots",
    "prompt_tokens": "Prompt tokens prefilled (total)",
    "generation_tokens": "Tokens generated (total)",
    "num_preemptions": "Requests preempted (total)",
    "prefix_cache_hit_tokens": "Prompt tokens served from the prefix cache (total)",
    "prefix_cache_queried_tokens": "Prompt tokens looked up in the prefix cache (total)",
    "prefix_cache_hit_rate": "Prefix cache hit tokens / queried tokens",
    "cached_blocks": "MLA latent blocks held by the prefix cache",
    "cached_snapshots": "KDA state snapshots held by the prefix cache",
    "spec_num_verifies": "Speculative verify steps, one per request with drafts (total)",
    "spec_num_drafted": "Speculative tokens drafted (total)",
    "spec_num_accepted": "Speculative tokens accepted (total)",
    "spec_mean_acceptance_length": "Tokens emitted per verify step (accepted + bonus)",
    "spec_num_switched_off": "Times a request stopped drafting for low acceptance (total)",
    "spec_num_batch_skips": "Steps too large a batch decoded without drafts (total)",
    "spec_num_schedule_skips": "Steps not drafted: no draft would pay at the step's cost (total)",
    "spec_num_explorations": "Steps drafted at the schedule's prior after many skips (total)",
    "pd_transfers": "Disaggregated requests whose caches were shipped (total)",
    "pd_failed": "Disaggregated requests failed by a transfer (total)",
    "pd_writes": "Batched writes to decode servers, one per prefill chunk with new blocks (total)",
    "pd_kv_bytes": "MLA latent bytes shipped to decode servers (total)",
    "pd_state_bytes": "KDA state bytes shipped to decode servers (total)",
    "pd_transfer_ms": "Milliseconds spent writing to decode servers (total)",
}

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine = {k: Gauge(f"kdaserve_{k}", doc, registry=self.registry)
                       for k, doc in ENGINE_GAUGES.items()}
        self.ttft = Histogram("kdaserve_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("kdaserve_inter_token_latency_seconds", "Inter-token latency",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kdaserve_e2e_request_latency_seconds", "Request latency",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("kdaserve_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=self.registry)

    def render(self, engine_metrics: dict[str, int]) -> bytes:
        for k, gauge in self.engine.items():
            gauge.set(engine_metrics.get(k, 0))
        return generate_latest(self.registry)
