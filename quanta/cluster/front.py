"""The front of a cluster: one endpoint that routes each request to one of N replicas.

Every request goes whole to one replica (:mod:`quanta.cluster.forward`), whose
quanta app answers it: routes, keys, limits and error bodies are the single
server's. The front adds three things:

- **Routing.** A generation request's prompt ids
  (:class:`quanta.cluster.prompts.RoutingPrompts`) and each replica's load go
  to a :class:`quanta.cluster.routing.Router`; the load is what the front has
  in flight on the replica: up to ``max_num_seqs`` of them running, the rest
  waiting. Other requests go to the least-loaded replica.
- **Failure.** A replica that fails before answering gives HTTP 503 with the
  route's error body; one that fails mid-stream ends the stream with the
  route's SSE error event (:func:`quanta.server.errors.stream_error_event`),
  never a silent cut or a hang. Other replicas' requests never notice.
  Each forwarded response names its replica in ``x-quanta-replica``.
- **Cluster routes.** ``GET /metrics``: every replica's series with a
  ``replica`` label (:mod:`quanta.cluster.metrics`); ``GET /v1/config``:
  replica 0's settings plus ``cluster`` (replica count, routing, prefix
  routing's ``max_waiting`` and ``load_tokens``, requests routed to and in
  flight on each replica, each replica's settings); ``GET /v1/trace?replica=I``: that replica's step trace
  (step numbers are per replica). ``GET /health``: 200 when every replica's
  own ``/health`` is, else 503 naming the replicas that are down and why
  (:func:`health_response`).
  Each of these asks the replicas with the client's own headers, so the
  replicas' key checks apply; a refusal comes back as it is.

Ray-free: the replicas are callables (:data:`Replica`), which
:mod:`quanta.cluster.app` makes of Ray Serve deployment handles.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from quanta.cluster.forward import HTTPRequest, Part, ResponseEnd
from quanta.cluster.metrics import merge
from quanta.cluster.prompts import RoutingPrompts
from quanta.cluster.routing import PrefixRouter, ReplicaLoad, Router, front_loads, least_loaded
from quanta.server.errors import internal_error_message, log_internal_error, route_error_body, stream_error_event

log = logging.getLogger("quanta.cluster")
access_log = logging.getLogger("quanta.access")

#: one replica: a request in, its response's parts out (:func:`quanta.cluster.forward.call_app`'s stream)
Replica = Callable[[HTTPRequest], AsyncIterator[Part]]

#: response header naming the replica that answered a forwarded request
REPLICA_HEADER = b"x-quanta-replica"

#: routes the front answers itself from every replica's answer
CLUSTER_PATHS = frozenset({"/metrics", "/v1/config", "/v1/trace", "/health"})
#: seconds a replica has to answer one of those, asked all at once (Ray Serve holds a call to a dead
#: replica until its replacement has loaded: that replica then counts as down)
CLUSTER_ROUTE_TIMEOUT_S = 3.0


@dataclass
class Answer:
    """A replica's whole answer to a small request."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def response(self) -> Response:
        out = Response(self.body, status_code=self.status)
        out.raw_headers = list(self.headers)
        return out


@dataclass(frozen=True)
class Down:
    """A replica that gave no answer, and why (a timeout, its process gone)."""

    reason: str


