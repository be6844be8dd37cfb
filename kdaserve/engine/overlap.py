"""Overlap scheduling: the host schedules and prepares step N+1 while the device runs step N.

A step's sampled tokens stay on the device. Each sampling request gets a placeholder token
(-1 - its row) at the end of its output, and the next step's input ids take the placeholders'
values from the device tensor (`resolve_inputs`): step N+1 is launched before the host has read
step N's tokens. Then the host reads them (`Pending.read`, the step's one wait for the device)
and runs the stop checks. A request that stopped at step N also ran in step N+1; that row's
token is dropped. SGLang's overlap scheduler works the same way (its future token ids).

Between steps a request holds at most one placeholder, its last token, which no forward has
computed yet: the prefix cache, which stores computed tokens only, never sees one.

Requests whose next step needs this step's token on the host do not overlap: a grammar's mask,
a reasoning budget's forced token, penalties over the output so far, and per-position records
(hidden states, routed experts) that a dropped row would add to. While one is in the engine,
every step reads its tokens before the next is scheduled (`overlappable`).
"""

from __future__ import annotations

import logging

import torch

from kdaserve.engine.logprobs import Picked
from kdaserve.engine.model_runner import ModelRunner
from kdaserve.engine.outputs import OutputProcessor, group_id
from kdaserve.engine.placeholders import placeholder
from kdaserve.engine.sampler import Drawn, Sampler, SamplerOutput
from kdaserve.engine.scheduler import Scheduler
from kdaserve.request import Request, RequestOutput
from kdaserve.scheduled_batch import ScheduledBatch

logger = logging.getLogger("kdaserve")


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def overlappable(req: Request) -> bool:
    p = req.params
    return (req.matcher is None and p.reasoning_budget is None
            and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and not req.options.return_hidden_states
            and not req.options.return_routed_experts)


class Pending:
    """A launched step's sampled tokens, not read by the host yet. Building one appends each
    request's placeholder, except for `skip` rows (requests whose sampling failed)."""

    def __init__(self, reqs: list[Request], drawn: Drawn, output: SamplerOutput | None = None,
                 skip: frozenset[int] = frozenset()) -> None:
        self.reqs, self.drawn, self.output = reqs, drawn, output
        self.ready: torch.cuda.Event | None = None
        self.host = drawn
        if drawn.tokens.device.type == "cuda" and output is None:
            # copied now, behind this step only: a copy started at read() would queue behind
            # the next step, which is launched by then
            lp = drawn.logprobs
            self.host = Drawn(_pinned_copy(drawn.tokens),
                              None if lp is None else Picked(*map(_pinned_copy, lp)))
            self.ready = torch.cuda.Event()
            self.ready.record()
        # last: what may fail above (pinned memory) leaves the outputs as they were
        self.index: list[int | None] = []  # each request's placeholder position in its output
        for row, req in enumerate(reqs):
            if row in skip:
                self.index.append(None)
                continue
            self.index.append(len(req.output_ids))
            req.output_ids.append(placeholder(row))

    @property
    def future(self) -> torch.Tensor:
        return self.drawn.tokens

    def forget(self) -> None:
        """Takes its placeholders out again (a step that failed: none may reach an output)."""
        for row, (req, at) in enumerate(zip(self.reqs, self.index, strict=True)):
            if at is not None and len(req.output_ids) > at \
                    and req.output_ids[at] == placeholder(row):
                del req.output_ids[at:]

    def read(self, sampler: Sampler) -> SamplerOutput:
        if self.output is not None:
            return self.output
        if self.ready is not None:
            self.ready.synchronize()
        return sampler.read(self.host, self.reqs, self.host.tokens.tolist())


class OverlapPipeline:
    """The overlapped step: at most one step in flight whose tokens the host has not read."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, out: OutputProcessor) -> None:
        self.runner, self.sampler, self.out = runner, sampler, out
        self.inflight: Pending | None = None

    def flush(self) -> None:
        """Reads the step in flight, for what needs every request's tokens on the host (a
        serial step, an abort, a pause); its updates come with the next step."""
        pending, self.inflight = self.inflight, None
        self.out.pending += self._resolve(pending)

    def step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launches this step (its inputs may stand for the step in flight's tokens), then
        reads the step in flight: on a GPU the device runs this step meanwhile."""
        previous = self.inflight
        run = self.runner.run(batch, future=previous.future if previous is not None else None)
        self.out.after_forward(batch, run.prompt)
        self.inflight = self._launch(run.logits, run.to_sample) if run.to_sample else None
        try:
            outputs = self._resolve(previous)
        except BaseException:  # the step fails (its requests are aborted): no placeholder stays
            for pending in (previous, self.inflight):
                if pending is not None:
                    pending.forget()
            self.inflight = None
            raise
        self.scheduler.take_snapshots(batch.reqs)
        return outputs

    @property
    def scheduler(self) -> Scheduler:
        return self.out.scheduler

    def _launch(self, logits: torch.Tensor, reqs: list[Request]) -> Pending:
        """Draws the tokens on the device; on a failure, samples on the host request by
        request (OutputProcessor.sample), and a request that fails alone gets no token."""
        # seeded requests' generators as they were: a draw that fails after drawing their
        # noise must not move them on (sample_isolated saves them too late for that)
        seeded = [(r.generator, r.generator.get_state()) for r in reqs if r.generator is not None]
        try:
            return Pending(reqs, self.sampler.draw(logits, reqs))
        except Exception:  # noqa: BLE001 - retried below, request by request
            logger.exception("batched sampling failed; sampling each request alone")
        for generator, state in seeded:
            generator.set_state(state)
        result = self.out.sample(self.sampler, logits, reqs)
        failed = {rid for rid, _ in self.out.failures}
        skip = frozenset(i for i, r in enumerate(reqs) if group_id(r) in failed)
        tokens = torch.tensor(result.token_ids, dtype=torch.int64, device=logits.device)
        return Pending(reqs, Drawn(tokens, None), result, skip)

    def _resolve(self, pending: Pending | None) -> list[RequestOutput]:
        """Reads a launched step's tokens into its requests' outputs, with the stop checks
        of `append_token`; the updates of the requests that progressed or finished."""
        if pending is None:
            return []
        result = pending.read(self.sampler)
        touched: dict[str, None] = {}
        for row, (req, at) in enumerate(zip(pending.reqs, pending.index, strict=True)):
            if at is None or req.is_finished:  # failed; or stopped a step before: dropped
                continue
            out = req.output_ids
            newer = out[at + 1:]  # the next step's placeholder, when that step runs req
            del out[at:]
            self.out.append_token(req, result.token_ids[row],
                                  result.logprobs[row] if result.logprobs else None,
                                  result.top_logprobs[row] if result.top_logprobs else None)
            if not req.is_finished:
                out += newer
            touched[group_id(req)] = None
        return self.out.updates(touched)
