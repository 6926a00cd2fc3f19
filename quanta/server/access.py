"""Who may drive the server: ASGI middleware against web pages and strangers.

* :class:`HostCheck`: the ``Host`` header must name this server (DNS
  rebinding: a page on ``evil.example`` whose name later resolves to
  127.0.0.1 sends ``Host: evil.example``). Accepted by default: ``localhost``,
  any IP literal (a rebinding page always sends a domain name), the ``--host``
  value, and ``--allowed-hosts`` (``*``: any). Otherwise HTTP 421.
* :class:`RequestGate`: with ``--api-key`` every route but ``/health`` needs
  ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (either header on any
  route, as the OpenAI and Anthropic clients send one each); otherwise HTTP
  401. Every POST needs a JSON ``Content-Type`` (``application/json``,
  parameters such as ``charset`` allowed), else HTTP 415: this closes the
  CORS "simple request" (``text/plain``) a page could send without a preflight.

Refusals carry the error body of the route's API
(:func:`quanta.server.errors.route_error_body`). ``--cors-origin`` is served
by Starlette's ``CORSMiddleware`` (see :func:`install_access`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware

from quanta.server.errors import route_error_body

#: Paths any client may read without the key (load balancers' probes).
OPEN_PATHS = frozenset({"/health"})

#: Host names always accepted besides IP literals.
LOCAL_NAMES = frozenset({"localhost"})


@dataclass(frozen=True)
class AccessPolicy:
    """The access options of ``quanta serve``.

    Attributes:
        api_key: the key clients must send (None: no key needed).
        bound_host: the ``--host`` value (accepted as a ``Host`` name).
        allowed_hosts: more accepted ``Host`` names; ``"*"`` accepts any.
        cors_origins: origins given CORS access (``--cors-origin``); empty: no CORS headers.
    """

    api_key: str | None = None
    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a ``Host`` header value (``name[:port]``, ``[v6]:port``) names this server."""
        if "*" in self.allowed_hosts:
            return True
        if not host_header:
            return False
        name = _host_name(host_header)
        if name in LOCAL_NAMES or name == self.bound_host.lower().strip("[]"):
            return True
        if name in {h.lower().strip("[]") for h in self.allowed_hosts}:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _host_name(host_header: str) -> str:
    value = host_header.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.rsplit(":", 1)[0]
    return value.rstrip(".")


def split_list(values: list[str] | None) -> tuple[str, ...]:
    """``["a,b", "c"]`` -> ``("a", "b", "c")`` (repeatable flags that also take comma lists)."""
    return tuple(part.strip() for value in values or () for part in value.split(",") if part.strip())


async def refuse(scope, send, status: int, message: str, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Send ``status`` with the route's error body."""
    body = json.dumps(route_error_body(scope.get("path", ""), status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class HostCheck:
    """ASGI middleware: HTTP 421 unless :meth:`AccessPolicy.host_allowed` accepts the ``Host`` header."""

    def __init__(self, app, policy: AccessPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
            if not self.policy.host_allowed(host):
                await refuse(scope, send, 421, f"Host {host!r} is not this server's name; start the server with "
                                                "--allowed-hosts NAME to accept it (a guard against DNS rebinding)")
                return
        await self.app(scope, receive, send)


class RequestGate:
    """ASGI middleware: the API key (HTTP 401) and a JSON body type on POST (HTTP 415)."""

    def __init__(self, app, policy: AccessPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        if self.policy.api_key is not None and scope.get("path") not in OPEN_PATHS and not self._has_key(headers):
            await refuse(scope, send, 401, "missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                         [(b"www-authenticate", b"Bearer")])
            return
        if scope.get("method") == "POST" and not is_json(headers.get(b"content-type", b"")):
            got = headers.get(b"content-type", b"").decode("latin-1") or "none"
            await refuse(scope, send, 415, f"Content-Type must be application/json (got {got})")
            return
        await self.app(scope, receive, send)

    def _has_key(self, headers: dict[bytes, bytes]) -> bool:
        key = self.policy.api_key.encode()
        sent = [headers.get(b"x-api-key", b"")]
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            sent.append(token.strip())
        return any(hmac.compare_digest(value, key) for value in sent if value)


def is_json(content_type: bytes) -> bool:
    """``application/json`` with optional parameters (``; charset=utf-8``)."""
    return content_type.split(b";", 1)[0].strip().lower() == b"application/json"


def install_access(app, policy: AccessPolicy) -> None:
    """Add the access middleware to ``app``, after its other middleware (so they run first).

    Order of a request: Host check, CORS (answers preflights without a key),
    then the gate; middleware added earlier (the body limit) runs after these.
    """
    app.add_middleware(RequestGate, policy=policy)
    if policy.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(policy.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    app.add_middleware(HostCheck, policy=policy)
