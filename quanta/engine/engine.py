"""The engine loop: schedule, execute, post-process, record.

:class:`Engine` is synchronous and single-threaded; :mod:`quanta.engine.async_engine`
runs it on a thread for the HTTP server, ``quanta generate`` calls it
directly, and the simulator drives it with a cost-model executor and a
virtual clock.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from quanta.engine.executor import Executor, StepInterrupted
from quanta.engine.output import RequestOutput
from quanta.engine.sampling import FailedSample, SamplingParams
from quanta.engine.scheduler import Scheduler, StepPlan
from quanta.engine.sequence import Sequence, SequenceStatus
from quanta.engine.trace import StepRecord, Trace

if TYPE_CHECKING:
    from quanta.engine.stop_strings import TextState

log = logging.getLogger("quanta.engine")


def _interrupt_when(plan: StepPlan, cancelled: Callable[[int], bool]) -> Callable[[], None]:
    """The executor's interrupt check for ``plan``: raises :class:`StepInterrupted` once every
    request in the plan is ``cancelled``."""
    ids = [c.seq.seq_id for c in plan.chunks]

    def check() -> None:
        if all(cancelled(i) for i in ids):
            raise StepInterrupted

    return check


class Engine:
    """Continuous-batching engine around one scheduler and one executor.

    Args:
        scheduler: the policy deciding each step.
        executor: runs steps (real model or cost model).
        max_model_len: prompt plus generated tokens allowed per sequence.
        make_text: builds each request's text state (detokenizer and stop
            strings) from its parameters at :meth:`add_request`; None yields
            tokens only (no text, no stop strings). The engine never sees a
            tokenizer, so it imports neither torch nor transformers.
        eos_token_ids: tokens that end generation (unless ``ignore_eos``).
        clock: seconds; ``time.monotonic`` by default, a virtual clock in simulation.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        max_model_len: int,
        make_text: Callable[[SamplingParams], TextState] | None = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_model_len = max_model_len
        self.make_text = make_text
        self.eos_token_ids = set(eos_token_ids)
        self.clock = clock
        self.trace = Trace()
        #: called with each new :class:`StepRecord` (metrics, live trace consumers)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.sequences: dict[int, Sequence] = {}
        self._text: dict[int, TextState] = {}
        self._ids = itertools.count()
        self._arrivals: list[list] = []  # [seq_id, submitted, accepted, prompt tokens] since the last trace record

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``ValueError`` naming both numbers if they exceed ``max_model_len``."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({self.max_model_len})"
            )

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *, length_checked: bool = False,
                    submitted: float | None = None) -> Sequence:
        """Queue a request; returns its sequence (``seq_id`` identifies it).

        Args:
            length_checked: the caller has already run :meth:`check_length` on
                this prompt and ``params.max_tokens`` (the server does, before
                it builds the request's grammar), so it does not run twice.
            submitted: engine-clock time the front handed the request over (the
                next trace record's ``arrivals``); now when not given.

        Raises:
            ValueError: empty prompt, or prompt plus ``max_tokens`` beyond
                ``max_model_len`` (unless ``length_checked``).
        """
        if not length_checked:
            self.check_length(len(prompt_token_ids), params.max_tokens)
        seq = Sequence(next(self._ids), list(prompt_token_ids), params, arrival_time=self.clock())
        self.sequences[seq.seq_id] = seq
        self._arrivals.append([seq.seq_id, seq.arrival_time if submitted is None else submitted, seq.arrival_time,
                               seq.num_prompt_tokens])
        if self.make_text is not None:
            self._text[seq.seq_id] = self.make_text(params)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq_id: int) -> RequestOutput | None:
        """Cancel a request and free its slot; None if it already ended."""
        seq = self.sequences.get(seq_id)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        self._release(seq)
        return self._output(seq, [], "", self.clock())

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, cancelled: Callable[[int], bool] | None = None) -> list[RequestOutput]:
        """Run one scheduled step; returns an output per sequence that emitted or finished.

        A failure that belongs to one sequence (its sampling, detokenization
        or stop check) finishes that sequence alone with ``finish_reason
        "error"`` (:meth:`_fail`); the others in the step go on. An exception
        from the executor itself (the batched forward pass) propagates: no
        single request can be blamed for it.

        Args:
            cancelled: ``seq_id -> bool``, whether a request's cancellation is on its way (the
                async engine's aborts not yet applied). When it holds for every request in the
                step, the executor stops the step at its next interrupt point (a decoder block
                of a long prefill): nothing of it counts as computed, no trace record is written,
                and ``[]`` is returned; the caller then applies the aborts, which free the blocks.
        """
        plan = self.scheduler.next_plan()
        if plan is None:
            return []
        kind = plan.kind  # before the chunks advance their sequences
        positions = [c.seq.num_computed_tokens for c in plan.chunks]
        start = self.clock()
        try:
            result = self.executor.execute(plan, _interrupt_when(plan, cancelled) if cancelled else None)
        except StepInterrupted:
            log.info("step of %d tokens stopped after %.2f s: every request in it was cancelled",
                     sum(c.num_new_tokens for c in plan.chunks), self.clock() - start)
            return []
        sampled = result.tokens
        end = self.clock()
        outputs = []
        for chunk, token in zip(plan.chunks, sampled, strict=True):
            try:
                chunk.seq.num_computed_tokens += chunk.num_new_tokens
                if isinstance(token, FailedSample):
                    raise token.error
                if token is not None:
                    outputs.append(self._append_token(chunk.seq, token, end))
            except Exception as exc:  # this request's own failure: it alone ends
                outputs.append(self._fail(chunk.seq, exc, end))
        rec = self.trace.record(
            kind, start, end,
            [c.seq.seq_id for c in plan.chunks],
            [c.num_new_tokens for c in plan.chunks],
            [int(t is not None and not isinstance(t, FailedSample)) for t in sampled],
            result.experts,
            positions,
            self._arrivals,
        )
        self._arrivals = []
        for listener in self.step_listeners:
            try:
                listener(rec)
            except Exception:  # an observer must not fail the requests it observes
                log.exception("step listener %r failed", listener)
        return outputs

    def _fail(self, seq: Sequence, exc: Exception, now: float) -> RequestOutput:
        """End ``seq`` with ``finish_reason "error"``; the traceback goes to the
        log under a short id that the output's ``error`` message names."""
        error_id = uuid.uuid4().hex[:12]
        log.error("request %d failed in the engine (error id %s)", seq.seq_id, error_id, exc_info=exc)
        seq.finish_reason = "error"
        if seq.seq_id in self.sequences:
            self._release(seq)
        out = self._output(seq, [], "", now)
        out.finished = True
        out.error = f"the request failed inside the engine (error id {error_id}; details are in the server log)"
        return out

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        seq.output_token_ids.append(token)
        reason = self._finish_reason(seq, token)
        text_state = self._text.get(seq.seq_id)
        text, stop_string = "", None
        if text_state is not None:
            text = text_state.add(token, final=reason is not None)
            if text_state.stopped:  # a stop string completed by the last allowed token is still a stop
                reason, stop_string = "stop", text_state.stop_string
        if reason is not None:
            seq.finish_reason = reason
            self._release(seq)
        return self._output(seq, [token], text, now, stop_string)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.sequences.pop(seq.seq_id, None)
        self._text.pop(seq.seq_id, None)
        self.executor.release(seq.seq_id)

    def _output(self, seq: Sequence, tokens: list[int], text: str, now: float, stop_string: str | None = None) -> RequestOutput:
        return RequestOutput(
            seq.seq_id, tokens, text, seq.status is SequenceStatus.FINISHED, seq.finish_reason,
            seq.num_prompt_tokens, len(seq.output_token_ids), now, seq.arrival_time,
            seq.num_cached_tokens, stop_string,
        )
