"""Anthropic's Messages API over the same engine: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

Text content only: ``system`` (a string or text blocks), ``messages`` whose
content is a string or text blocks (concatenated), ``max_tokens``,
``stop_sequences``, ``stream``, and ``temperature`` (0-1, default 1.0),
``top_p``, ``top_k`` (the current official client no longer sends these; pass
them with ``extra_body``). A final ``assistant`` message is a prefill:
generation continues after its text.
Tools: ``tools``, ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``),
``tool_use`` blocks in assistant turns and ``tool_result`` blocks in user
turns (:mod:`quanta.server.anthropic.tools`); a response's calls are
``tool_use`` blocks with ``stop_reason: tool_use`` (only when the model
stopped after complete calls: one that ended inside a call, e.g. at a stop
sequence, keeps ``stop_sequence`` with it set, or ``max_tokens``, and its
streamed tool_use block has incomplete ``input`` JSON). Images and documents are
refused with a 400; ``cache_control`` markers are accepted and ignored, since
prefix reuse is automatic. Other fields follow :mod:`quanta.server.field_rule`
(the bodies, with what is mapped and what has no effect:
:mod:`quanta.server.anthropic.requests`): ``output_config.format`` is a JSON
schema constraint, a mid-conversation ``system`` message a system turn,
``thinking``, ``output_config.effort`` and ``context_management`` have no
effect. Tool names must be unique. A non-streamed answer lists text and
tool_use blocks in output order, as the stream does; reasoning the model
writes first (:mod:`quanta.server.tool_formats`) is a ``thinking`` block
ahead of them (``thinking_delta`` events when streamed).

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens
computed for this request, ``cache_read_input_tokens`` those served from the
prefix cache (their sum is the prompt length), ``cache_creation_input_tokens``
is always 0 (nothing is written on request).

Streaming sends Anthropic's events: ``message_start`` (at once, before the
prompt is computed: its usage counts the whole prompt as ``input_tokens``;
the final ``message_delta`` usage splits off the cached tokens), ``ping``
every ``--stream-keepalive`` seconds while nothing else is sent
(:mod:`quanta.server.keepalive`), ``content_block_start``, ``ping``,
``content_block_delta`` (``text_delta``), ``content_block_stop``,
``message_delta`` (stop reason, cumulative usage) and ``message_stop``. With
tools, blocks come in output order: a text block opens only once text
arrives, and each call is a ``tool_use`` block (``content_block_start`` with
empty ``input`` once its name is out, ``input_json_delta`` events whose
``partial_json`` fragments follow the model's output and concatenate to the
input's JSON, ``content_block_stop``; see :mod:`quanta.server.tool_formats.stream`);
a failure after the stream began is an ``error`` event. Every error is
Anthropic's body ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from quanta.engine.async_engine import RequestStream
from quanta.engine.output import RequestOutput
from quanta.server.anthropic.requests import ContentBlock, CountTokensRequest, MessagesRequest
from quanta.server.anthropic.tools import chat_messages, thinking_block, tool_use_block, tool_use_id
from quanta.server.chat_tokens import text_ids
from quanta.server.defaults import served_model, with_defaults
from quanta.server.errors import ANTHROPIC_PREFIX, APIError, stream_error_event
from quanta.server.field_rule import log_fields
from quanta.server.keepalive import keepalive_interval, with_keepalive
from quanta.server.limits import PromptError
from quanta.server.live_log import label_request
from quanta.server.openai.chat import constrain
from quanta.server.serving import ServerState, check_model, ending_in_error, submit, until_disconnect
from quanta.server.system_turns import prompt_ids
from quanta.server.tool_formats.calls import ToolCall
from quanta.server.tool_formats.registry import forced_grammar, parser_params, request_parser, schema_grammar
from quanta.server.tool_formats.stream import ArgumentsDelta, CallOpened, Event, ReasoningDelta, TextDelta, ToolStream
from quanta.server.tool_formats.templates import template_input


def _text(content: str | list[ContentBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    for i, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise APIError(
                400, f"{where}.{i}: content blocks of type {block.type!r} are not supported "
                "(text only)",
            )
    return "".join(b.text for b in content)


async def render_prompt(state: ServerState, body: CountTokensRequest) -> list[int]:
    """Prompt token ids: the chat template over ``system`` and ``messages``,
    rendered and tokenized off the event loop (:class:`quanta.server.limits.PromptWork`).

    A final ``assistant`` message is continued: the template renders the
    turns before it with the generation prompt, then its text follows.

    Raises:
        APIError: 400 for tools, non-text content, lone surrogates, a
            prompt too long for the context or a template failure.
    """
    chat = []
    if body.system:
        chat.append({"role": "system", "content": _text(body.system, "system")})
    chat += chat_messages(body.messages, APIError)
    tools = [t.openai() for t in body.function_tools()] if body.use_tools else None
    prefill = None
    if chat[-1]["role"] == "assistant" and not chat[-1].get("tool_calls"):
        prefill = chat.pop()["content"]
    chat, template_tools = template_input(state.tokenizer, chat, tools)
    try:
        state.prompts.check([*(m.get("content") or "" for m in chat), prefill or ""], "messages")  # the prefill is prompt text too
    except PromptError as exc:
        raise APIError(400, str(exc)) from exc
    try:
        ids = await state.prompts.run(prompt_ids, state.tokenizer, chat, template_tools)
    except Exception as exc:  # the model's own template may reject a conversation
        raise APIError(400, f"chat template failed: {exc}") from exc
    if prefill:
        ids += await state.prompts.run(text_ids, state.tokenizer, prefill)  # client text: no control tokens
    return ids


def _stop(out: RequestOutput, cap: int, called: bool = False) -> tuple[str, str | None]:
    """(Anthropic ``stop_reason``, ``stop_sequence``) of a finished output (``called``: it ended
    after complete tool calls; one that ended inside a call keeps ``stop_sequence``/``max_tokens``/``end_turn``).

    A length finish short of the request's ``max_tokens`` (``cap``) is the context's end, where the
    cap was clamped to the room left: ``model_context_window_exceeded``, as Anthropic's API says it
    (an agent that continues an answer cut by ``max_tokens`` would resend a context already full)."""
    if called and out.finish_reason == "stop":
        return "tool_use", None
    if out.finish_reason == "length":
        return ("max_tokens" if out.num_output_tokens >= cap else "model_context_window_exceeded"), None
    if out.stop_string is not None:
        return "stop_sequence", out.stop_string
    return "end_turn", None


def _usage(out: RequestOutput, output_tokens: int | None = None) -> dict:
    return {
        "input_tokens": out.num_prompt_tokens - out.num_cached_tokens,
        "output_tokens": out.num_output_tokens if output_tokens is None else output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": out.num_cached_tokens,
    }


def _message(msg_id: str, model: str, content: list[dict], out: RequestOutput, final: bool, cap: int = 0,
             called=False) -> dict:
    stop_reason, stop_sequence = _stop(out, cap, called) if final else (None, None)
    return {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": _usage(out, None if final else 0),
    }


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


def _start(msg_id: str, model: str, num_prompt_tokens: int) -> str:
    """``message_start``, sent before any prompt token is computed: its usage counts the
    whole prompt as input (``message_delta``'s usage has the prefix cache's share)."""
    usage = {"input_tokens": num_prompt_tokens, "output_tokens": 0,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    return _event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage}})


PING = _event("ping", {})


async def _events(msg_id: str, model: str, stream: RequestStream, cap: int, num_prompt_tokens: int):
    """Anthropic's SSE events for one request (see the module docstring)."""
    yield _start(msg_id, model, num_prompt_tokens)
    first = await anext(stream)
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield PING
    out = first
    while True:
        if out.text:
            yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": out.text}})
        if out.finished:
            break
        out = await anext(stream)
    stop_reason, stop_sequence = _stop(out, cap)
    yield _event("content_block_stop", {"index": 0})
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": _usage(out)})
    yield _event("message_stop", {})


