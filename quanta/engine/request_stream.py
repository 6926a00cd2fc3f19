"""The caller's side of one request of :class:`quanta.engine.async_engine.AsyncEngine`:
its submission (what the engine thread reads), its place in the queue while it is
prepared (:class:`Reservation`) and its outputs (:class:`RequestStream`). Each calls
back into the engine through the function it was given (release the place, abort
the request), so this module does not know the engine's class.

A stream may come back before the engine thread accepted the request
(``AsyncEngine.submit(wait=False)``): its first read waits for the acceptance
(:meth:`RequestStream.accepted`), and :meth:`RequestStream.when_accepted` runs
callbacks with the engine's id once it has one. Closing a stream early aborts
its request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from quanta.engine.output import RequestOutput
from quanta.engine.sampling import SamplingParams


@dataclass
class Submission:
    """One request on its way to the engine thread, and back (filled in there)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    arrived: asyncio.Future
    length_checked: bool = False
    reservation: Reservation | None = None
    seq_id: int | None = None
    error: Exception | None = None
    #: run on the event loop with the seq_id once the engine accepted the request
    on_accept: list[Callable[[int], None]] = field(default_factory=list)
    abort_cause: str = "disconnect"
    #: engine-clock time the front put it on the engine's command queue
    submitted: float | None = None


class Reservation:
    """A request's place in the queue while it is prepared (:meth:`AsyncEngine.reserve`);
    a context manager that releases it unless the engine took it over.

    ``release``: the engine's function that gives the place back (a no-op once it is not held).
    """

    def __init__(self, release: Callable[[Reservation], None]) -> None:
        self._release = release
        self.held = True

    def release(self) -> None:
        self._release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def accepted(sub: Submission) -> None:
    """On the event loop: the engine thread has taken (or refused) the request."""
    if not sub.arrived.done():
        sub.arrived.set_result(None)
    callbacks, sub.on_accept = sub.on_accept, []
    if sub.error is None and sub.seq_id is not None:
        for callback in callbacks:
            callback(sub.seq_id)


class RequestStream:
    """The outputs of one accepted request; closing it early aborts the request
    (``abort``: the engine's function that cancels a submission)."""

    def __init__(self, abort: Callable[[Submission], None], sub: Submission) -> None:
        self._abort, self._sub = abort, sub
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    @property
    def seq_id(self) -> int | None:
        """The engine's id of the request (set once the engine accepted it)."""
        return self._sub.seq_id

    def when_accepted(self, callback: Callable[[int], None]) -> None:
        """Run ``callback(seq_id)`` on the event loop once the engine accepted the request
        (now, if it already has; never, if it refused it)."""
        sub = self._sub
        if sub.arrived.done():
            if sub.error is None and sub.seq_id is not None:
                callback(sub.seq_id)
        else:
            sub.on_accept.append(callback)

    async def accepted(self) -> None:
        """Wait until the engine thread has accepted the request.

        Raises:
            QueueFullError, ValueError: the engine refused it.
        """
        sub = self._sub
        if not sub.arrived.done():
            try:
                await sub.arrived
            except BaseException:
                self.abort()
                raise
        if sub.error is not None:
            self.finished = True
            raise sub.error

    async def __anext__(self) -> RequestOutput:
        """The next output (the first waits for the engine to accept the request).

        Raises:
            RequestFailed: the request failed inside the engine.
        """
        if self.finished:
            raise StopAsyncIteration
        await self.accepted()
        try:
            out = await self._sub.outputs.get()
        except BaseException:
            self.abort()
            raise
        if isinstance(out, BaseException):
            self.finished = True
            raise out
        self.finished = out.finished
        return out

    def abort(self, cause: str = "disconnect") -> None:
        """Cancel the request (frees its slot); a no-op once it finished. ``cause`` is reported
        to the engine's ``on_abort`` (default ``disconnect``: the reader went away)."""
        if not self.finished:
            self.finished = True
            self._sub.abort_cause = cause
            self._abort(self._sub)
