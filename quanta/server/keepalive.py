"""Keep-alives for streamed responses: a client hears from the server at a
fixed interval while its prompt is computed or it waits in the queue.

A cold prefill of a long context takes minutes on a CPU, and agents drop a
stream that has been silent for a few minutes (then send the request again).
:func:`with_keepalive` wraps any route's SSE event generator: it reads the
next event on a task and, each time ``interval`` seconds pass with no event,
yields the route's keep-alive instead. A keep-alive is an event the
protocol's own clients parse and hand on, because some agents time a stream
by the events their SDK yields, not by the bytes (Qwen Code 0.24.4 drops a
stream after 240 s without a chunk; SSE comments, which every parser skips,
did not keep it): on chat completions a chunk whose ``delta`` is empty, on
completions a chunk of empty ``text``, on Responses ``response.in_progress``
again (its snapshot carries no output, which the official client merges as
no change), Anthropic's ``ping`` on ``/v1/messages``. A keep-alive never
cancels the read it waits for; a client that goes away cancels it (the
request's stream then aborts the request,
:class:`quanta.engine.async_engine.RequestStream`).

The interval is ``quanta serve --stream-keepalive SECONDS`` (default
:data:`DEFAULT_KEEPALIVE_S`; 0: none), kept in the server config under
:data:`CONFIG_KEY`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

#: ``--stream-keepalive`` default, seconds.
DEFAULT_KEEPALIVE_S = 10.0
#: the server config's key for the interval (``/v1/config`` shows it).
CONFIG_KEY = "stream_keepalive_s"
_END = object()


def keepalive_interval(config: dict) -> float:
    """The server's keep-alive interval in seconds (0: none)."""
    return float(config.get(CONFIG_KEY, DEFAULT_KEEPALIVE_S))


async def _next(events: AsyncIterator[str]):
    try:
        return await anext(events)
    except StopAsyncIteration:
        return _END


async def with_keepalive(events: AsyncIterator[str], interval: float,
                         keepalive: str | Callable[[], str]) -> AsyncIterator[str]:
    """``events``, with ``keepalive`` (or what it returns, called each time: an event that carries a
    sequence number) yielded after each ``interval`` seconds without one (0: none)."""
    if interval <= 0:
        async for event in events:
            yield event
        return
    pending: asyncio.Task | None = None
    try:
        while True:
            pending = asyncio.ensure_future(_next(events))
            while not (await asyncio.wait({pending}, timeout=interval))[0]:
                yield keepalive() if callable(keepalive) else keepalive
            event, pending = pending.result(), None
            if event is _END:
                return
            yield event
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # the client went away: the read's cancellation aborts the request
        elif (aclose := getattr(events, "aclose", None)) is not None:
            with contextlib.suppress(RuntimeError):
                await aclose()
