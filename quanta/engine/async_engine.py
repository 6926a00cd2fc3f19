"""Runs the synchronous :class:`Engine` on its own thread for asyncio callers.

The engine thread owns the engine: requests and aborts reach it through a
command queue, and outputs return to each caller's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``. A caller that stops iterating (a client that
disconnected) aborts its request, which frees its slot.

Requests still being prepared (their prompt tokenized, their grammar
compiled) hold a :class:`Reservation` that counts against ``max_queue`` as
a waiting request does; the engine thread takes the reservation over when it
accepts the request, so no request is counted twice or not at all. A
reservation is checked on the caller's thread, ahead of the commands the
engine thread has not applied yet, so aborts still in the command queue
count as done (a request a client just left frees its place at once).

:meth:`AsyncEngine.submit` with ``wait=False`` returns the request's
stream as soon as the checks that can refuse it have passed on the caller's
thread (length, queue); the engine thread accepts it between steps, and the
stream's first read waits for that. A server can so answer at once (opening
events, keep-alives) even while a long prefill step runs.

An abort carries its cause (``disconnect``: the caller stopped reading, as
when its client went away; ``step_failed``: the step it was in raised) and
the phase it hit (``queued``, ``prefill``, ``decode``), reported to
``on_abort``. The prompt blocks an aborted request computed stay in the
prefix cache (:meth:`quanta.engine.kv_blocks.BlockTables.release`), so the
same request sent again resumes its prefill. A step whose requests were all
aborted while it ran stops at its next decoder block instead of running to
its end (:meth:`Engine.step`'s ``cancelled``): a dropped long prefill frees
its blocks within about one block's compute time, not one step's.

A request that fails, alone (an output with ``error``, see
:meth:`Engine.step`) or with its whole step (the executor raised), ends its
stream with :class:`RequestFailed`; the message names an error id under which
the log holds the traceback, never the raw exception text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Callable

from quanta.engine.engine import Engine
from quanta.engine.output import RequestOutput
from quanta.engine.request_stream import RequestStream, Reservation, Submission, accepted
from quanta.engine.sampling import SamplingParams
from quanta.engine.sequence import Sequence, SequenceStatus
from quanta.engine.trace import Trace

__all__ = ["AsyncEngine", "QueueFullError", "RequestFailed", "RequestStream", "Reservation", "abort_phase"]

log = logging.getLogger("quanta.engine")


class QueueFullError(RuntimeError):
    """More than ``max_queue`` requests are waiting."""


class RequestFailed(RuntimeError):
    """The request failed inside the engine; ``str()`` is a short message for the
    client naming the error id that the server log carries with the traceback."""

    status = 500


class ShuttingDown(RequestFailed):
    """The server is stopping: the request was ended before its answer (HTTP 503)."""

    status = 503


class AsyncEngine:
    """Thread-hosted engine with an async streaming API.

    Args:
        engine: the engine to drive (used only from the engine thread after
            :meth:`start`).
        max_queue: waiting requests allowed before :class:`QueueFullError`;
            None for unbounded.
        on_output: called on the engine thread with each output (metrics).
        on_abort: called on the engine thread with ``(cause, phase)`` of each
            request aborted before its end (see the module docstring).
    """

    def __init__(self, engine: Engine, max_queue: int | None = None, on_output: Callable[[RequestOutput], None] | None = None,
                 on_idle: Callable[[], None] | None = None, on_abort: Callable[[str, str], None] | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.on_output = on_output
        self.on_abort = on_abort
        self._step_started: float | None = None  # engine clock, while a step runs
        #: called on the engine thread each time the engine runs out of work (the server hands the
        #: C heap's free pages back: a burst's activations would otherwise stay resident)
        self.on_idle = on_idle
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[int, Submission] = {}
        self._thread = threading.Thread(target=self._run, name="quanta-engine", daemon=True)
        self._stopping = False
        self.error: BaseException | None = None
        self._admission = threading.Lock()  # guards the two counts against the engine thread's queue check
        self._preparing = 0  # reservations held
        self._aborts_queued = 0  # abort commands not applied yet
        #: seq ids of the requests whose abort is queued: a running step of only those stops early
        self._cancelling: set[int] = set()
        #: set by :meth:`shut_down`: every request added later is refused with it
        self._stopping_requests: RequestFailed | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=30)

    def shut_down(self) -> None:
        """End every request with :class:`ShuttingDown` (streams get their error event, waiting
        callers their 503) and refuse new ones; applied between steps (a step of only those
        requests stops at its next decoder block). For a server that is stopping: its handlers then
        finish at once instead of being cancelled mid-answer."""
        with self._admission:
            self._cancelling.update(self._routes)
        self._commands.put(("shut_down", None))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def trace(self) -> Trace:
        """The engine's step records (read-only from other threads: :meth:`Trace.to_dicts` copies them)."""
        return self.engine.trace

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request that cannot fit the context, before anything is built for it.

        Safe from any thread (``max_model_len`` never changes). A caller that
        ran it passes ``length_checked=True`` to :meth:`submit`, so the engine
        does not check again.

        Raises:
            ValueError: an empty prompt, or ``num_prompt_tokens + max_tokens``
                beyond ``max_model_len`` (the message names both numbers).
        """
        self.engine.check_length(num_prompt_tokens, max_tokens)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def kv_blocks(self) -> dict[str, int]:
        """The KV pool's blocks: ``used`` by resident sequences, ``cached`` (kept for prefix reuse,
        evictable), ``free``, ``total``, and ``preemptions`` since start (all 0 without a pool)."""
        sched = self.engine.scheduler
        blocks = sched.blocks
        if blocks is None:
            return {"used": 0, "cached": 0, "free": 0, "total": 0, "preemptions": sched.num_preemptions}
        cached, free = blocks.num_cached, blocks.pool.num_free
        total = blocks.pool.num_blocks
        return {"used": total - free - cached, "cached": cached, "free": free, "total": total,
                "preemptions": sched.num_preemptions}

    @property
    def num_preparing(self) -> int:
        """Requests holding a :class:`Reservation` (being prepared, not yet handed to the engine)."""
        return self._preparing

    def reserve(self) -> Reservation:
        """Count one request being prepared against ``max_queue`` until it is
        submitted (pass it to :meth:`submit`) or the reservation is released.

        Raises:
            QueueFullError: the waiting queue, preparing requests included, is full.
        """
        with self._admission:
            self._check_queue()
            self._preparing += 1
        return Reservation(self._release)

    def _release(self, reservation: Reservation) -> None:
        with self._admission:
            self._release_locked(reservation)

    def _release_locked(self, reservation: Reservation) -> None:
        if reservation.held:
            reservation.held = False
            self._preparing -= 1

    def _abort(self, sub: Submission) -> None:
        with self._admission:
            self._aborts_queued += 1
            if sub.seq_id is not None:
                self._cancelling.add(sub.seq_id)
        self._commands.put(("abort", sub))

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams, *,
                     length_checked: bool = False, reservation: Reservation | None = None,
                     wait: bool = True) -> RequestStream:
        """Hand a request to the engine.

        Args:
            length_checked: :meth:`check_length` already passed for this prompt
                and ``params.max_tokens`` (see :meth:`Engine.add_request`).
            reservation: the request's place from :meth:`reserve`: the queue is
                not checked again, and the engine thread releases it on accepting.
            wait: return once the engine thread has accepted the request; False:
                at once, after the length and queue checks (the stream's first
                read waits for the acceptance, :meth:`RequestStream.accepted`).

        Raises:
            QueueFullError: the waiting queue is full (no reservation given).
            ValueError: the prompt or its output does not fit ``max_model_len``.
            RuntimeError: the engine thread has died.
        """
        if not self.alive:
            raise RuntimeError("the engine is not running")
        if not length_checked:  # refused here, not on the engine thread (safe from any thread)
            self.check_length(len(prompt_token_ids), params.max_tokens)
        if reservation is None:  # the queue is checked now; the engine thread releases the place on accepting
            reservation = self.reserve()
        loop = asyncio.get_running_loop()
        sub = Submission(prompt_token_ids, params, loop, asyncio.Queue(), loop.create_future(), True, reservation,
                         submitted=self.engine.clock())
        self._commands.put(("add", sub))
        stream = RequestStream(self._abort, sub)
        if wait:
            await stream.accepted()
        return stream

    @property
    def step_running_s(self) -> float | None:
        """Seconds the step now running has run (engine clock); None between steps."""
        started = self._step_started
        return None if started is None else max(0.0, self.engine.clock() - started)

    def prefills(self) -> list[tuple[int, int, int]]:
        """``(seq_id, prompt tokens computed, prompt tokens)`` of each resident request still
        prefilling, as of the last step boundary (a copy; safe from another thread)."""
        return [(s.seq_id, s.num_computed_tokens, s.num_prompt_tokens)
                for s in list(self.engine.scheduler.running) if s.is_prefilling]

    def _run(self) -> None:
        try:
            busy = False
            while not self._stopping:
                self._drain_commands(block=not self.engine.has_work())
                if self.engine.has_work():
                    self._step()
                    busy = True
                elif busy:
                    busy = False
                    if self.on_idle is not None:
                        self.on_idle()
        except BaseException as exc:  # the engine thread must report, not vanish
            error_id = uuid.uuid4().hex[:12]
            log.exception("engine loop failed (error id %s)", error_id)
            self.error = exc
            failure = RequestFailed(f"the engine stopped (error id {error_id}; details are in the server log)")
            for sub in list(self._routes.values()):
                _post(sub, failure)
            self._refuse_pending(failure)

    def _refuse_pending(self, failure: RequestFailed) -> None:
        """Fail the requests still waiting to be accepted (a stopped engine never will:
        their streams would otherwise wait, keep-alives and all, forever)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is not None and cmd[0] == "add":
                cmd[1].error = failure
                _on_loop(cmd[1].loop, accepted, cmd[1])

    def _step(self) -> None:
        """One engine step; a failing step fails only the requests resident in it."""
        self._step_started = self.engine.clock()
        try:
            outputs = self.engine.step(self._cancelling.__contains__)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("engine step failed (error id %s); aborting the %d resident requests",
                          error_id, len(self.engine.scheduler.running))
            failure = RequestFailed(f"the engine step failed (error id {error_id}; details are in the server log)")
            for seq in list(self.engine.scheduler.running):
                self._note_abort("step_failed", seq)
                self.engine.abort(seq.seq_id)
                sub = self._routes.pop(seq.seq_id, None)
                if sub is not None:
                    _post(sub, failure)
            return
        finally:
            self._step_started = None
        for out in outputs:
            self._deliver(out)

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, verb: str, arg) -> None:
        if verb == "add":
            try:
                with self._admission:  # the request moves from preparing to waiting at once
                    try:
                        if self._stopping_requests is not None:
                            raise self._stopping_requests
                        if arg.reservation is None or not arg.reservation.held:
                            self._check_queue()
                        seq = self.engine.add_request(arg.prompt_token_ids, arg.params, length_checked=arg.length_checked,
                                                      submitted=arg.submitted)
                    finally:
                        if arg.reservation is not None:
                            self._release_locked(arg.reservation)
                arg.seq_id = seq.seq_id
                self._routes[seq.seq_id] = arg
            except Exception as exc:  # reported to the caller, engine keeps going
                arg.error = exc
            _on_loop(arg.loop, accepted, arg)
        elif verb == "shut_down":
            self._end_all(ShuttingDown("the server is shutting down; send the request again to another server or later"))
        elif verb == "abort":
            with self._admission:
                self._aborts_queued -= 1
                self._cancelling.discard(arg.seq_id)
            if arg.seq_id is None:
                return
            seq = self.engine.sequences.get(arg.seq_id)
            if seq is not None:
                self._note_abort(arg.abort_cause, seq)
            out = self.engine.abort(arg.seq_id)
            self._routes.pop(arg.seq_id, None)
            if out is not None and self.on_output is not None:
                self.on_output(out)

    def _end_all(self, failure: RequestFailed) -> None:
        """Abort every resident request with ``failure`` and refuse any added later."""
        self._stopping_requests = failure
        for seq_id, sub in list(self._routes.items()):
            seq = self.engine.sequences.get(seq_id)
            if seq is not None:
                self._note_abort("shutdown", seq)
            out = self.engine.abort(seq_id)
            self._routes.pop(seq_id, None)
            if out is not None and self.on_output is not None:
                self.on_output(out)  # its metrics and request line, as any abort's
            _post(sub, failure)
        self._cancelling.clear()

    def _note_abort(self, cause: str, seq: Sequence) -> None:
        if self.on_abort is None:
            return
        try:
            self.on_abort(cause, abort_phase(seq))
        except Exception:  # an observer must not stop the engine thread
            log.exception("abort listener failed")

    def _check_queue(self) -> None:
        """Refuse a request that would wait beyond ``max_queue``; the caller holds
        ``_admission``, so simultaneous submissions cannot all see room.

        Only what truly waits counts: a waiting (or preparing) request that a
        free slot will take at the next step is as good as running (so
        ``max_num_seqs + max_queue`` concurrent requests fit, as in vLLM).
        """
        if self.max_queue is None:
            return
        if self.num_truly_waiting >= self.max_queue:
            raise QueueFullError(f"{self.num_truly_waiting} requests are waiting for a slot (--max-queue {self.max_queue})")

    @property
    def num_truly_waiting(self) -> int:
        """Waiting and preparing requests beyond those the free slots take at the next step
        (each abort still queued frees a place: a waiting request's, or a running one's slot)."""
        sched = self.engine.scheduler
        return max(0, len(sched.waiting) + self._preparing - self._aborts_queued - sched.num_free_slots)

    def _deliver(self, out: RequestOutput) -> None:
        if self.on_output is not None:
            try:
                self.on_output(out)
            except Exception:  # an observer (metrics) must not lose the output
                log.exception("output listener failed")
        sub = self._routes.get(out.seq_id)
        if sub is None:
            return
        if out.finished:
            del self._routes[out.seq_id]
        item = RequestFailed(out.error) if out.error is not None else out
        _post(sub, item)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """``fn(*args)`` on ``loop``; nothing if the loop has closed (the server stopped: its caller is gone)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _post(sub: Submission, item) -> None:
    """Hand ``item`` (an output or a failure) to ``sub``'s caller."""
    _on_loop(sub.loop, sub.outputs.put_nowait, item)


def abort_phase(seq: Sequence) -> str:
    """Where an aborted request was: ``queued`` (no slot yet), ``prefill`` or ``decode``."""
    if seq.status is SequenceStatus.WAITING:
        return "queued"
    return "prefill" if seq.is_prefilling else "decode"
