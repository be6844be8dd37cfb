"""The engine's requests as a caller sees them: each request id's group of sequences, what a
sampled token does to its sequence (stop checks, detokenization, logprobs), the bookkeeping
every step does around its forward, and the updates a step returns (`RequestOutput`s of the
requests it touched). The serial step, the overlapped pipeline and a decode server's arriving
requests all hand their tokens here."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kdaserve.detokenizer import IncrementalDetokenizer
from kdaserve.engine.grammar import note_reasoning
from kdaserve.engine.logprobs import record_prompt_logprobs
from kdaserve.engine.sampler import Sampler, SamplerOutput, sample_isolated
from kdaserve.engine.scheduler import Scheduler
from kdaserve.request import CompletionOutput, Request, RequestOutput
from kdaserve.scheduled_batch import ScheduledBatch
from kdaserve.tokenizer import Tokenizer

logger = logging.getLogger("kdaserve")

COUNTERS = ("prompt_tokens", "generation_tokens", "num_requests", "num_finished",
            "num_aborted", "num_steps")


def group_id(req: Request) -> str:
    """The request id a sequence belongs to (n > 1 names its sequences rid-0, rid-1, ...)."""
    return req.rid if req.params.n == 1 else req.rid.rsplit("-", 1)[0]


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, stop_ids: frozenset[int],
                 tokenizer: Tokenizer | None,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.scheduler, self.stop_ids, self.tokenizer = scheduler, stop_ids, tokenizer
        self.compute_logits = compute_logits  # for prompt logprobs
        self.groups: dict[str, list[Request]] = {}
        self.detok: dict[int, IncrementalDetokenizer] = {}  # id(sequence) ->
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.pending: list[RequestOutput] = []  # updates for the next step (aborts, flushes)
        self.failures: list[tuple[str, str]] = []  # (request id, why) of requests that failed
        self.stream = True  # False: only finished requests' updates go out
        self.scored: set[str] = set()  # groups whose prompt logprobs went out
        self.serial: set[str] = set()  # groups that do not overlap

    def add(self, rid: str, children: list[Request], serial: bool) -> None:
        """serial: the group's steps need its tokens on the host (overlap.overlappable)."""
        for child in children:
            if self.tokenizer is not None:
                p = child.params
                self.detok[id(child)] = IncrementalDetokenizer(
                    self.tokenizer, p.stop, p.skip_special_tokens, p.keep_special_ids)
        self.groups[rid] = children
        if serial:
            self.serial.add(rid)
        self.counters["num_requests"] += 1

    def drain(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        return outputs

    def fail(self, rid: str, why: str) -> None:
        """One request failed on its own: the engine aborts it and reports `why`."""
        self.failures.append((rid, why))

    # ---- around a step's forward ----
    def after_forward(self, batch: ScheduledBatch,
                      prompt: list[tuple[Request, torch.Tensor]]) -> None:
        for req, rows in prompt:
            record_prompt_logprobs(req, rows, self.compute_logits)
        self.scheduler.insert_snapshots(batch)
        self.counters["num_steps"] += 1

    def sample(self, sampler: Sampler, logits: torch.Tensor,
               reqs: list[Request]) -> SamplerOutput:
        """The batch's tokens; a request whose sampling fails alone is recorded as failed
        (its token must not be used)."""
        result, failed = sample_isolated(sampler, logits, reqs)
        self.failures += [(group_id(r), why) for r, why in failed]
        return result

    # ---- a token ----
    def append_token(self, req: Request, token: int, logprob: float | None,
                     top: dict[int, float] | None) -> None:
        req.output_ids.append(token)
        note_reasoning(req)
        grammar_done = False
        if req.matcher is not None:
            try:
                req.matcher.accept(token)
            except ValueError:  # a bug, but one request's: it ends, the batch goes on
                logger.exception("request %s: grammar rejected token %d", req.rid, token)
                self.scheduler.finish(req, "abort")
                return
            grammar_done = req.matcher.is_terminated
        self.counters["generation_tokens"] += 1
        if req.params.logprobs is not None and logprob is not None and top is not None:
            req.logprobs.append(top)
            req.cumulative_logprob += logprob
        p = req.params
        detok = self.detok.get(id(req))
        stop_str = detok.add(token) if detok is not None else None
        if (token in p.stop_token_ids) or (not p.ignore_eos and token in self.stop_ids):
            self.scheduler.finish(req, "stop")
            req.stop_reason = token
        elif stop_str is not None:
            self.scheduler.finish(req, "stop")
            req.stop_reason = stop_str
        elif grammar_done:  # the grammar allows nothing more: complete
            self.scheduler.finish(req, "stop")
        elif len(req.output_ids) >= p.max_tokens:
            self.scheduler.finish(req, "length")
        if req.is_finished and detok is not None:
            detok.flush()

    # ---- updates ----
    def group_output(self, rid: str) -> RequestOutput:
        children = self.groups[rid]
        outs = []
        for i, r in enumerate(children):
            detok = self.detok.get(id(r))
            outs.append(CompletionOutput(
                index=i, token_ids=list(r.known_output_ids),
                text=detok.visible_text(r.is_finished) if detok is not None else None,
                finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
                cumulative_logprob=r.cumulative_logprob if r.params.logprobs is not None
                else None, spec_num_drafted=r.num_drafted, spec_num_accepted=r.num_accepted,
                spec_num_verifies=r.num_verifies,
                routed_experts=torch.cat(r.routed_experts) if r.is_finished
                and r.options.return_routed_experts and r.routed_experts else None,
                hidden_states=torch.cat(r.hidden_states) if r.is_finished
                and r.options.return_hidden_states and r.hidden_states else None))
        first = children[0]
        finished = all(r.is_finished for r in children)
        # prompt logprobs go out once (the first update) and with the final one, not with
        # every token: they can be as long as the prompt
        send = first.prompt_logprobs is not None and (finished or rid not in self.scored)
        if send:
            self.scored.add(rid)
        return RequestOutput(rid, first.prompt_ids, outs, finished=finished,
                             prompt_logprobs=list(first.prompt_logprobs or []) if send else None,
                             num_cached_tokens=first.num_cached_prompt)

    def forget(self, rid: str) -> None:
        self.scored.discard(rid)
        self.serial.discard(rid)
        for r in self.groups.pop(rid):
            self.detok.pop(id(r), None)
            r.matcher = None

    def updates(self, touched: dict[str, None]) -> list[RequestOutput]:
        outputs = []
        for rid in touched:
            group = self.groups[rid]
            first = group[0]
            if first.prompt_logits_row is not None and not first.is_finished:
                continue  # a sibling decodes before child 0 has scored the prompt: wait
            if not self.stream and not (first.is_finished if len(group) == 1 else
                                        all(r.is_finished for r in group)):
                continue  # each update copies every token so far: a caller may not want them
            out = self.group_output(rid)
            outputs.append(out)
            if out.finished:
                self.counters["num_finished"] += 1
                self.forget(rid)
        return outputs
