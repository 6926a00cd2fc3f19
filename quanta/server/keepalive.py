"""Keep-alives for streamed responses: a client hears from the server at a
fixed interval while its prompt is computed or it waits in the queue.

A cold prefill of a long context takes minutes on a CPU, and agents drop a
stream that has been silent for a few minutes (then send the request again).
:func:`with_keepalive` wraps any route's SSE event generator: it reads the
next event on a task and, each time ``interval`` seconds pass with no event,
yields the route's keep-alive instead: an SSE comment line
(:data:`SSE_COMMENT`) on OpenAI's routes, which every SSE parser skips, and
Anthropic's ``ping`` event on ``/v1/messages``. A keep-alive never cancels the
read it waits for; a client that goes away cancels it (the request's stream
then aborts the request, :class:`quanta.engine.async_engine.RequestStream`).

The interval is ``quanta serve --stream-keepalive SECONDS`` (default
:data:`DEFAULT_KEEPALIVE_S`; 0: none), kept in the server config under
:data:`CONFIG_KEY`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

#: ``--stream-keepalive`` default, seconds.
DEFAULT_KEEPALIVE_S = 10.0
#: the server config's key for the interval (``/v1/config`` shows it).
CONFIG_KEY = "stream_keepalive_s"
#: the keep-alive of OpenAI's routes: an SSE comment.
SSE_COMMENT = ": keep-alive\n\n"

_END = object()


def keepalive_interval(config: dict) -> float:
    """The server's keep-alive interval in seconds (0: none)."""
    return float(config.get(CONFIG_KEY, DEFAULT_KEEPALIVE_S))


async def _next(events: AsyncIterator[str]):
    try:
        return await anext(events)
    except StopAsyncIteration:
        return _END


async def with_keepalive(events: AsyncIterator[str], interval: float, keepalive: str) -> AsyncIterator[str]:
    """``events``, with ``keepalive`` yielded after each ``interval`` seconds without one (0: none)."""
    if interval <= 0:
        async for event in events:
            yield event
        return
    pending: asyncio.Task | None = None
    try:
        while True:
            pending = asyncio.ensure_future(_next(events))
            while not (await asyncio.wait({pending}, timeout=interval))[0]:
                yield keepalive
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
