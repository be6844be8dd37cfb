"""Model configuration: one `ModelConfig` translated once from a checkpoint's config.json.

Two schemas exist in the wild: Moonshot's hub schema (`linear_attn_config` with 1-indexed layer
lists, `first_k_dense_replace`, `moe_layer_freq`) and transformers' (`layer_types`,
`mlp_layer_types`, `linear_*`). Both map to the same frozen dataclass; nothing downstream reads
raw HF names.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kdaserve.hub_schema import (
    DENSE,
    KDA,
    MLA,
    MOE,
    MXFP4_GROUP,
    expert_format_of,
    k3_fields,
    layer_types_of,
    mlp_types_of,
    reject_unsupported,
    require,
    text_config_of,
)
from kdaserve.vision_config import VisionConfig

__all__ = ["DENSE", "KDA", "MLA", "MOE", "EngineConfig", "ModelConfig"]

@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # KDA or MLA per layer, 0-indexed
    mlp_types: tuple[str, ...]  # DENSE or MOE per layer
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_size: int
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    router_activation: str  # "sigmoid" or "softmax"
    moe_renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    checkpoint_dtype: str = "bfloat16"
    # Kimi K3 (k3_spec.md); the defaults are Kimi Linear
    hidden_act: str = "silu"  # "situ": SiTU-GLU (soft-capped gate and linear branches)
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None  # Attention Residuals: layers per bank block
    routed_expert_hidden_size: int | None = None  # LatentMoE: experts run at this width
    latent_moe_use_norm: bool = False  # RMSNorm on the latent expert sum
    mla_use_output_gate: bool = False  # sigmoid(g_proj(x)) on MLA's output
    kda_gate_lower_bound: float | None = None  # KDA decay lb * sigmoid(...) instead of softplus
    kda_full_rank_gate: bool = False  # KDA output gate g_proj [P, D] instead of g_a/g_b
    # "language_model." for K3's KimiK3ForConditionalGeneration checkpoints
    tensor_prefix: str = ""
    vision: VisionConfig | None = None  # the checkpoint also holds a vision tower (K3)
    # "mxfp4": the routed experts stored (and held) as compressed-tensors' packed MXFP4
    # (kernels/ref/mxfp4.py); None: stored as floats
    expert_format: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config has {len(self.layer_types)} layer types for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        if len(self.mlp_types) != self.num_hidden_layers:
            raise ValueError(
                f"config has {len(self.mlp_types)} mlp types for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        for i, t in enumerate(self.layer_types):
            if t not in (KDA, MLA):
                raise ValueError(f"layer {i}: unknown attention type {t!r}")
        if MOE in self.mlp_types:
            if self.num_experts_per_token > self.num_experts:
                raise ValueError(
                    f"num_experts_per_token={self.num_experts_per_token} > "
                    f"num_experts={self.num_experts}"
                )
            if self.num_experts % self.num_expert_group:
                raise ValueError(
                    f"num_experts={self.num_experts} not divisible by "
                    f"num_expert_group={self.num_expert_group}"
                )
            if self.topk_group > self.num_expert_group:
                raise ValueError(
                    f"topk_group={self.topk_group} > num_expert_group={self.num_expert_group}"
                )
        if self.router_activation not in ("sigmoid", "softmax"):
            raise ValueError(
                f"moe_router_activation_func={self.router_activation!r} is not supported "
                "(sigmoid or softmax)"
            )
        if self.expert_format not in (None, "mxfp4"):
            raise ValueError(f"expert_format={self.expert_format!r} is not supported (mxfp4)")
        if self.expert_format == "mxfp4":
            width = self.routed_expert_hidden_size or self.hidden_size
            for name, n in (("the experts' input width", width),
                            ("moe_intermediate_size", self.moe_intermediate_size)):
                if n % MXFP4_GROUP:
                    raise ValueError(f"MXFP4 experts: {name} = {n} is not a multiple of "
                                     f"{MXFP4_GROUP}")

    # ---- derived sizes (properties, never stored) ----
    @property
    def has_vision_tower(self) -> bool:
        return self.vision is not None

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MLA]

    @property
    def kda_dim(self) -> int:
        """P = H * K: width of the q/k/v projections of a KDA layer."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kernel_features(self) -> frozenset[str]:
        """What this model needs of the kernels beyond Kimi Linear's ops (kernels.FEATURE_OPS)."""
        needs = set()
        if self.kda_gate_lower_bound is not None and KDA in self.layer_types:
            needs.add("kda_lower_bound")
        if self.hidden_act == "situ" and MOE in self.mlp_types:
            needs.add("situ")
        if self.expert_format == "mxfp4" and MOE in self.mlp_types:
            needs.add("mxfp4")
        return frozenset(needs)

    @property
    def has_k3_layers(self) -> bool:
        """Whether any of K3's layer changes is on (the native one-call decode has none)."""
        return bool(self.kernel_features) or self.hidden_act != "silu" or any((
            self.attn_res_block_size, self.routed_expert_hidden_size, self.mla_use_output_gate,
            self.kda_full_rank_gate))

    @property
    def latent_dim(self) -> int:
        """Values cached per token per MLA layer: normalised latent + shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ---- loading ----
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        with open(config_path) as f:
            raw = json.load(f)
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        text, vision = text_config_of(raw)
        wrapped = text is not raw
        expert_format = expert_format_of(text) or expert_format_of(raw)
        raw = text
        reject_unsupported(raw)
        n = require(raw, "num_hidden_layers")
        lac = raw.get("linear_attn_config") or {}
        k3 = k3_fields(raw, lac)
        layer_types = layer_types_of(raw, lac, n)
        mlp_types = mlp_types_of(raw, n)
        num_experts = raw.get("num_experts", raw.get("num_local_experts")) or 0
        grouped = raw.get("use_grouped_topk", True)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=require(raw, "vocab_size"),
            hidden_size=require(raw, "hidden_size"),
            num_hidden_layers=n,
            layer_types=layer_types,
            mlp_types=mlp_types,
            intermediate_size=raw.get("intermediate_size", 0),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            kda_num_heads=lac.get("num_heads", raw.get("linear_num_heads", 32)),
            kda_head_dim=lac.get("head_dim", raw.get("linear_head_dim", 128)),
            kda_conv_size=lac.get("short_conv_kernel_size", raw.get("linear_conv_kernel_dim", 4)),
            num_attention_heads=require(raw, "num_attention_heads"),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw.get("kv_lora_rank", 512),
            qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=raw.get("qk_rope_head_dim", 64),
            v_head_dim=raw.get("v_head_dim", 128),
            num_experts=num_experts,
            num_experts_per_token=raw.get("num_experts_per_token",
                                          raw.get("num_experts_per_tok", 8)),
            num_shared_experts=raw.get("num_shared_experts", raw.get("n_shared_experts", 0)) or 0,
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            router_activation=raw.get("moe_router_activation_func", "sigmoid"),
            moe_renormalize=raw.get("moe_renormalize", raw.get("norm_topk_prob", True)),
            routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
            num_expert_group=(raw.get("num_expert_group", raw.get("n_group", 1)) or 1)
            if grouped else 1,
            topk_group=(raw.get("topk_group", 1) or 1) if grouped else 1,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
            checkpoint_dtype=raw.get("torch_dtype", raw.get("dtype")) or "bfloat16",
            tensor_prefix="language_model." if wrapped else "",
            vision=None if vision is None else VisionConfig.from_dict(
                vision, require(raw, "hidden_size"), vision.get("media_placeholder_token_id")),
            expert_format=expert_format,
            **k3,
        )

    def summary(self) -> str:
        d = asdict(self)
        d.pop("extra")
        return ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("layer_types", "mlp_types"))


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
