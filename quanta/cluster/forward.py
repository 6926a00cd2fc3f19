"""One HTTP request run through an ASGI app in this process, as a stream of picklable parts.

The front of a cluster (:mod:`quanta.cluster.front`) hands a replica the
request it received as an :class:`HTTPRequest`; the replica runs it through
its own quanta app (:func:`call_app`) and streams back a
:class:`ResponseStart` (status and headers), then the body's chunks as
bytes, one per ASGI send (one SSE event each for a streamed generation), the
last one as :class:`ResponseEnd`: once that is passed on the response is whole,
though the stream that carries it may end a little later. So
every route, key check, limit and error body of a replica is the single
server's own code. When the consumer stops reading (the client went away),
the app's next ``receive`` is ``http.disconnect``, as under uvicorn, and the
route aborts its request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

#: a running app task is kept referenced until it ends (an unreferenced task can be collected mid-run)
_RUNNING: set[asyncio.Task] = set()


@dataclass(frozen=True)
class HTTPRequest:
    """What a replica needs of a client's request: method, path, query, headers, the whole body, the client's address."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None

    def scope(self) -> dict:
        """The ASGI HTTP scope of this request (spec 2.3: a streamed response listens for the disconnect)."""
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query_string, "root_path": "", "headers": list(self.headers),
                "client": self.client, "server": None, "state": {}}


@dataclass(frozen=True)
class ResponseStart:
    """A response's status and headers, the first part :func:`call_app` yields."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class ResponseEnd:
    """The last part :func:`call_app` yields: the body's last chunk (empty if the app's last send had none)."""

    body: bytes = b""


#: one part of a forwarded response
Part = ResponseStart | bytes | ResponseEnd


async def call_app(app: Callable[..., Awaitable[None]], request: HTTPRequest) -> AsyncIterator[Part]:
    """Run ``request`` through the ASGI ``app``: its :class:`ResponseStart`, its body chunks, the last
    one as :class:`ResponseEnd`.

    Nothing at all comes when the app ends without a response (an app that
    raised past its own error handlers), and no :class:`ResponseEnd` when it
    stops before its body's last part.
    """
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(request.scope(), receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v)) for k, v in message.get("headers", [])))
                continue
            body = bytes(message.get("body", b""))
            if not message.get("more_body", False):
                yield ResponseEnd(body)
                return
            if body:
                yield body
    finally:
        gone.set()  # the app's next receive() is the disconnect: a stream still running aborts its request
