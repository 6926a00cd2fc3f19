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
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quanta.engine.async_engine import AsyncEngine, QueueFullError, RequestFailed, RequestStream
from quanta.engine.output import RequestOutput
from quanta.model.tokenizer import Tokenizer
from quanta.server.errors import APIError, error_body, install_error_handlers, internal_error_message, log_internal_error
from quanta.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, PromptError, PromptWork
from quanta.server.metrics import EngineMetrics
from quanta.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest


@dataclass
class ServerState:
    """What the routes need: the engine, its tokenizer, names and limits."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    config: dict
    metrics: EngineMetrics
    #: request bodies over this many bytes get HTTP 413; None: no limit
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES
    prompts: PromptWork = field(init=False)

    def __post_init__(self) -> None:
        self.prompts = PromptWork(self.tokenizer, self.max_model_len)


def build_app(state: ServerState) -> FastAPI:
    """A FastAPI app serving ``state`` (the engine must be started by the caller)."""
    app = FastAPI(title="quanta", version="0.1.0")
    app.state.quanta = state
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=state.max_request_bytes)

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
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "quanta", "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/v1/config")
    async def config() -> dict:
        return state.config

    @app.get("/v1/trace")
    async def trace(since: int = 0) -> dict:
        return {"records": state.engine.engine.trace.to_dicts(since)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if isinstance(body.prompt, list):
            prompt = body.prompt
        else:
            try:
                prompt = await state.prompts.encode(body.prompt, "prompt")
            except PromptError as exc:
                raise APIError(400, str(exc), exc.param) from exc
        _check_token_ids(prompt, state.tokenizer.vocab_size)
        return await _serve(state, request, body, prompt, _CompletionFormat())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            state.prompts.check((m["content"] for m in messages), "messages")
            prompt = await state.prompts.run(state.tokenizer.apply_chat_template, messages)
        except PromptError as exc:
            raise APIError(400, str(exc), exc.param) from exc
        except Exception as exc:  # the model's own template may reject a conversation
            raise APIError(400, f"chat template failed: {exc}", "messages") from exc
        return await _serve(state, request, body, prompt, _ChatFormat())

    from quanta.server.anthropic import add_anthropic_routes  # imports this module's helpers

    add_anthropic_routes(app, state)
    return app


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")


def check_model(state: ServerState, model: str) -> None:
    """Raise a 404 :class:`APIError` unless ``model`` is the served model's id."""
    if model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}", "model", "model_not_found")


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


async def _serve(state: ServerState, request: Request, body: SamplingRequest, prompt: list[int], fmt: "_Format") -> Response:
    check_model(state, body.model)
    max_tokens = body.max_tokens if body.max_tokens is not None else state.max_model_len - len(prompt)
    stream = await submit(state, prompt, max_tokens, body.sampling_params)
    meta = _Meta(fmt.prefix + uuid.uuid4().hex, int(time.time()), state.model_name)
    if body.stream:
        return StreamingResponse(_sse(fmt, meta, stream, body.include_usage), media_type="text/event-stream")
    return await until_disconnect(request, _collect(fmt, meta, stream), stream)


@dataclass
class _Meta:
    id: str
    created: int
    model: str


async def _collect(fmt: "_Format", meta: _Meta, stream: RequestStream) -> Response:
    texts, last = [], None
    async for out in stream:
        texts.append(out.text)
        last = out
    return JSONResponse(fmt.full(meta, "".join(texts), last))


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


async def _sse(fmt: "_Format", meta: _Meta, stream: RequestStream, include_usage: bool):
    def event(payload: dict) -> str:
        if include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    try:
        for opening in fmt.opening(meta):
            yield event(opening)
        async for out in stream:
            if out.text or out.finished:
                yield event(fmt.chunk(meta, out.text, out.finish_reason if out.finished else None))
        if include_usage:
            yield f"data: {json.dumps(fmt.usage_chunk(meta, out))}\n\n"
    except Exception as exc:  # the response began: the error goes in the stream, then [DONE], as vLLM sends it
        message = str(exc) if isinstance(exc, RequestFailed) else internal_error_message(log_internal_error("stream", exc))
        yield f"data: {json.dumps(error_body(500, message))}\n\n"
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"


def _usage(out: RequestOutput) -> dict:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


class _Format:
    """Response shapes of one endpoint."""

    prefix: str
    object: str
    chunk_object: str

    def opening(self, meta: _Meta) -> list[dict]:
        return []

    def _envelope(self, meta: _Meta, obj: str, choices: list[dict]) -> dict:
        return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": choices}

    def usage_chunk(self, meta: _Meta, out: RequestOutput) -> dict:
        return {**self._envelope(meta, self.chunk_object, []), "usage": _usage(out)}


class _CompletionFormat(_Format):
    prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def full(self, meta: _Meta, text: str, last: RequestOutput) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        return {**self._envelope(meta, self.object, [choice]), "usage": _usage(last)}

    def chunk(self, meta: _Meta, text: str, finish_reason: str | None) -> dict:
        return self._envelope(meta, self.chunk_object, [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}])


class _ChatFormat(_Format):
    prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def opening(self, meta: _Meta) -> list[dict]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._envelope(meta, self.chunk_object, [choice])]

    def full(self, meta: _Meta, text: str, last: RequestOutput) -> dict:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": last.finish_reason}
        return {**self._envelope(meta, self.object, [choice]), "usage": _usage(last)}

    def chunk(self, meta: _Meta, text: str, finish_reason: str | None) -> dict:
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope(meta, self.chunk_object, [choice])
