"""Answer a client that half-closes its connection after sending its request.

A client may send a whole request and then shut down its writing side
(``shutdown(SHUT_WR)``, ``nc -N``, some proxies). uvicorn's h11 protocol lets
asyncio close the transport on that EOF, so the request was cancelled as a
disconnect and the client got 0 bytes. TCP still carries the answer the other
way, so :class:`HalfCloseH11Protocol` keeps the connection open when a whole
request has arrived, answers it, then closes (no keep-alive). An EOF before the
request is complete (or between requests) still closes the connection, and a
client that is really gone is still noticed when writing fails.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HalfCloseH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering requests whose client half-closed (pass as ``http=``)."""

    def eof_received(self) -> bool:
        """True (keep the write side open) when a complete request still awaits its response."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and self.conn.their_state is h11.DONE:
            cycle.keep_alive = False  # close once the response is out
            return True
        return False