class Front:
    """Routes requests over ``replicas`` with ``router`` (see the module's docstring).

    Args:
        replicas: one callable per replica, index = the router's replica index.
        router: the routing policy, :func:`quanta.cluster.routing.make_router`'s.
        prompts: renders bodies to prompt ids for the router.
        max_num_seqs: a replica's running requests at most (``--max-num-seqs``), to split in-flight counts.
        max_request_bytes: bodies are read up to one byte past this and forwarded so (the replica answers 413).
    """

    def __init__(self, replicas: Sequence[Replica], router: Router, prompts: RoutingPrompts, max_num_seqs: int,
                 max_request_bytes: int | None, routing: str = "") -> None:
        self.replicas, self.router, self.prompts = list(replicas), router, prompts
        self.max_num_seqs, self.max_request_bytes, self.routing = max_num_seqs, max_request_bytes, routing
        self.in_flight = [0] * len(self.replicas)
        self.routed = [0] * len(self.replicas)

    def loads(self) -> list[ReplicaLoad]:
        """Each replica's load as the front sees it (:func:`~quanta.cluster.routing.front_loads`)."""
        return front_loads(self.in_flight, self.max_num_seqs)

    async def __call__(self, request: Request) -> Response:
        started = time.monotonic()
        incoming = await self._incoming(request)
        if incoming.path in CLUSTER_PATHS and incoming.method in ("GET", "HEAD"):
            response = await self._cluster_route(incoming, request.query_params)
            log_access(incoming, response.status_code, started)
            return response
        tokens = await self.prompts.tokens(incoming.path, incoming.body)
        loads = self.loads()
        replica = self.router.choose(tokens, loads) if tokens is not None else least_loaded(loads)
        if tokens is not None:
            self.router.routed(replica, tokens)
            self.routed[replica] += 1
        return await self._forward(replica, incoming, started)

    async def _incoming(self, request: Request) -> HTTPRequest:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if self.max_request_bytes is not None and len(body) > self.max_request_bytes:
                break  # enough for the replica's 413
        client = (request.client.host, request.client.port) if request.client else None
        return HTTPRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                           tuple(request.scope["headers"]), bytes(body), client)

    async def _forward(self, replica: int, incoming: HTTPRequest, started: float) -> Response:
        self.in_flight[replica] += 1
        parts = aiter(self.replicas[replica](incoming))
        try:
            start = await anext(parts)
        except Exception as exc:  # StopAsyncIteration too: no response at all
            self.in_flight[replica] -= 1
            await parts.aclose()
            message = f"replica {replica} failed before answering; " + internal_error_message(log_internal_error("replica", exc))
            log_access(incoming, 503, started, replica)
            return JSONResponse(route_error_body(incoming.path, 503, message), status_code=503)
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
        response = StreamingResponse(self._body(replica, parts, incoming, start.status, started, sse), status_code=start.status)
        response.raw_headers = [*start.headers, (REPLICA_HEADER, str(replica).encode())]
        return response

    async def _body(self, replica: int, parts: AsyncIterator, incoming: HTTPRequest, status: int, started: float,
                    sse: bool) -> AsyncIterator[bytes]:
        events, ending, whole = 0, "", False
        try:
            async for part in parts:
                chunk = part.body if isinstance(part, ResponseEnd) else part
                if chunk:
                    events += chunk.count(b"\n\n")
                    yield chunk
                # the last chunk passed on: the client may leave before the stream's own end arrives
                whole = whole or isinstance(part, ResponseEnd)
        except Exception as exc:  # the replica died or was cut off mid-response
            error_id = log_internal_error(f"replica {replica} stream", exc)
            if not whole:
                ending = f"replica stopped mid-response, error id {error_id}"
                if sse:
                    message = f"replica {replica} stopped mid-stream; " + internal_error_message(error_id)
                    yield stream_error_event(incoming.path, message, events).encode()
        except BaseException:  # the client went away (the proxy cancels the response)
            ending = "" if whole else "client disconnected"
            raise
        finally:
            self.in_flight[replica] -= 1
            await parts.aclose()
            log_access(incoming, status, started, replica, ending)

    async def _answer(self, replica: int, incoming: HTTPRequest, timeout: float | None = None) -> Answer | Down:
        """A replica's whole answer, or :class:`Down` with the reason it gave none within ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self._whole(replica, incoming), timeout)
        except TimeoutError:  # a dead replica's calls wait for its replacement
            reason = f"no answer within {timeout:g} s"
        except Exception as exc:
            reason = _exception_reason(exc)
        log.warning("replica %d did not answer %s %s: %s", replica, incoming.method, incoming.path, reason)
        return Down(reason)

    async def _whole(self, replica: int, incoming: HTTPRequest) -> Answer:
        parts = aiter(self.replicas[replica](incoming))
        try:
            start = await anext(parts)
            body = b"".join([part.body if isinstance(part, ResponseEnd) else part async for part in parts])
        finally:
            await parts.aclose()
        return Answer(start.status, start.headers, body)

    async def _cluster_route(self, incoming: HTTPRequest, query) -> Response:
        if incoming.path == "/v1/trace":
            return await self._trace(incoming, query.get("replica"))
        answers = await asyncio.gather(*(self._answer(i, incoming, CLUSTER_ROUTE_TIMEOUT_S) for i in range(len(self.replicas))))
        if incoming.path == "/health":
            return health_response(answers)
        good = {i: a for i, a in enumerate(answers) if isinstance(a, Answer) and a.status == 200}
        refused = next((a for a in answers if isinstance(a, Answer) and a.status != 200), None)
        if refused is not None:  # a key check or a limit: the replicas' own answer
            return refused.response()
        if not good:
            message = f"no replica answered {incoming.path}"
            return JSONResponse(route_error_body(incoming.path, 503, message), status_code=503)
        if incoming.path == "/metrics":
            first = good[min(good)]
            return Response(merge({i: a.body.decode() for i, a in good.items()}), status_code=200,
                            headers={"content-type": _header(first, b"content-type") or "text/plain"})
        return JSONResponse(self._config({i: json.loads(a.body) for i, a in good.items()}))

    def _config(self, configs: dict[int, dict]) -> dict:
        cluster = {"replicas": len(self.replicas), "routing": self.routing, "routed": self.routed,
                   "in_flight": self.in_flight, "replica_configs": {str(i): c for i, c in configs.items()}}
        if isinstance(self.router, PrefixRouter):  # its load bound and load weight (quanta simulate --compare reads them)
            cluster |= {"max_waiting": self.router.max_waiting, "load_tokens": self.router.load_tokens}
        return {**configs[min(configs)], "cluster": cluster}

    async def _trace(self, incoming: HTTPRequest, replica: str | None) -> Response:
        if replica is None or not replica.isdigit() or int(replica) >= len(self.replicas):
            message = (f"replica: the step trace is per replica; GET /v1/trace?replica=I with I in "
                       f"0..{len(self.replicas) - 1}")
            status = 404 if replica is not None and replica.isdigit() else 400  # no such replica, or no index at all
            return JSONResponse(route_error_body(incoming.path, status, message, "replica"), status_code=status)
        answer = await self._answer(int(replica), incoming)
        if isinstance(answer, Down):
            message = f"replica {replica} did not answer: {answer.reason}"
            return JSONResponse(route_error_body(incoming.path, 503, message), status_code=503)
        return answer.response()


def log_access(incoming: HTTPRequest, status: int, started: float, replica: int | None = None, ending: str = "") -> None:
    """One access line: ``GET /v1/models 200 OK 12.3 ms replica=0`` (Ray Serve's own access log is off: it
    names every request by the application's route prefix, ``/``)."""
    target = incoming.path + (f"?{incoming.query_string.decode(errors='replace')}" if incoming.query_string else "")
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "-"
    where = f" replica={replica}" if replica is not None else ""
    access_log.info("%s %s %d %s %.1f ms%s%s", incoming.method, target, status, reason, (time.monotonic() - started) * 1e3,
                    where, f" ({ending})" if ending else "")


def health_response(answers: Sequence[Answer | Down]) -> JSONResponse:
    """``GET /health`` of the cluster: 200 when every replica's own ``/health`` is 200, else 503; the body
    names each replica, up or not, and why not (``{"status": "ok"|"degraded"|"error", "replicas": [...]}``)."""
    replicas = []
    for i, answer in enumerate(answers):
        if isinstance(answer, Answer) and answer.status == 200:
            replicas.append({"replica": i, "up": True})
        else:
            reason = answer.reason if isinstance(answer, Down) else f"answered {answer.status}: {_message(answer.body)}"
            replicas.append({"replica": i, "up": False, "reason": reason})
    down = [r["replica"] for r in replicas if not r["up"]]
    if not down:
        return JSONResponse({"status": "ok", "replicas": replicas})
    status = "error" if len(down) == len(replicas) else "degraded"
    message = f"{len(down)} of {len(replicas)} replicas down: {', '.join(map(str, down))}"
    return JSONResponse({"status": status, "message": message, "replicas": replicas}, status_code=503)


def _message(body: bytes) -> str:
    """The message of a JSON error body (``message``, or ``error.message``), else its first 200 characters."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:200].decode(errors="replace") or "no body"
    error = data.get("error") if isinstance(data, dict) else None
    found = data.get("message") if isinstance(data, dict) else None
    found = found or (error.get("message") if isinstance(error, dict) else error)
    return str(found)[:200] if found else json.dumps(data)[:200]


def _exception_reason(exc: BaseException) -> str:
    """``Type: first line of the message`` (Ray's errors run to many lines), at most 200 characters."""
    text = str(exc).strip().splitlines()
    return (f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__)[:200]


def _header(answer: Answer, name: bytes) -> str | None:
    return next((v.decode() for k, v in answer.headers if k.lower() == name), None)
