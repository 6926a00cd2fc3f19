"""The FastAPI application: the routers of each protocol over one :class:`ServerState`.

Routers: OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions``
(:mod:`quanta.server.openai.chat`), ``POST /v1/responses``
(:mod:`quanta.server.responses.routes`), Anthropic's ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (:mod:`quanta.server.anthropic.messages`), ``POST /tokenize``
and ``POST /detokenize`` (:mod:`quanta.server.tokenize`), ``GET /version``, ``GET /v1/models/{id}``,
``GET /props`` and ``GET /slots`` (:mod:`quanta.server.introspect`). Served
here: ``GET /v1/models``, ``GET /health`` and ``HEAD /health`` (and ``/api/hello``, Claude Code's
probe, and ``GET``/``HEAD /``, which clients send to check the base URL), ``GET /metrics`` (Prometheus text),
``GET /v1/config`` (effective scheduling values) and ``GET /v1/trace`` (step
records, for the bench's server-side ITL; paged: ``since``, ``limit``, at most
:data:`TRACE_PAGE_RECORDS` records and about :data:`TRACE_PAGE_BYTES` a page).
"""

from __future__ import annotations

import json
from dataclasses import asdict

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quanta.engine.trace import Trace
from quanta.server import introspect, ollama, tokenize
from quanta.server.access import install_access
from quanta.server.anthropic import messages
from quanta.server.errors import install_error_handlers
from quanta.server.limits import Admission, BodyLimit
from quanta.server.openai import chat
from quanta.server.responses import routes as responses
from quanta.server.serving import ServerState

__all__ = ["ServerState", "build_app"]

#: ``/v1/trace``: records per page at most, and bytes of records per page at most (one record always fits).
TRACE_PAGE_RECORDS, TRACE_PAGE_BYTES = 2000, 2**20

#: Routes whose requests hold a place in ``--max-queue`` while they are prepared.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                              "/v1/messages/count_tokens", "/api/chat", "/api/generate"})


def build_app(state: ServerState) -> FastAPI:
    """A FastAPI app serving ``state`` (the engine must be started by the caller)."""
    app = FastAPI(title="quanta", version="0.1.0")
    app.state.quanta = state
    install_error_handlers(app)
    app.add_middleware(Admission, engine=state.async_engine, paths=GENERATION_PATHS,  # inside BodyLimit: after the body
                       max_prompt_tokens=state.max_model_len - 1)
    app.add_middleware(BodyLimit, max_bytes=state.max_request_bytes, max_structure=state.prompts.max_structure)
    install_access(app, state.access)
    for router in [_service_router(state)] + [p.router(state) for p in (chat, responses, messages, tokenize, introspect, ollama)]:
        app.include_router(_head_beside_get(router))
    return app


def _head_beside_get(router: APIRouter) -> APIRouter:
    """``router`` with ``HEAD`` on every ``GET`` route that has none (HTTP asks it of every GET
    resource; Ollama's clients probe ``HEAD /api/tags`` and ``/api/version``): the GET's status and
    headers, no body, left out of the schema."""
    routes = [r for r in router.routes if isinstance(r, APIRoute)]
    headed = {r.path for r in routes if "HEAD" in r.methods}
    for route in routes:
        if "GET" in route.methods and route.path not in headed:
            router.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False)
    return router


def trace_page(trace: Trace, since: int, limit: int) -> dict:
    """One page of ``GET /v1/trace``: records with ``step >= since``, at most ``limit``
    (at most :data:`TRACE_PAGE_RECORDS`) and about :data:`TRACE_PAGE_BYTES` of JSON;
    ``next_since`` is where the next page starts, ``more`` whether it has records
    yet, ``next_step`` the index of the engine's next step."""
    records, size = [], 0
    for record in trace.page(since, min(max(limit, 1), TRACE_PAGE_RECORDS)):
        item = asdict(record)
        size += len(json.dumps(item)) + 2  # and the list's separator
        if records and size > TRACE_PAGE_BYTES:
            break
        records.append(item)
    next_since = records[-1]["step"] + 1 if records else max(since, 0)
    next_step = trace.next_step
    return {"records": records, "next_since": next_since, "more": next_since < next_step, "next_step": next_step}


def _service_router(state: ServerState) -> APIRouter:
    """Health, metrics, models, configuration and the step trace."""
    router = APIRouter()

    @router.get("/health")
    @router.head("/health", include_in_schema=False)
    async def health() -> Response:
        if not state.async_engine.alive:
            return JSONResponse({"status": "error", "message": "engine thread stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/api/hello")
    @router.head("/api/hello", include_in_schema=False)  # one operation in the schema (its id is unique)
    async def hello() -> Response:  # Claude Code's reachability probe of ANTHROPIC_BASE_URL
        return JSONResponse({"status": "ok"})

    @router.get("/", include_in_schema=False)
    @router.head("/", include_in_schema=False)
    async def root_probe() -> Response:  # clients probe the base URL (HEAD; Ollama's clients GET "is it running")
        return PlainTextResponse("quanta is running")

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [introspect.model_card(state, name) for name in state.model_names]}

    @router.get("/v1/config")
    async def config() -> dict:
        return state.config

    @router.get("/v1/trace")
    async def trace(since: int = 0, limit: int = TRACE_PAGE_RECORDS) -> dict:
        return trace_page(state.async_engine.trace, since, limit)

    return router
