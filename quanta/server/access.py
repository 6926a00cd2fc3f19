"""Who may drive the server: ASGI middleware against web pages and strangers.

* :class:`HostCheck`: the ``Host`` header must name this server (DNS
  rebinding: a page on ``evil.example`` whose name later resolves to
  127.0.0.1 sends ``Host: evil.example``). Accepted by default: ``localhost``,
  any IP literal (a rebinding page always sends a domain name), the ``--host``
  value, and ``--allowed-hosts`` (``*``: any). Otherwise HTTP 421.
* :class:`RequestGate`: with ``--api-key K1 [K2 ...]`` every route but
  ``/health`` needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` with
  one of the keys (either header on any route, as the OpenAI and Anthropic
  clients send one each); otherwise HTTP 401. Each key is a tenant: the gate
  records the matched key's :func:`tenant_id` in the request's ASGI scope
  state (:data:`TENANT_STATE`), and :func:`quanta.server.serving.submit` salts
  prefix reuse with it (:func:`tenant_salt`), so requests of different keys
  never share cached K/V and ``cached_tokens`` reveals nothing across keys.
  The operator routes (:data:`OPERATOR_PATHS`: ``/metrics``, ``/v1/trace``,
  ``/v1/config``, ``/slots``, which show every tenant's request sizes, timings and cache
  hits) need one of the ``--admin-key`` keys whenever any key is set: a
  tenant's key gets HTTP 403 there, and with ``--api-key`` but no
  ``--admin-key`` they are closed to everyone. An admin key is also accepted
  on the other routes, as a tenant of its own.
  Every POST needs a JSON ``Content-Type`` (``application/json``,
  parameters such as ``charset`` allowed), else HTTP 415: this closes the
  CORS "simple request" (``text/plain``) a page could send without a preflight.

Refusals carry the error body of the route's API
(:func:`quanta.server.errors.route_error_body`). ``--cors-origin`` is served
by Starlette's ``CORSMiddleware`` (see :func:`install_access`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware

from quanta.server.errors import route_error_body

#: Paths any client may read without the key: load balancers' probes, Claude Code's
#: reachability probe (``HEAD /api/hello`` with no key, sent before its first request), ``HEAD /``, Ollama clients' ``GET /api/version``.
OPEN_PATHS = frozenset({"/", "/health", "/api/hello", "/api/version"})

#: Paths that need an admin key when keys are set: they show every tenant's traffic.
OPERATOR_PATHS = frozenset({"/metrics", "/v1/trace", "/v1/config", "/slots"})

#: Host names always accepted besides IP literals.
LOCAL_NAMES = frozenset({"localhost"})

#: The key of ``scope["state"]`` (``request.state``) holding the matched key's :func:`tenant_id`.
TENANT_STATE = "quanta_tenant"


@dataclass(frozen=True)
class AccessPolicy:
    """The access options of ``quanta serve``.

    Attributes:
        api_keys: the keys clients may send, one per tenant (empty: no key needed).
        bound_host: the ``--host`` value (accepted as a ``Host`` name).
        allowed_hosts: more accepted ``Host`` names; ``"*"`` accepts any.
        cors_origins: origins given CORS access (``--cors-origin``); empty: no CORS headers.
        admin_keys: the keys of the operator routes (:data:`OPERATOR_PATHS`; ``--admin-key``).
    """

    api_keys: tuple[str, ...] = ()
    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()

    @property
    def keyed(self) -> bool:
        """Whether any key is set (then the operator routes need an admin key)."""
        return bool(self.api_keys or self.admin_keys)

    def tenant(self, headers: dict[bytes, bytes]) -> str | None:
        """The :func:`tenant_id` of the key the request sent, None if it sent none of :attr:`api_keys`.

        ``headers``: the ASGI headers (lower-case names); the key is taken from
        ``x-api-key`` or ``Authorization: Bearer``. Every sent value is compared
        with every key in constant time (:func:`hmac.compare_digest`), with no
        early exit, so timing tells neither which key nor how much of it matched.
        Either header may carry the key (a client's placeholder in the other is
        ignored), but two different keys in the two headers name two tenants
        and are refused (None), not resolved by the keys' order. An admin key
        is a tenant too.
        """
        key = _matched(headers, self.api_keys + self.admin_keys)
        return tenant_id(key) if key is not None else None

    def is_admin(self, headers: dict[bytes, bytes]) -> bool:
        """Whether the request sent one of :attr:`admin_keys` (matched as :meth:`tenant` matches)."""
        return _matched(headers, self.admin_keys) is not None

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


def _matched(headers: dict[bytes, bytes], keys: tuple[str, ...]) -> str | None:
    """The one of ``keys`` the request sent (``x-api-key`` or ``Authorization: Bearer``), else None;
    every sent value is compared with every key in constant time, with no early exit."""
    sent = [headers.get(b"x-api-key", b"")]
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        sent.append(token.strip())
    sent = [value for value in sent if value]
    matched: list[str | None] = [None] * len(sent)
    for key in keys:
        encoded = key.encode()
        for i, value in enumerate(sent):
            if hmac.compare_digest(value, encoded) and matched[i] is None:
                matched[i] = key
    found = {key for key in matched if key is not None}
    return found.pop() if len(found) == 1 else None


def tenant_id(key: str) -> str:
    """The tenant of an API key: its SHA-256 in hex (64 characters); the key itself is never kept per request."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt prefix reuse is keyed on: the request's ``cache_salt`` within its tenant.

    No tenant (no ``--api-key``): ``cache_salt`` unchanged. Else
    ``"tenant:<tenant>"``, plus ``"/<cache_salt>"`` when the request sent one, so
    a salt subdivides a tenant and never matches another tenant's requests
    (the tenant part has a fixed length, so no salt can forge another's prefix).
    """
    if tenant is None:
        return cache_salt
    return f"tenant:{tenant}" if cache_salt is None else f"tenant:{tenant}/{cache_salt}"


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
    """ASGI middleware: the API key (HTTP 401; the matched tenant goes in ``scope["state"]``)
    and a JSON body type on POST (HTTP 415)."""

    def __init__(self, app, policy: AccessPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        if self.policy.keyed and scope.get("path") in OPERATOR_PATHS:
            if not self.policy.is_admin(headers):
                if self.policy.tenant(headers) is None:
                    await refuse(scope, send, 401, "missing or wrong admin key: send 'Authorization: Bearer KEY' "
                                 "with a key of --admin-key", [(b"www-authenticate", b"Bearer")])
                else:
                    await refuse(scope, send, 403, "this key is a tenant's: /metrics, /v1/trace and /v1/config need "
                                 "a key of --admin-key (they show every tenant's traffic)")
                return
        elif self.policy.api_keys and scope.get("path") not in OPEN_PATHS:
            tenant = self.policy.tenant(headers)
            if tenant is None:
                await refuse(scope, send, 401, "missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                             [(b"www-authenticate", b"Bearer")])
                return
            scope.setdefault("state", {})[TENANT_STATE] = tenant
        if scope.get("method") == "POST" and not is_json(headers.get(b"content-type", b"")):
            got = headers.get(b"content-type", b"").decode("latin-1") or "none"
            await refuse(scope, send, 415, f"Content-Type must be application/json (got {got})")
            return
        await self.app(scope, receive, send)


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
