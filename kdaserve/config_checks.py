"""EngineConfig's checks of the speculative, parallel and disaggregation options: a value
we do not implement, or a knob of a feature that is not in use, is a ValueError naming it
(never accepted and ignored)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdaserve.config import EngineConfig


def check_speculative(c: EngineConfig) -> None:
    """The drafter's options, and no drafter knob without its drafter."""
    if c.speculative_algorithm is not None:  # frozen: set once, here
        object.__setattr__(c, "speculative_algorithm", c.speculative_algorithm.lower())
    if c.speculative_algorithm not in (None, "ngram", "draft", "block", "dspark", "dflash"):
        raise ValueError(f"speculative_algorithm={c.speculative_algorithm!r} is not "
                         "supported (ngram, draft, block, dspark or dflash)")
    if c.speculative_algorithm in ("draft", "block", "dspark", "dflash") and \
            not c.speculative_draft_model:
        raise ValueError(f"speculative_algorithm={c.speculative_algorithm!r} needs "
                         "speculative_draft_model (a checkpoint folder)")
    if c.speculative_num_draft_tokens is not None and c.speculative_num_draft_tokens < 1:
        raise ValueError("speculative_num_draft_tokens must be >= 1")
    if c.speculative_dspark_block_size is not None and (
            c.speculative_algorithm != "dspark" or c.speculative_dspark_block_size < 1):
        raise ValueError("speculative_dspark_block_size (>= 1) applies to "
                         "speculative_algorithm='dspark'")
    if not 1 <= c.speculative_ngram_min <= c.speculative_ngram_max:
        raise ValueError(f"need 1 <= speculative_ngram_min ({c.speculative_ngram_min}) "
                         f"<= speculative_ngram_max ({c.speculative_ngram_max})")
    if not 0 <= c.speculative_min_acceptance_rate <= 1:
        raise ValueError("speculative_min_acceptance_rate must be in [0, 1]")
    if c.speculative_disable_by_batch_size is not None and \
            c.speculative_disable_by_batch_size < 1:
        raise ValueError("speculative_disable_by_batch_size must be >= 1 (to turn "
                         "speculation off, leave speculative_algorithm unset)")
    # never accepted and ignored: knobs of a drafter that is not in use
    changed = {f.name for f in fields(c)
               if f.name.startswith("speculative_") and getattr(c, f.name) != f.default}
    if c.speculative_algorithm != "ngram" and \
            changed & {"speculative_ngram_max", "speculative_ngram_min"}:
        raise ValueError("speculative_ngram_max/min apply to speculative_algorithm='ngram'")
    if c.speculative_algorithm not in ("block", "dspark") and \
            c.speculative_token_map is not None:
        raise ValueError("speculative_token_map applies to speculative_algorithm='block' "
                         "or 'dspark' (the drafters with an output head to cut)")
    if c.speculative_algorithm is None and changed & {
            "speculative_min_acceptance_rate", "speculative_disable_by_batch_size"}:
        raise ValueError("speculative_min_acceptance_rate and "
                         "speculative_disable_by_batch_size need a speculative_algorithm")


def check_parallel(c: EngineConfig) -> None:
    """Tensor, data and expert parallelism, and the nodes they span."""
    for name in ("tp_size", "dp_size", "ep_size", "nnodes"):
        if getattr(c, name) < 1:
            raise ValueError(f"{name} must be >= 1")
    if c.enable_dp_attention:
        # every replica runs attention on its own requests; the MoE experts are spread
        # over the replicas (expert parallelism), whose tokens each MoE layer gathers
        if c.dp_size < 2 or c.ep_size not in (1, c.dp_size):
            raise ValueError("enable_dp_attention needs dp_size >= 2 and ep_size equal to "
                             "it (the experts are spread over the data-parallel ranks)")
        if c.tp_size > 1 or c.nnodes > 1:
            raise ValueError("enable_dp_attention with tp_size or nnodes > 1 is not "
                             "supported yet")
        if c.disaggregation_mode is not None:
            raise ValueError("enable_dp_attention does not combine with disaggregation yet")
    elif c.ep_size > 1:
        raise ValueError("ep_size > 1 is expert parallelism over DP attention ranks: it "
                         "needs enable_dp_attention")
    if not 0 <= c.dp_rank < c.dp_size:
        raise ValueError(f"dp_rank={c.dp_rank} outside dp_size={c.dp_size}")
    if not 0 <= c.node_rank < c.nnodes:
        raise ValueError(f"node_rank={c.node_rank} outside nnodes={c.nnodes}")
    if c.tp_size % c.nnodes:
        raise ValueError(f"tp_size={c.tp_size} does not split evenly over "
                         f"nnodes={c.nnodes}")
    if c.nnodes > 1 and not c.dist_init_addr:
        raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0)")
    if c.dist_init_addr is not None and ":" not in c.dist_init_addr:
        raise ValueError(f"dist_init_addr={c.dist_init_addr!r} is not host:port")
    if c.tp_size > 1:
        if c.device != "cpu":
            raise ValueError("tensor parallelism runs on CPU ranks (gloo) so far")
        if c.disaggregation_mode is not None or c.enable_deterministic_inference:
            raise ValueError("tensor parallelism does not combine with disaggregation or "
                             "deterministic inference yet")


def check_disaggregation(c: EngineConfig) -> None:
    """Prefill/decode disaggregation's mode, transport and timeouts."""
    if c.disaggregation_mode not in (None, "prefill", "decode"):
        raise ValueError(f"disaggregation_mode={c.disaggregation_mode!r}: prefill or "
                         "decode (or none)")
    if c.disaggregation_transfer_backend != "mooncake":
        # NIXL's PyPI wheels (nixl-cu12, nixl-cu13) are CUDA builds
        raise ValueError(f"disaggregation_transfer_backend="
                         f"{c.disaggregation_transfer_backend!r} is not supported "
                         "(mooncake)")
    if c.disaggregation_mode is None:
        return
    if c.speculative_algorithm is not None:
        raise ValueError("speculative decoding does not combine with disaggregation yet: "
                         "the drafters' own caches are not shipped")
    if not 0 < c.disaggregation_bootstrap_port < 65536:
        raise ValueError(f"disaggregation_bootstrap_port="
                         f"{c.disaggregation_bootstrap_port} is not a port")
    for name in ("disaggregation_timeout_s", "disaggregation_liveness_s"):
        if getattr(c, name) <= 0:
            raise ValueError(f"{name} must be > 0")