async def _tool_events(msg_id: str, model: str, stream: RequestStream, tools: ToolStream, cap: int,
                       num_prompt_tokens: int):
    """The events of a request with tools: blocks in output order (text, tool_use, ...)."""
    yield _start(msg_id, model, num_prompt_tokens)
    out = await anext(stream)
    yield PING
    blocks = ToolBlocks()
    while True:
        for event in tools.feed(out.text) + (tools.finish() if out.finished else []):
            for sse in blocks.events(event):
                yield sse
        if out.finished:
            break
        out = await anext(stream)
    for sse in blocks.close_text():
        yield sse
    stop_reason, stop_sequence = _stop(out, cap, tools.made_calls)
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": _usage(out)})
    yield _event("message_stop", {})


class ToolBlocks:
    """Content blocks of a streamed response with tools, from :mod:`quanta.server.tool_formats.stream` events.

    A text block opens when text arrives and closes before a tool_use block;
    a thinking block likewise with reasoning (``thinking_delta``s); a tool_use
    block opens (``input: {}``) with the call's name, gets one
    ``input_json_delta`` per arguments fragment and closes with the call.
    """

    def __init__(self) -> None:
        self.index = -1  # of the block open or last closed
        self.text_open: str | None = None  # the open text-like block's type (text, thinking)

    def events(self, event: Event) -> list[str]:
        if isinstance(event, TextDelta | ReasoningDelta):
            kind, delta = ("text", {"type": "text_delta", "text": event.text}) if isinstance(event, TextDelta) \
                else ("thinking", {"type": "thinking_delta", "thinking": event.text})
            opening = [] if self.text_open == kind else self.close_text() + self._open(
                {"type": "text", "text": ""} if kind == "text" else thinking_block(""))
            self.text_open = kind
            return opening + [_event("content_block_delta", {"index": self.index, "delta": delta})]
        if isinstance(event, CallOpened):
            block = {"type": "tool_use", "id": tool_use_id(event.id), "name": event.name, "input": {}}
            return self.close_text() + self._open(block)
        if isinstance(event, ArgumentsDelta):
            delta = {"type": "input_json_delta", "partial_json": event.text}
            return [_event("content_block_delta", {"index": self.index, "delta": delta})]
        return [_event("content_block_stop", {"index": self.index})]

    def close_text(self) -> list[str]:
        if not self.text_open:
            return []
        self.text_open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _open(self, block: dict) -> list[str]:
        self.index += 1
        return [_event("content_block_start", {"index": self.index, "content_block": block})]


