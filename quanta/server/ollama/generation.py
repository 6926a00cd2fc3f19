"""``POST /api/chat`` and ``POST /api/generate`` over the shared request core.

A chat's ``messages`` (and ``tools``) are rendered by the model's chat
template (:func:`quanta.server.openai.chat.chat_prompt`); a generate's ``prompt`` is
one user turn after its ``system`` turn, or with ``raw: true`` the prompt's
own text, tokenized as it is; its ``context`` (token ids a previous response
returned) goes before it. ``format`` (``"json"`` or a JSON schema) is a
grammar, as OpenAI's ``response_format``; quanta's ``options.tool_choice``
forces a call. ``think``: reasoning the model writes (a model whose template
has a reasoning syntax) is returned as ``thinking``; ``think: false`` leaves
it out of the answer (the template is not told, so the model may still
reason); ``think`` on a model that does not reason is a 400, as Ollama says.
``stream`` defaults to true, as in Ollama.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from quanta.engine.async_engine import RequestStream
from quanta.engine.sampling import SamplingParams
from quanta.server.defaults import output_cap
from quanta.server.errors import APIError
from quanta.server.field_rule import log_fields
from quanta.server.limits import PromptError
from quanta.server.live_log import label_request
from quanta.server.ollama.models import resolve, thinks
from quanta.server.ollama.requests import ChatBody, GenerateBody, openai_messages
from quanta.server.ollama.shapes import Shape, error_line, line, loaded
from quanta.server.openai.chat import chat_prompt, constrain
from quanta.server.openai.logprobs import LogprobFormatter
from quanta.server.serving import ending_in_error, submit, until_disconnect
from quanta.server.tool_formats.registry import forced_grammar, parser_params, request_parser, schema_grammar

#: the media type of a streamed answer
NDJSON = "application/x-ndjson"


async def serve_chat(state, request: Request, body: ChatBody) -> Response:
    started = time.monotonic()
    resolve(state, body.model)
    log_fields("/api/chat", body)
    if not body.messages:
        return _answer(loaded(body.model, chat=True), body.stream)
    _check_think(state, body)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.use_tools else None
    prompt = await chat_prompt(state, openai_messages(body.messages), tools)
    parser = request_parser(state, tools, prompt)  # the schemas type XML-like parameters
    forced = body.forced_tools()
    if forced:
        grammar, param = forced_grammar(state, prompt, forced, False, "options.tool_choice"), "options.tool_choice"
    else:
        grammar, param = _format_grammar(state, body, prompt), "format"
    return await _run(state, request, body, prompt, Shape(body.model, True, parser, body.think is not False,
                                                          _formatter(state, body), started), grammar, param)


async def serve_generate(state, request: Request, body: GenerateBody) -> Response:
    started = time.monotonic()
    resolve(state, body.model)
    log_fields("/api/generate", body)
    if not body.prompt and not body.context:
        return _answer(loaded(body.model, chat=False), body.stream)
    _check_think(state, body)
    prompt = await _generate_prompt(state, body)
    parser = request_parser(state, False, prompt)
    shape = Shape(body.model, False, parser, body.think is not False, _formatter(state, body), started)
    return await _run(state, request, body, prompt, shape, _format_grammar(state, body, prompt), "format")


def _format_grammar(state, body, prompt: list[int]):
    """``format``'s JSON after any reasoning (a reasoning model thinks first; the JSON is the answer)."""
    schema = body.format_schema()
    return schema_grammar(state, prompt, schema) if schema is not None else None


async def _generate_prompt(state, body: GenerateBody) -> list[int]:
    """``context`` then the prompt: its text as it is (``raw``), else ``system`` and ``prompt`` through the template."""
    vocab = state.tokenizer.vocab_size
    bad = [t for t in body.context or () if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"context: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "context")
    if not body.prompt:
        return list(body.context)
    if body.raw:
        try:
            ids = await state.prompts.encode(body.prompt, "prompt")
        except PromptError as exc:
            raise APIError(400, str(exc), exc.param) from exc
    else:
        turns = [{"role": "system", "content": body.system}] if body.system else []
        ids = await chat_prompt(state, turns + [{"role": "user", "content": body.prompt}], None)
    return list(body.context or ()) + ids


def _check_think(state, body) -> None:
    if body.think not in (None, False) and not thinks(state):
        raise APIError(400, f"think: model {body.model!r} does not support thinking", "think")


def _formatter(state, body) -> LogprobFormatter | None:
    return LogprobFormatter(state.tokenizer) if body.logprobs else None


def _answer(payload: dict, stream: bool) -> Response:
    if stream:
        return StreamingResponse(iter([line(payload)]), media_type=NDJSON)
    return JSONResponse(payload)


def _output_tokens(state, body, prompt: list[int]) -> int:
    """The output cap within the request's context (``options.num_ctx``, ``options.num_predict``).

    Raises:
        APIError: 400 naming ``options.num_ctx`` when the prompt does not fit a context it made smaller.
    """
    context = body.options.context(state.max_model_len)
    if len(prompt) >= context and context < state.max_model_len:
        raise APIError(400, f"options.num_ctx: the prompt has {len(prompt)} tokens; a context of {context} holds at most "
                            f"{context - 1} (less one token of output)", "options.num_ctx")
    room = context - len(prompt)
    if body.options.fills_context:
        return max(room, 1)
    return max(min(output_cap(state.config, context, len(prompt), body.options.output_cap()), room), 1)


async def _run(state, request: Request, body, prompt: list[int], shape: Shape, grammar, param: str) -> Response:
    """Submit the request and answer it, streamed (NDJSON) or whole."""
    made: list[SamplingParams] = []

    def make_params(max_tokens: int) -> SamplingParams:
        params = body.options.sampling_params(max_tokens, state.config.get("sampling_defaults") or {})
        params = parser_params(state, shape.parser, replace(params, logprobs=body.num_logprobs))
        made.append(constrain(state, params, grammar, param))
        return made[-1]

    chat = isinstance(body, ChatBody)
    stream = await submit(state, request, prompt, _output_tokens(state, body, prompt), make_params,
                          "messages" if chat else "prompt")
    label_request(state.metrics.live, stream, "ollama-" + uuid.uuid4().hex, request.url.path)
    records = made[0].logprob_records if body.num_logprobs is not None else None
    context = None if chat else prompt
    if body.stream:
        lines = ending_in_error(_lines(shape, stream, records, context), stream, error_line)
        return StreamingResponse(lines, media_type=NDJSON)
    return await until_disconnect(request, _collect(shape, stream, records, context), stream)


async def _lines(shape: Shape, stream: RequestStream, records: list | None, context: list[int] | None):
    seen = 0
    async for out in stream:
        mine = None
        if records is not None:
            mine, seen = records[seen:seen + len(out.token_ids)], seen + len(out.token_ids)
        chunk = shape.chunk(out, mine)
        if chunk is not None:
            yield line(chunk)
        if out.finished:
            yield line(shape.final(out, context))


async def _collect(shape: Shape, stream: RequestStream, records: list | None, context: list[int] | None) -> Response:
    texts, last = [], None
    async for out in stream:
        shape.observe(out)
        texts.append(out.text)
        last = out
    return JSONResponse(shape.full("".join(texts), last, records, context))
