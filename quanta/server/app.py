"""The FastAPI application: OpenAI-compatible routes over an :class:`AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE
streaming ending with ``data: [DONE]``), Anthropic's ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (:mod:`quanta.server.anthropic`),
``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text), ``GET /v1/config`` (effective scheduling
values) and ``GET /v1/trace`` (step records, for the bench's server-side ITL).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quanta.engine.async_engine import AsyncEngine, QueueFullError, RequestStream
from quanta.engine.grammar import GrammarCompiler
from quanta.model.tokenizer import Tokenizer
from quanta.server.chat import serve_chat, serve_completion
from quanta.server.access import AccessPolicy, install_access
from quanta.server.errors import APIError, install_error_handlers
from quanta.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, PromptWork
from quanta.server.metrics import EngineMetrics
from quanta.server.openai_requests import ChatRequest, CompletionsRequest
from quanta.server.tools import ToolParser, choose_parser


@dataclass
class ServerState:
    """What the routes need: the engine, its tokenizer, names and limits.

    Attributes:
        model_name: the model's id (the first ``--served-model-name``).
        aliases: further ids the routes accept (later ``--served-model-name`` values).
        tool_call_parser: ``--tool-call-parser`` (None: chosen from the chat template).
        access: ``--api-key``, ``--allowed-hosts``, ``--cors-origin`` (:mod:`quanta.server.access`).
    """

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    config: dict
    metrics: EngineMetrics
    #: request bodies over this many bytes get HTTP 413; None: no limit
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES
    aliases: tuple[str, ...] = ()
    tool_call_parser: str | None = None
    access: AccessPolicy = field(default_factory=AccessPolicy)
    prompts: PromptWork = field(init=False)
    tool_parser: ToolParser = field(init=False)
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self) -> None:
        self.prompts = PromptWork(self.tokenizer, self.max_model_len)
        self.tool_parser = choose_parser(self.tokenizer.chat_template, self.tool_call_parser)
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.tokenizer.eos_token_ids)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)


def build_app(state: ServerState) -> FastAPI:
    """A FastAPI app serving ``state`` (the engine must be started by the caller)."""
    app = FastAPI(title="quanta", version="0.1.0")
    app.state.quanta = state
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=state.max_request_bytes)
    install_access(app, state.access)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.alive:
            return JSONResponse({"status": "error", "message": "engine thread stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [{"id": name, "object": "model", "created": 0, "owned_by": "quanta", "max_model_len": state.max_model_len}
                 for name in state.model_names]
        return {"object": "list", "data": cards}

    @app.get("/v1/config")
    async def config() -> dict:
        return state.config

    @app.get("/v1/trace")
    async def trace(since: int = 0) -> dict:
        return {"records": state.engine.engine.trace.to_dicts(since)}

    @app.post("/v1/completions")
    async def completions(body: CompletionsRequest, request: Request) -> Response:
        return await serve_completion(state, request, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        return await serve_chat(state, request, body)

    from quanta.server.anthropic import add_anthropic_routes  # imports this module's helpers
    from quanta.server.responses import add_responses_route

    add_anthropic_routes(app, state)
    add_responses_route(app, state)
    return app


def check_model(state: ServerState, model: str) -> None:
    """Raise a 404 :class:`APIError` unless ``model`` is one of the served model's ids."""
    if model not in state.model_names:
        served = " or ".join(repr(n) for n in state.model_names)
        raise APIError(404, f"model {model!r} does not exist; this server serves {served}", "model", "model_not_found")


async def submit(state: ServerState, prompt: list[int], max_tokens: int, make_params) -> RequestStream:
    """Check lengths, build the sampling parameters and hand the request to the engine.

    Args:
        max_tokens: output tokens at most.
        make_params: ``max_tokens -> SamplingParams`` (may raise ``ValueError``).

    Raises:
        APIError: 400 (lengths, parameters), 429 (queue full), 503 (engine down).
    """
    try:
        state.engine.engine.check_length(len(prompt), max(max_tokens, 1))
        params = make_params(max_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), "max_tokens" if "max_model_len" in str(exc) else None) from exc
    try:
        return await state.engine.submit(prompt, params)
    except QueueFullError as exc:
        raise APIError(429, str(exc)) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    except RuntimeError as exc:
        raise APIError(503, str(exc)) from exc


async def until_disconnect(request: Request, work, stream: RequestStream) -> Response:
    """Await ``work``; abort the request if the client goes away first."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            stream.abort()
            return Response(status_code=499)
    return task.result()
