"""Engine configuration: `EngineConfig`, the engine's knobs (one CLI flag each in the server),
checked once at construction; what the kernels must have for a model as an engine serves it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from kdaserve.config import MOE, ModelConfig

DEFAULT_DRAFTS = 4  # speculative_num_draft_tokens where unset (ours: drafts a step)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine knobs (one CLI flag each in the server). Pool sizes not given are derived from
    the memory budget at start-up and logged."""

    model: str = "bench"
    device: str = "cpu"
    # None: float32 on CPU, bfloat16 on accelerators; bfloat16 on a CPU is weight-only (the
    # projections' and experts' weights bf16, activations, norms and caches fp32)
    dtype: str | None = None
    # "int8": weight-only int8 on a CPU (projections and experts, a scale per output row)
    quantization: str | None = None
    load_format: str = "auto"
    # serve a K3 checkpoint's text model alone (its vision tensors are never read, images
    # are refused)
    language_model_only: bool = False
    skip_tokenizer_init: bool = False
    kernel_backend: str | None = None
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 64  # running requests at once; also the default number of state slots
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    # prompt tokens a step may run while requests are decoding (None: max_num_batched_tokens):
    # every decoding stream waits for the whole step, so a 2,048-token chunk is a 1 s stall of
    # each stream on a 2-core CPU; idle decoders leave prompts the full budget
    max_prefill_tokens_with_decodes: int | None = None
    # an inter-token-latency target (ms): while requests decode, prompts get the tokens a
    # step-cost model fitted on the engine's own steps says fit beside the decodes within it
    # (engine/prefill_budget.py; at least one block a step); overlap scheduling is off with it
    itl_target_ms: float | None = None
    max_total_tokens: int | None = None  # MLA latent cache capacity in tokens
    num_state_slots: int | None = None
    mem_fraction: float = 0.5  # of physical memory that model + caches may use
    disable_prefix_cache: bool = False
    snapshot_interval: int = 64  # prefix-cache state snapshot grid (tokens), multiple of block
    # a prompt leaves a state snapshot every this many tokens while it prefills (0: only where
    # the cache already knows a fork), so a later request forking anywhere inside it resumes
    # at most this far back; a multiple of snapshot_interval (None: snapshot_interval itself;
    # SGLang's counterpart is its mamba track interval)
    prefill_snapshot_stride: int | None = None
    num_snapshot_slots: int | None = None  # KDA state snapshots the prefix cache may hold
    # "ngram" (prompt lookup), "draft" (a smaller checkpoint with the same vocabulary),
    # "block" (a block drafter on the final hidden state), "dspark" (DSpark: tapped target
    # layers, Markov head, confidence head; ours, or K3's published ones by their config.json)
    # or "dflash" (K3's DFlash); all but ngram load speculative_draft_model. Any case, as
    # SGLang's DSPARK / DFLASH
    speculative_algorithm: str | None = None
    # drafts a step (4 unless set); for K3's published drafters what SGLang means by it: the
    # verify width, gamma + 1 for DSpark, the block size for DFlash (their config's unless set)
    speculative_num_draft_tokens: int | None = None
    # gamma of a published DSpark drafter: its block's rows (its config's block_size unless set)
    speculative_dspark_block_size: int | None = None
    speculative_draft_model: str | None = None  # checkpoint folder (or preset, for "draft")
    # hot-token map (.pt/.json ids, speculative/token_map.py): block/dspark heads cut to them
    speculative_token_map: str | None = None
    # n-gram drafter: suffix n-grams tried from the longest (vLLM's prompt_lookup_max/min)
    speculative_ngram_max: int = 4
    speculative_ngram_min: int = 1
    # adaptive speculation (speculative/adaptive.py): a request whose recent drafts are kept
    # at a lower rate than this decodes without drafts for a while (0: never switched off);
    # no request drafts in a step with more decoding requests than disable_by_batch_size
    speculative_min_acceptance_rate: float = 0.1
    speculative_disable_by_batch_size: int | None = None
    # CUDA graphs for plain decode steps, one per batch-size bucket up to cuda_graph_max_bs
    # (None: max_num_seqs); on by default on CUDA (engine/cuda_graph.py)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # overlap scheduling on CUDA: the host schedules step N+1 while the GPU runs step N
    # (engine/overlap.py); not with speculation, disaggregation, parallel ranks or an ITL
    # target
    disable_overlap_schedule: bool = False
    # Same request, same tokens and logprobs to the bit, whatever it is batched with, chunked
    # into or cached from: every op from the batch-invariant kernels (CPU, fp32)
    enable_deterministic_inference: bool = False
    # prefill/decode disaggregation (SGLang's PD protocol): "prefill" computes prompts and
    # ships their MLA blocks and KDA state to the decode server named by each request's
    # bootstrap fields; "decode" reserves memory, receives them and generates
    disaggregation_mode: str | None = None
    disaggregation_bootstrap_port: int = 8998  # the prefill server's bootstrap endpoint
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_host: str = "127.0.0.1"  # this server's address as peers reach it
    # a transfer not done in this long fails (the peer is slow or gone); a peer not heard
    # from in disaggregation_liveness_s is taken for dead at once
    disaggregation_timeout_s: float = 300.0
    disaggregation_liveness_s: float = 30.0
    # parallelism (SGLang's flags): tp_size ranks hold a slice of every per-head and
    # intermediate tensor each, joined by torch.distributed (gloo on CPU) at dist_init_addr
    # (host:port; default a free local port); nnodes > 1 spreads the ranks over machines,
    # each started with its node_rank (rank 0's node serves HTTP)
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dp_rank: int = 0  # which replica an engine is (set by the server's data-parallel controller)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_prefill_tokens_with_decodes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.itl_target_ms is not None:
            if not 0 < self.itl_target_ms < math.inf:
                raise ValueError(f"itl_target_ms must be a finite number > 0, got "
                                 f"{self.itl_target_ms}")
            # a prefill or decode server never has both kinds of step to balance, and a DP
            # attention rank's step waits for the other ranks' tokens, which it does not count
            if self.disaggregation_mode is not None or self.enable_dp_attention:
                raise ValueError("itl_target_ms does not combine with disaggregation or "
                                 "enable_dp_attention")
        if self.snapshot_interval < 1 or self.snapshot_interval % self.block_size:
            raise ValueError(f"snapshot_interval={self.snapshot_interval} must be a positive "
                             f"multiple of block_size={self.block_size}")
        if self.prefill_snapshot_stride is not None and (
                self.prefill_snapshot_stride < 0
                or self.prefill_snapshot_stride % self.snapshot_interval):
            raise ValueError(f"prefill_snapshot_stride={self.prefill_snapshot_stride} must be 0 "
                             f"or a multiple of snapshot_interval={self.snapshot_interval}")
        if self.speculative_algorithm is not None:  # frozen: set once, here
            object.__setattr__(self, "speculative_algorithm", self.speculative_algorithm.lower())
        if self.speculative_algorithm not in (None, "ngram", "draft", "block", "dspark",
                                              "dflash"):
            raise ValueError(f"speculative_algorithm={self.speculative_algorithm!r} is not "
                             "supported (ngram, draft, block, dspark or dflash)")
        if self.speculative_algorithm in ("draft", "block", "dspark", "dflash") and \
                not self.speculative_draft_model:
            raise ValueError(f"speculative_algorithm={self.speculative_algorithm!r} needs "
                             "speculative_draft_model (a checkpoint folder)")
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 1:
            raise ValueError("speculative_num_draft_tokens must be >= 1")
        if self.speculative_dspark_block_size is not None and (
                self.speculative_algorithm != "dspark" or self.speculative_dspark_block_size < 1):
            raise ValueError("speculative_dspark_block_size (>= 1) applies to "
                             "speculative_algorithm='dspark'")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(f"need 1 <= speculative_ngram_min ({self.speculative_ngram_min}) "
                             f"<= speculative_ngram_max ({self.speculative_ngram_max})")
        if not 0 <= self.speculative_min_acceptance_rate <= 1:
            raise ValueError("speculative_min_acceptance_rate must be in [0, 1]")
        if self.speculative_disable_by_batch_size is not None and \
                self.speculative_disable_by_batch_size < 1:
            raise ValueError("speculative_disable_by_batch_size must be >= 1 (to turn "
                             "speculation off, leave speculative_algorithm unset)")
        # never accepted and ignored: knobs of a drafter that is not in use
        changed = {f.name for f in fields(self)
                   if f.name.startswith("speculative_") and getattr(self, f.name) != f.default}
        if self.speculative_algorithm != "ngram" and \
                changed & {"speculative_ngram_max", "speculative_ngram_min"}:
            raise ValueError("speculative_ngram_max/min apply to speculative_algorithm='ngram'")
        if self.speculative_algorithm not in ("block", "dspark") and \
                self.speculative_token_map is not None:
            raise ValueError("speculative_token_map applies to speculative_algorithm='block' "
                             "or 'dspark' (the drafters with an output head to cut)")
        if self.speculative_algorithm is None and changed & {
                "speculative_min_acceptance_rate", "speculative_disable_by_batch_size"}:
            raise ValueError("speculative_min_acceptance_rate and "
                             "speculative_disable_by_batch_size need a speculative_algorithm")
        if self.cuda_graph_max_bs is not None and (
                self.cuda_graph_max_bs < 1 or self.device == "cpu" or self.disable_cuda_graph
                or self.tp_size > 1 or self.enable_dp_attention):
            raise ValueError("cuda_graph_max_bs (>= 1) sizes the CUDA graphs of a one-rank "
                             "engine on CUDA with graphs enabled; got "
                             f"{self.cuda_graph_max_bs} with device={self.device!r}")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        for name in ("max_total_tokens", "num_state_slots", "num_snapshot_slots"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.device == "cpu" and self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} on a CPU: float32, or bfloat16 (weight-only)")
        if self.quantization not in (None, "int8", "mxfp4"):
            raise ValueError(f"quantization={self.quantization!r} is not supported "
                             "(int8, mxfp4)")
        if self.quantization == "int8" and (self.device != "cpu" or self.dtype
                                            not in (None, "float32")):
            raise ValueError("quantization=int8 is weight-only int8 for the CPU's fp32 path "
                             f"(got device={self.device!r}, dtype={self.dtype!r})")
        if self.enable_deterministic_inference:
            if self.quantization is not None:
                raise ValueError("enable_deterministic_inference runs unquantized weights")
            if self.device != "cpu" or self.dtype not in (None, "float32"):
                raise ValueError("enable_deterministic_inference runs on the CPU in float32 "
                                 f"(got device={self.device!r}, dtype={self.dtype!r})")
            if self.speculative_algorithm is not None:
                # a verify forward scores 1 + k rows of a request where plain decoding scores
                # one: the rows would be batch-invariant but the sampled stream is not the same
                raise ValueError("enable_deterministic_inference does not combine with "
                                 "speculative decoding")
            if self.kernel_backend not in (None, "batch_invariant"):
                raise ValueError("enable_deterministic_inference chooses every kernel itself; "
                                 f"kernel_backend={self.kernel_backend!r} contradicts it")
        self._check_disaggregation()
        self._check_parallel()

    def _check_parallel(self) -> None:
        for name in ("tp_size", "dp_size", "ep_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.enable_dp_attention:
            # every replica runs attention on its own requests; the MoE experts are spread
            # over the replicas (expert parallelism), whose tokens each MoE layer gathers
            if self.dp_size < 2 or self.ep_size not in (1, self.dp_size):
                raise ValueError("enable_dp_attention needs dp_size >= 2 and ep_size equal to "
                                 "it (the experts are spread over the data-parallel ranks)")
            if self.tp_size > 1 or self.nnodes > 1:
                raise ValueError("enable_dp_attention with tp_size or nnodes > 1 is not "
                                 "supported yet")
            if self.disaggregation_mode is not None:
                raise ValueError("enable_dp_attention does not combine with disaggregation yet")
        elif self.ep_size > 1:
            raise ValueError("ep_size > 1 is expert parallelism over DP attention ranks: it "
                             "needs enable_dp_attention")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} outside dp_size={self.dp_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} outside nnodes={self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size={self.tp_size} does not split evenly over "
                             f"nnodes={self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0)")
        if self.dist_init_addr is not None and ":" not in self.dist_init_addr:
            raise ValueError(f"dist_init_addr={self.dist_init_addr!r} is not host:port")
        if self.tp_size > 1:
            if self.device != "cpu":
                raise ValueError("tensor parallelism runs on CPU ranks (gloo) so far")
            if self.disaggregation_mode is not None or self.enable_deterministic_inference:
                raise ValueError("tensor parallelism does not combine with disaggregation or "
                                 "deterministic inference yet")

    def _check_disaggregation(self) -> None:
        if self.disaggregation_mode not in (None, "prefill", "decode"):
            raise ValueError(f"disaggregation_mode={self.disaggregation_mode!r}: prefill or "
                             "decode (or none)")
        if self.disaggregation_transfer_backend != "mooncake":
            # NIXL's PyPI wheels (nixl-cu12, nixl-cu13) are CUDA builds
            raise ValueError(f"disaggregation_transfer_backend="
                             f"{self.disaggregation_transfer_backend!r} is not supported "
                             "(mooncake)")
        if self.disaggregation_mode is None:
            return
        if self.speculative_algorithm is not None:
            raise ValueError("speculative decoding does not combine with disaggregation yet: "
                             "the drafters' own caches are not shipped")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(f"disaggregation_bootstrap_port="
                             f"{self.disaggregation_bootstrap_port} is not a port")
        for name in ("disaggregation_timeout_s", "disaggregation_liveness_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = set(cls.__dataclass_fields__)
        unknown = set(kwargs) - names
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}")
        return cls(**kwargs)


def kernel_features(model: ModelConfig, engine: EngineConfig) -> frozenset[str]:
    """What the kernels must have for this model as this engine serves it: the model's own
    needs, and MXFP4 experts where `--quantization mxfp4` packs them at load."""
    extra = {"mxfp4"} if engine.quantization == "mxfp4" and MOE in model.mlp_types else set()
    return model.kernel_features | extra
