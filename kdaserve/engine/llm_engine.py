"""LLMEngine: add_request / abort / step; owns the model, pools, scheduler and sampler.

One `step()` = schedule -> one forward (mixed decodes and prefill chunks) -> sample -> stop
checks -> free finished requests. Both the blocking `LLM` and the async server loop drive it.
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from kdaserve.cache.radix_cache import RadixCache
from kdaserve.checkpoint import resolve_model_path
from kdaserve.config import ModelConfig
from kdaserve.engine.cuda_graph import graph_runner
from kdaserve.engine.disaggregation import DecodeSide, PrefillSide, SideHost, make_side
from kdaserve.engine.grammar import (
    GrammarBackend,
    apply_bitmask,
    check_sampled,
    constrain,
    needs_mask,
)
from kdaserve.engine.image_intake import ImageIntake
from kdaserve.engine.introspection import Introspection
from kdaserve.engine.lifecycle import LoadProgress, kernel_summary, phase, weights_summary
from kdaserve.engine.model_runner import ModelRunner, StepOutput
from kdaserve.engine.outputs import OutputProcessor, group_id
from kdaserve.engine.overlap import OverlapPipeline, overlappable
from kdaserve.engine.pools import make_pools, num_snapshot_slots
from kdaserve.engine.prefill_budget import PrefillBudget
from kdaserve.engine.rl import EngineAsleep, RLControl
from kdaserve.engine.sampler import Sampler
from kdaserve.engine.scheduler import Scheduler
from kdaserve.engine.tensor_parallel import Followers, join_expert_parallel, with_init_addr
from kdaserve.engine_config import EngineConfig, kernel_features
from kdaserve.image_processor import ProcessorConfig
from kdaserve.kernels import resolve_kernels
from kdaserve.kernels.host_memory import keep_freed_memory
from kdaserve.layers.parallel import SINGLE, SINGLE_EP
from kdaserve.models.loader import build_model
from kdaserve.models.vision import load_vision, tower_dtype
from kdaserve.multimodal import ImageInputs
from kdaserve.request import Request, RequestOptions, RequestOutput, SamplingParams
from kdaserve.scheduled_batch import ScheduledBatch
from kdaserve.speculative.acceptance import trim_drafts
from kdaserve.speculative.build import build_speculator, draft_memory, draft_model_path
from kdaserve.speculative.verify import Verified
from kdaserve.step_record import StepRecord
from kdaserve.tokenizer import Tokenizer

logger = logging.getLogger("kdaserve")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.dp_size > 1 and not config.enable_dp_attention:
            raise ValueError("dp_size > 1 runs one engine per replica behind `kdaserve serve`'s "
                             "data-parallel controller; an engine is one replica")
        self.config = config
        with phase("config") as p:
            self.path = resolve_model_path(config.model)
            self.model_config = ModelConfig.from_pretrained(self.path)
            self.draft_path = draft_model_path(config)
            self.device = torch.device(config.device)
            if self.device.type == "cuda" and self.device.index is not None:
                torch.cuda.set_device(self.device)  # Triton launches and graphs use it
            # bf16 matmul is ~200x slower than fp32 on common CPUs: there activations and
            # caches stay fp32 and bfloat16 means weight-only bf16 (projections and experts)
            asked = getattr(torch, config.dtype) if config.dtype else (
                torch.float32 if self.device.type == "cpu" else torch.bfloat16)
            self.weight_dtype = asked
            self.dtype = torch.float32 if self.device.type == "cpu" else asked
            p.note = (f"{self.path}, {self.model_config.num_hidden_layers} layers, on "
                      f"{self.device} ({str(self.dtype).removeprefix('torch.')})")
        with phase("kernels") as p:  # includes compiling the native CPU kernels, once
            self.kernels = resolve_kernels(self.device, config.kernel_backend,
                                           config.enable_deterministic_inference,
                                           kernel_features(self.model_config, config))
            p.note = kernel_summary(self.kernels)
        keep_freed_memory()  # a step's large temporaries reuse the last step's pages
        self.followers: Followers | None = None  # tensor-parallel ranks 1.., when tp_size > 1
        # DP attention: this engine is one rank of a group whose MoE layers it joins every
        # step (an empty forward when it has nothing to run but another rank has)
        self.ep = join_expert_parallel(config) if config.enable_dp_attention else SINGLE_EP
        self.lockstep_idle = True  # the last step ran nothing on any rank
        if config.tp_size > 1:
            config = self.config = with_init_addr(config)
            self.followers = Followers(config)
        try:
            self._build(config)
        except BaseException:
            if self.followers is not None:  # they wait for our pools: release them
                self.followers.stop()
            raise
        # deterministic inference: each image in a tower call of its own, so that no other
        # image changes its rows (a call's GEMM blocking could)
        self.runner = ModelRunner(self.model, self.blocks, self.states, self.device,
                                  self.followers, self.vision,
                                  config.enable_deterministic_inference)
        with phase("warm-up") as p:
            self.runner.graphs = graph_runner(config, self.kernels, self.model, self.states,
                                              self.blocks, self.scheduler.max_num_seqs,
                                              self.scheduler.max_request_tokens())
            self.spec = None
            if config.speculative_algorithm is not None:
                self.spec = build_speculator(
                    config, self.draft_path, self.model, self.kernels, self.dtype, self.device,
                    self.states, self.blocks, self.cache, self.scheduler.max_num_seqs,
                    graphs=self.runner.graphs is not None)
                self.scheduler.hooks = self.spec
            # nothing runs ahead of the first request: CUDA graphs are captured on first use
            # of each batch size, and an eager forward needs no warming
            p.note = ("CUDA graphs, captured on first use" if self.runner.graphs else
                      f"none (eager forward on {self.device.type})") + \
                (f"; {config.speculative_algorithm} drafter built" if self.spec else "")
        self._grammar: GrammarBackend | None = None  # built on the first constrained request
        stop_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        self.stop_ids = frozenset(stop_ids)
        self.sampler = Sampler(self.stop_ids)
        # the requests, their tokens and updates; the overlapped step's pipeline beside
        self.out = OutputProcessor(self.scheduler, self.stop_ids, self.tokenizer,
                                   self.model.compute_logits)
        self.pipeline = OverlapPipeline(self.runner, self.sampler, self.out)
        self.rl = RLControl(self)  # weight updates, sleep and wake, pause
        self.report = Introspection(self)
        self.pd = make_side(SideHost(  # prefill/decode disaggregation, when a side
            config, self.model_config, self.model, self.blocks, self.states, self.cache,
            self.scheduler, self.out))
        # overlap scheduling (engine/overlap.py) where the forward runs asynchronously: on a
        # CPU it is synchronous and the order gains nothing (tests set this to run it there)
        self.overlap = (self.device.type == "cuda" and not config.disable_overlap_schedule
                        and self.spec is None and self.pd is None and self.ep.size == 1
                        and self.followers is None and config.itl_target_ms is None)
        self.images = ImageIntake(
            None if self.vision is None else self.vision.config.media_pad_id, self.tokenizer,
            self.image_refusal(), ProcessorConfig.from_pretrained(self.path)
            if self.vision is not None else ProcessorConfig())
        torch.manual_seed(config.seed)  # unseeded sampling: reproducible per engine run

    def _build(self, config: EngineConfig) -> None:
        """The model, tokenizer and pools (the part of start-up the followers wait on)."""
        with phase("weights") as p:
            progress = LoadProgress()
            try:
                self.model = build_model(
                    self.model_config, self.kernels, self.dtype, self.device, self.path,
                    config.load_format, config.seed, self.weight_dtype, config.quantization,
                    self.followers.tp if self.followers else SINGLE, self.ep, progress)
                try:
                    self.vision = None if config.language_model_only else load_vision(
                        self.model_config, self.path, config.load_format, config.seed,
                        tower_dtype(self.weight_dtype, self.device), self.device,
                        config.kernel_backend)
                except ValueError as e:
                    raise ValueError(f"{e} (--language-model-only serves the text model "
                                     "alone)") from None
            finally:
                progress.close()
            p.note = weights_summary(self.model, config.load_format) + \
                (", vision tower" if self.vision is not None else "")
        self.tokenizer = (None if config.skip_tokenizer_init
                          else Tokenizer.from_pretrained(self.path))
        if self.tokenizer is not None and \
                self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} token ids but the "
                             f"model's vocabulary is {self.model_config.vocab_size}: ids past it "
                             "have no embedding (a tokenizer from another model?)")
        with phase("pools") as p:  # their sizes: make_pools's own log line
            self.blocks, self.states = make_pools(
                config, self.model_config, self.model, self.dtype, self.device,
                draft_memory(config, self.draft_path, self.model_config, self.dtype))
            p.note = f"{self.blocks.num_blocks} KV blocks, {self.states.num_slots} state slots"
        if self.followers is not None:
            self.followers.start(self.blocks, self.states)
        self.cache = None if config.disable_prefix_cache else RadixCache(self.blocks, self.states)
        # running requests: at most one per working state slot
        max_running = min(config.max_num_seqs, config.num_state_slots or config.max_num_seqs)
        self.scheduler = Scheduler(self.blocks, self.states, max_running,
                                   config.max_num_batched_tokens, self.cache,
                                   config.snapshot_interval, num_snapshot_slots(config),
                                   config.snapshot_interval
                                   if config.prefill_snapshot_stride is None
                                   else config.prefill_snapshot_stride,
                                   config.max_prefill_tokens_with_decodes)
        if config.itl_target_ms is not None:
            self.scheduler.itl_budget = PrefillBudget(config.itl_target_ms / 1e3,
                                                      config.block_size)

    # ---- set-up ----
    def grammar_backend(self) -> GrammarBackend:
        if self._grammar is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer, but the engine was "
                                 "created with skip_tokenizer_init=True")
            self._grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size,
                                           sorted(self.stop_ids))
        return self._grammar

    # ---- requests ----
    def image_refusal(self) -> str | None:
        """Why this engine takes no images (None: it takes them)."""
        if self.vision is None:
            return ("this model takes no images" if self.model_config.vision is None
                    else "images: the server runs the text model only (--language-model-only)")
        if self.tokenizer is None:
            return "images need the tokenizer (their prompts are text)"
        return None

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, but the engine was created "
                                 "with skip_tokenizer_init=True; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("empty prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} outside the vocabulary of {vocab}")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    rid: str | None = None, options: RequestOptions | None = None,
                    images: ImageInputs | None = None) -> str:
        """images: the prompt's images, already in it (`ImageIntake.expand`, multimodal.py)."""
        params, options = params or SamplingParams(), options or RequestOptions()
        if self.rl.released:
            released = ", ".join(sorted(self.rl.released))
            raise EngineAsleep(f"the engine's memory is released ({released}): "
                               "resume_memory_occupation first")
        rid = rid or uuid.uuid4().hex
        if rid in self.out.groups:
            raise ValueError(f"request id {rid!r} is already in use")
        ids = self.encode(prompt)
        self.images.check(ids, images)
        vocab = self.model_config.vocab_size
        for name, toks in (("logit_bias", params.logit_bias),
                           ("token_ids_logprob", params.token_ids_logprob)):
            bad = [t for t in toks if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]!r} outside the vocabulary of {vocab}")
        if options.return_routed_experts and options.routed_experts_start > len(ids):
            raise ValueError(f"routed_experts_start_len ({options.routed_experts_start}) is past "
                             f"the prompt's {len(ids)} tokens")
        if params.logprob_start_len > len(ids):
            raise ValueError(f"logprob_start_len ({params.logprob_start_len}) is past the "
                             f"prompt's {len(ids)} tokens")
        if (options.bootstrap is None) != (self.pd is None):
            raise ValueError("bootstrap_host/port/room are set by the PD router for a prefill or "
                             "decode server" if self.pd is not None else
                             "bootstrap_room is for prefill/decode disaggregation; this server "
                             "is not in disaggregation mode")
        if options.data_parallel_rank not in (None, 0):
            raise ValueError(f"data_parallel_rank {options.data_parallel_rank}: this engine is "
                             "a single replica (dp_size 1)")
        if self.pd is not None and (params.n != 1 or options.return_hidden_states
                                    or options.return_routed_experts):
            raise ValueError("n > 1, return_hidden_states and return_routed_experts are not "
                             "supported with disaggregation")
        if images is not None:
            images.pending = params.n
        children = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed((params.seed * 1_000_003 + i) % 2**64)
            children.append(Request(rid if params.n == 1 else f"{rid}-{i}", ids, params,
                                    options, generator=gen, images=images))
        # the siblings share the prompt: one scores it (on the prefill side, when disaggregated)
        if params.prompt_logprobs is not None and not isinstance(self.pd, DecodeSide):
            children[0].prompt_logprobs = [None] if params.logprob_start_len == 0 else []
        need = len(ids) + params.max_tokens
        if need > self.scheduler.max_request_tokens():
            self.scheduler.add(children[0])  # raises the descriptive ValueError
        if params.grammar is not None:  # compiled (and so checked) before anything is queued
            backend = self.grammar_backend()
            for child in children:
                child.matcher = backend.matcher(params.grammar)
        for child in children:
            (self.pd.add if self.pd is not None else self.scheduler.add)(child)
        self.out.add(rid, children, serial=not overlappable(children[0]))
        return rid

    def abort(self, rid: str) -> bool:
        if rid not in self.out.groups:
            return False
        self.flush()  # its tokens so far, read
        children = self.out.groups.get(rid)
        if children is None:  # the token in flight ended it: its final output is queued
            return True
        # the final output below holds what that read added: no update before it
        self.out.pending = [o for o in self.out.pending if o.rid != rid]
        for child in children:
            if self.pd is not None:
                self.pd.abort(child)
            if not child.is_finished:
                self.scheduler.finish(child, "abort")
        self.out.counters["num_aborted"] += 1
        self.out.pending.append(self.out.group_output(rid))
        self.out.forget(rid)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.pipeline.inflight is not None or (
            self.pd is not None and self.pd.busy())

    def flush(self) -> None:
        """Reads the overlapped step in flight (its updates come with the next step)."""
        self.pipeline.flush()

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns an update for every request that progressed or finished."""
        step_started = time.perf_counter()  # what each decoding stream waits, drafting included
        overlap = self.overlap and not self.out.serial
        outputs = self._before_schedule(overlap)
        started = time.perf_counter()  # drafting is timed apart (Speculator.draft_seconds)
        batch = ScheduledBatch() if self.rl.paused else self.scheduler.schedule()
        if self.ep.size > 1 and not self._lockstep(batch):
            return outputs
        if batch.is_empty:
            self.flush()
            return outputs + self.out.drain()
        prompt_tokens = self._count_prompt_tokens(batch)
        if overlap:
            return outputs + self.pipeline.step(batch)
        run, verified = self._forward_and_verify(batch)
        touched = dict.fromkeys(group_id(r) for r in verified.took_tokens)
        touched |= self._sample_plain(run.logits, verified)
        if self.spec is not None:
            self.spec.after_step(verified, run.hidden, sum(batch.num_new_tokens),
                                 time.perf_counter() - started)
        if isinstance(self.pd, PrefillSide):
            self.pd.after_sample(batch)
        self.scheduler.take_snapshots(batch.reqs)
        if self.scheduler.itl_budget is not None:
            self.scheduler.itl_budget.observe(batch.num_tokens - prompt_tokens, prompt_tokens,
                                              time.perf_counter() - step_started)
        return outputs + self.out.updates(touched)

    def _before_schedule(self, overlap: bool) -> list[RequestOutput]:
        """Updates that wait for this step (aborts, arrivals on a decode server); drafts; and,
        unless this step overlaps the last, the last step's tokens read."""
        outputs = self.out.drain()
        if self.pd is not None:
            outputs += self._poll_disaggregation()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
            trim_drafts(self.scheduler.running)
        if not overlap:  # this step's requests need the last one's tokens on the host
            self.flush()
            outputs += self.out.drain()
        return outputs

    def _count_prompt_tokens(self, batch: ScheduledBatch) -> int:
        """Counts the batch's prompt tokens; returns its tokens of requests still prefilling
        (what the ITL budget's fit calls prefill)."""
        prefilling = 0
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            prefilling += n if req.is_prefilling else 0
            if req.num_computed_tokens < len(req.prompt_ids):
                self.out.counters["prompt_tokens"] += min(n, len(req.prompt_ids)
                                                          - req.num_computed_tokens)
        return prefilling

    def _forward_and_verify(self, batch: ScheduledBatch) -> tuple[StepOutput, Verified]:
        """The forward, and with speculation the drafts it verified (speculative/verify.py)."""
        if self.spec is None:
            run = self._forward(batch, None, None)
            return run, Verified.nothing_drafted(run.to_sample)
        return self.spec.step(
            batch, self.device, lambda rows, record: self._forward(batch, rows, record),
            lambda req, t: self.out.append_token(req, t, None, None), self._mask_drafts,
            self.runner.replay)

    def _forward(self, batch: ScheduledBatch, hidden_rows: tuple[int, ...] | None,
                 record: StepRecord | None) -> StepOutput:
        # Grammar masks are computed after the forward, not beside it on a thread: the closing
        # estimate is Python, and GIL hand-offs (5 ms switch interval) against the model's
        # Python-level op dispatch made tests/model/test_grammar.py 5x slower (160 s vs 32 s).
        # a context drafter's taps are every row's (the Speculator asks for them, or none)
        run = self.runner.run(batch, hidden_rows, record, context_stream=None
                              if self.spec is None or hidden_rows is None
                              else self.spec.drafter.context_stream)
        if isinstance(self.pd, PrefillSide):
            self.pd.after_forward(batch)
        self.out.after_forward(batch, run.prompt)
        return run

    def _sample_plain(self, logits: torch.Tensor, verified: Verified) -> dict[str, None]:
        """Samples the requests that verified no drafts, each grammar-constrained one from its
        masked row; returns the groups that took a token."""
        plain, rows = verified.plain, verified.plain_rows
        if not plain:
            return {}
        constrained = [i for i, r in enumerate(plain) if needs_mask(r)]
        # copied where rows are picked or masked in place (an inference-mode tensor)
        picked = logits if len(rows) == logits.shape[0] and not constrained else logits[rows]
        if constrained:
            constrain(picked, [plain[i] for i in constrained], constrained)
        result = self.out.sample(self.sampler, picked, plain)
        if constrained:
            for i in check_sampled(plain, result.token_ids):
                if result.logprobs is not None and result.top_logprobs is not None:
                    t = result.token_ids[i]
                    lp = picked[i].log_softmax(-1)[t].item()
                    result.logprobs[i] = lp
                    result.top_logprobs[i][t] = lp
        failed = {rid for rid, _ in self.out.failures}
        touched: dict[str, None] = {}
        for i, req in enumerate(plain):
            gid = group_id(req)
            if gid in failed:
                continue
            self.out.append_token(req, result.token_ids[i],
                                  result.logprobs[i] if result.logprobs else None,
                                  result.top_logprobs[i] if result.top_logprobs else None)
            touched[gid] = None
        return touched

    def _mask_drafts(self, req: Request, rows: torch.Tensor) -> torch.Tensor:
        """A constrained request's verify rows, each masked by its grammar's state after the
        drafts before it (a grammar bug is logged and the rows left as they are: the token's
        hand-off then ends this request alone)."""
        assert self._grammar is not None and req.matcher is not None
        bitmask = self._grammar.allocate_bitmask(rows.shape[0])
        try:
            req.matcher.fill_drafts(bitmask, req.draft_ids)
            rows = rows.clone()
            apply_bitmask(rows, bitmask)
        except ValueError:
            logger.exception("request %s: grammar failed on its drafts", req.rid)
        return rows

    def _lockstep(self, batch: ScheduledBatch) -> bool:
        """DP attention: whether this rank runs its batch now. Every rank takes part in
        every step some rank runs (its MoE layers gather all ranks' tokens): a rank with
        nothing to run passes its experts through an empty forward instead."""
        self.lockstep_idle = not self.ep.any_busy(not batch.is_empty)
        if batch.is_empty and not self.lockstep_idle:
            with torch.inference_mode():
                self.model.idle_forward()
        return not batch.is_empty

    def service_disaggregation(self) -> list[RequestOutput]:
        """The disaggregation peers' messages, also while no step runs (idle, paused): a
        prefill server answers pings and takes reservations, a decode server pings."""
        return self._poll_disaggregation() if self.pd is not None else []

    def _poll_disaggregation(self) -> list[RequestOutput]:
        """Prefill side: reservations in, timeouts. Decode side: requests whose caches
        arrived join the running batch with their first token."""
        if isinstance(self.pd, PrefillSide):
            self.pd.poll()
            return []
        assert self.pd is not None
        return self.out.updates({group_id(r): None for r in self.pd.poll()})

    def drain_outputs(self) -> list[RequestOutput]:
        """Updates waiting for the next step (aborts), for a loop that is not stepping."""
        return self.out.drain()

    def take_failures(self) -> list[tuple[str, str]]:
        """Requests that failed on their own since the last call, aborted (their blocks and
        slots freed); the caller reports each as an error."""
        failed, self.out.failures = self.out.failures, []
        for rid, _ in failed:
            if rid in self.out.groups:
                self.abort(rid)  # its final output (finish_reason "abort") comes next step
        return failed

    # ---- what it reports (engine/introspection.py) ----
    def summary(self) -> str:
        return self.report.summary()

    def get_metrics(self) -> dict[str, int | float]:
        return self.report.metrics()

    def check_integrity(self) -> None:
        self.report.check_integrity()

    def flush_cache(self) -> bool:
        return self.report.flush_cache()

    def close(self) -> None:
        """Stops the tensor-parallel followers (the engine is unusable afterwards)."""
        if self.followers is not None:
            self.followers.stop()
            self.followers = None
        if self.pd is not None:
            self.pd.close()