def _error_event(message: str) -> str:
    return stream_error_event(ANTHROPIC_PREFIX, message)


async def _collect(msg_id: str, model: str, stream: RequestStream, parser, cap: int) -> Response:
    texts, last = [], None
    async for out in stream:
        texts.append(out.text)
        last = out
    text = "".join(texts)
    parsed = parser.parse(text) if parser is not None else None
    thinking = [thinking_block(parsed.reasoning)] if parsed is not None and parsed.reasoning is not None else []
    if parsed is None or not parsed.calls:
        answer = text if parsed is None else parsed.content or ""
        return JSONResponse(_message(msg_id, model, thinking + [{"type": "text", "text": answer}], last, final=True, cap=cap))
    blocks = [tool_use_block(p) if isinstance(p, ToolCall) else {"type": "text", "text": p} for p in parsed.order]
    return JSONResponse(_message(msg_id, model, thinking + blocks, last, final=True, cap=cap, called=parsed.made_calls))


def router(state: ServerState) -> APIRouter:
    """Anthropic's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over ``state``
    (their errors get Anthropic's body from :func:`quanta.server.errors.route_error_body`)."""
    routes = APIRouter()

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        check_model(state, served_model(state, body))
        log_fields("/v1/messages/count_tokens", body)
        return {"input_tokens": len(await render_prompt(state, body))}

    @routes.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        check_model(state, served_model(state, body))
        log_fields("/v1/messages", body)
        prompt = await render_prompt(state, body)
        grammar, param = request_grammar(state, body, prompt)
        parser = request_parser(state, body.chat_tools(), prompt)
        stream = await submit(state, request, prompt, body.max_tokens, lambda n: constrain(
            state, parser_params(state, parser, with_defaults(state.config, body, body.sampling_params(n))), grammar, param),
            "messages")
        msg_id = "msg_" + uuid.uuid4().hex
        label_request(state.metrics.live, stream, msg_id, "/v1/messages")
        if body.stream:
            events = (_tool_events(msg_id, body.model, stream, parser.stream(), body.max_tokens, len(prompt)) if parser
                      else _events(msg_id, body.model, stream, body.max_tokens, len(prompt)))
            sse = with_keepalive(ending_in_error(events, stream, _error_event), keepalive_interval(state.config), PING)
            return StreamingResponse(sse, media_type="text/event-stream")
        return await until_disconnect(request, _collect(msg_id, body.model, stream, parser, body.max_tokens), stream)

    return routes


def request_grammar(state, body: MessagesRequest, prompt: list[int]):
    """(grammar, the field it enforces): a forced call (a choice that forces a server tool, or no
    tool at all, is a 400), else ``output_config.format``'s JSON after any reasoning, else None.
    A forced call wins over the format, which governs a text answer."""
    forced = body.forced_tools()
    if forced:
        parallel = not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)
        return forced_grammar(state, prompt, forced, parallel), "tool_choice"
    schema = body.format_schema()
    return (schema_grammar(state, prompt, schema) if schema is not None else None), "output_config.format"
