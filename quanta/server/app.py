"""The FastAPI application: the routers of each protocol over one :class:`ServerState`.

Routers: OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions``
(:mod:`quanta.server.chat`), ``POST /v1/responses``
(:mod:`quanta.server.responses`), Anthropic's ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (:mod:`quanta.server.anthropic`). Served
here: ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text),
``GET /v1/config`` (effective scheduling values) and ``GET /v1/trace`` (step
records, for the bench's server-side ITL).
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quanta.server import anthropic, chat, responses
from quanta.server.access import install_access
from quanta.server.errors import install_error_handlers
from quanta.server.limits import Admission, BodyLimit
from quanta.server.serving import ServerState

__all__ = ["ServerState", "build_app"]

#: Routes whose requests hold a place in ``--max-queue`` while they are prepared.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                              "/v1/messages/count_tokens"})


def build_app(state: ServerState) -> FastAPI:
    """A FastAPI app serving ``state`` (the engine must be started by the caller)."""
    app = FastAPI(title="quanta", version="0.1.0")
    app.state.quanta = state
    install_error_handlers(app)
    app.add_middleware(Admission, engine=state.async_engine, paths=GENERATION_PATHS,  # inside BodyLimit: after the body
                       max_prompt_tokens=state.max_model_len - 1)
    app.add_middleware(BodyLimit, max_bytes=state.max_request_bytes)
    install_access(app, state.access)
    app.include_router(_service_router(state))
    for protocol in (chat, responses, anthropic):
        app.include_router(protocol.router(state))
    return app


def _service_router(state: ServerState) -> APIRouter:
    """Health, metrics, models, configuration and the step trace."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not state.async_engine.alive:
            return JSONResponse({"status": "error", "message": "engine thread stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models() -> dict:
        cards = [{"id": name, "object": "model", "created": 0, "owned_by": "quanta", "max_model_len": state.max_model_len}
                 for name in state.model_names]
        return {"object": "list", "data": cards}

    @router.get("/v1/config")
    async def config() -> dict:
        return state.config

    @router.get("/v1/trace")
    async def trace(since: int = 0) -> dict:
        return {"records": state.async_engine.trace.to_dicts(since)}

    return router
