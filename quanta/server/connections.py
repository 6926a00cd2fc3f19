"""Slow and idle clients cannot take the server's connections.

uvicorn waits for a request's head for as long as the client keeps the
socket open, so clients that trickle one header line every few seconds
(no key needed: the head is not even complete) could hold every file
descriptor, after which each failed ``accept`` logs a traceback and
``/health`` is unreachable. :func:`guarded_protocol` is uvicorn's h11
protocol with two guards:

* a head deadline: a connection that has not sent a complete request head
  :data:`HEAD_TIMEOUT_S` seconds after it opened (or after its previous
  response) is closed; a request in progress is never cut;
* a connection cap (``--max-connections``, at most the descriptor limit less
  :data:`RESERVED_FDS`): past it, the connection that has waited longest for
  its first request head is closed to make room (an idle keep-alive
  connection, which has completed a request, only when no such connection is
  left), so a new client (``/health``, a normal request) is always accepted,
  the ones dropped are the ones sending nothing useful, and a client that is
  being served keeps its connection.

Idle keep-alive connections are closed by uvicorn after 5 s. Closed
connections and failed accepts are logged as one line per
:data:`LOG_EVERY_S` seconds with a count, never a traceback per event
(:func:`quiet_accept_errors`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("quanta.server")

#: Seconds a connection may take to send a complete request head.
HEAD_TIMEOUT_S = 10.0
#: Descriptors left for the process's own files and sockets when the cap is derived from the limit.
#: (A burst accepted in one loop turn can still run out of descriptors before the cap evicts
#: anyone; asyncio then pauses accepting for a second, and :func:`quiet_accept_errors` counts it.)
RESERVED_FDS = 256
#: ``--max-connections`` when not given (lowered to what the descriptor limit allows).
DEFAULT_MAX_CONNECTIONS = 8192
#: At most one log line per this many seconds for each kind of dropped connection.
LOG_EVERY_S = 10.0


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one (as servers do); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(requested: int | None, fd_limit: int) -> int:
    """``requested`` (default :data:`DEFAULT_MAX_CONNECTIONS`), at most ``fd_limit - RESERVED_FDS`` (at least 16)."""
    return max(16, min(requested or DEFAULT_MAX_CONNECTIONS, fd_limit - RESERVED_FDS))


class _RateLimitedLog:
    """Counts events and logs one warning line per :data:`LOG_EVERY_S` at most, with the count."""

    def __init__(self, what: str) -> None:
        self.what, self.count, self.last = what, 0, -LOG_EVERY_S

    def event(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            log.warning("%s: %d since the last such line", self.what, self.count)
            self.count, self.last = 0, now


def guarded_protocol(max_connections: int, head_timeout: float = HEAD_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the head deadline and the connection cap (module docstring)."""
    # connections without a head yet, oldest first: those that never sent one, then idle keep-alive ones
    fresh: OrderedDict[GuardedH11Protocol, None] = OrderedDict()
    kept: OrderedDict[GuardedH11Protocol, None] = OrderedDict()
    timed_out = _RateLimitedLog(f"closed connections that sent no complete request head within {head_timeout:g} s")
    evicted = _RateLimitedLog(f"closed connections waiting for a request head to stay within --max-connections "
                              f"{max_connections}")

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._wait_for_head(fresh)
            oldest = next(iter(fresh or kept), None)
            if len(self.connections) > max_connections and oldest is not None:  # one out per one in (closing
                oldest._drop(evicted)  # ones stay in the count until their connection_lost)

        def connection_lost(self, exc) -> None:
            self._head_arrived()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's head arrived
                self._head_arrived()

        def on_response_complete(self) -> None:
            self._wait_for_head(kept)  # before the next pipelined request, if any, is handled
            super().on_response_complete()

        def _wait_for_head(self, queue: OrderedDict) -> None:
            self._head_arrived()
            self._head_timer = self.loop.call_later(head_timeout, self._drop, timed_out)
            queue[self] = None

        def _head_arrived(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            fresh.pop(self, None)
            kept.pop(self, None)

        def _drop(self, why: _RateLimitedLog) -> None:
            self._head_arrived()
            if (self.cycle is not None and not self.cycle.response_complete) or self.transport.is_closing():
                return
            why.event()
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    return GuardedH11Protocol


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """An event-loop exception handler: a failed ``accept`` (out of descriptors) is a
    rate-limited line without a traceback; anything else goes to asyncio's default handler.

    asyncio (3.11) schedules a retry of the listening socket for each accept
    of a turn that failed; those still pending at shutdown fail on the closed
    socket, and are counted the same way.
    """
    failed_accept = isinstance(context.get("exception"), OSError) and "accept" in str(context.get("message", ""))
    if failed_accept or "_start_serving" in repr(context.get("handle")):
        _ACCEPT_FAILED.event()
        return
    loop.default_exception_handler(context)


_ACCEPT_FAILED = _RateLimitedLog("could not accept connections (out of file descriptors?)")
