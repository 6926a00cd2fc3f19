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
turns (:mod:`quanta.server.anthropic_tools`); a response's calls are
``tool_use`` blocks with ``stop_reason: tool_use`` (only when the model
stopped after complete calls: one that ended inside a call, e.g. at a stop
sequence, keeps ``stop_sequence`` with it set, or ``max_tokens``, and its
streamed tool_use block has incomplete ``input`` JSON). Images and documents are
refused with a 400; ``cache_control`` markers are accepted and ignored, since
prefix reuse is automatic. An unknown top-level field is a 400 naming it;
``metadata`` (``user_id``; its ``cache_salt`` is honoured), ``service_tier``
and ``container: null`` are accepted with no effect, ``thinking`` only as
``{"type": "disabled"}`` (extended thinking is not supported), and tool names
must be unique.

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens
computed for this request, ``cache_read_input_tokens`` those served from the
prefix cache (their sum is the prompt length), ``cache_creation_input_tokens``
is always 0 (nothing is written on request).

Streaming sends Anthropic's events: ``message_start`` (once the first token is
out, so its usage already counts the cached tokens), ``content_block_start``,
``ping``, ``content_block_delta`` (``text_delta``), ``content_block_stop``,
``message_delta`` (stop reason, cumulative usage) and ``message_stop``. With
tools, blocks come in output order: a text block opens only once text
arrives, and each call is a ``tool_use`` block (``content_block_start`` with
empty ``input`` once its name is out, ``input_json_delta`` events whose
``partial_json`` fragments follow the model's output and concatenate to the
input's JSON, ``content_block_stop``; see :mod:`quanta.server.tools_stream`);
a failure after the stream began is an ``error`` event. Every error is
Anthropic's body ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from quanta.engine.async_engine import RequestStream
from quanta.engine.output import RequestOutput
from quanta.engine.sampling import SamplingParams
from quanta.server.anthropic_tools import AnthropicTool, ToolChoice, chat_messages, tool_use_block, tool_use_id
from quanta.server.chat import constrain
from quanta.server.chat_tokens import chat_prompt_ids, text_ids
from quanta.server.errors import APIError, anthropic_error_body
from quanta.server.limits import PromptError
from quanta.server.openai_requests import unique_tools
from quanta.server.protocol import CacheSalt, NullMeansDefault, StopList, StrictFlag, check_stop_strings, integer, number, only
from quanta.server.serving import ServerState, check_model, ending_in_error, submit, until_disconnect
from quanta.server.tool_templates import render_for_template, template_reads_tools
from quanta.server.tools_stream import ArgumentsDelta, CallOpened, Event, TextDelta, ToolStream, tool_stream


class ContentBlock(BaseModel):
    """A content block: ``text``, ``tool_use`` (assistant) or ``tool_result`` (user)."""

    model_config = ConfigDict(extra="ignore")
    #: the schema lists the served types; others (images, documents) get a 400 naming them
    type: Annotated[str, Field(json_schema_extra={"enum": ["text", "tool_use", "tool_result"]})]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None
    content: str | list | None = None
    is_error: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class CountTokensRequest(NullMeansDefault):
    """``POST /v1/messages/count_tokens``; any field not declared is refused."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[ContentBlock] | None = None
    tools: Annotated[list[AnthropicTool], unique_tools(lambda t: t.name)] | None = None
    tool_choice: ToolChoice | None = None
    #: extended thinking is not supported
    thinking: only({"type": "disabled"}) = None

    @property
    def use_tools(self) -> bool:
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.type != "none")

    def forced_tools(self) -> list[dict] | None:
        """Tools a call must come from (``any``: all, ``tool``: the named one), else None.

        Raises:
            APIError: 400 for a choice without tools or naming an unknown tool.
        """
        choice = self.tool_choice
        if choice is None or choice.type in ("auto", "none"):
            return None
        if not self.tools:
            raise APIError(400, "tool_choice: requires tools")
        tools = [t.openai() for t in self.tools if choice.type == "any" or t.name == choice.name]
        if not tools:
            raise APIError(400, f"tool_choice: names {choice.name!r}, which is not among tools")
        return tools


class Metadata(BaseModel):
    """``metadata``: any fields; ``cache_salt`` there is taken when the top-level one is absent."""

    model_config = ConfigDict(extra="allow")
    cache_salt: CacheSalt | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` (ranges as Anthropic documents them)."""

    max_tokens: integer(ge=1)
    stop_sequences: StopList | None = None
    stream: StrictFlag = False
    temperature: number(ge=0.0, le=1.0) = 1.0
    top_p: number(gt=0.0, le=1.0) | None = None
    top_k: integer(ge=0) | None = None
    cache_salt: CacheSalt | None = None
    metadata: Metadata | None = None
    service_tier: str | None = Field(None, description="accepted; no effect")
    container: only(None) = None

    @field_validator("stop_sequences")
    @classmethod
    def _bounded_stop(cls, stop):
        return stop if stop is None else check_stop_strings(stop, "stop_sequences")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p or 1.0,
            top_k=self.top_k or 0, stop=list(self.stop_sequences or []), cache_salt=self.salt(),
        )

    def salt(self) -> str | None:
        """The top-level ``cache_salt``, else ``metadata.cache_salt`` (None: unsalted)."""
        if self.cache_salt is not None or self.metadata is None:
            return self.cache_salt
        return self.metadata.cache_salt


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
    tools = [t.openai() for t in body.tools] if body.use_tools else None
    prefill = None
    if chat[-1]["role"] == "assistant" and not chat[-1].get("tool_calls"):
        prefill = chat.pop()["content"]
    chat, template_tools = render_for_template(chat, tools, template_reads_tools(state.tokenizer.chat_template))
    try:
        state.prompts.check((m["content"] for m in chat), "messages")
    except PromptError as exc:
        raise APIError(400, str(exc)) from exc
    try:
        ids = await state.prompts.run(chat_prompt_ids, state.tokenizer, chat, template_tools)
    except Exception as exc:  # the model's own template may reject a conversation
        raise APIError(400, f"chat template failed: {exc}") from exc
    if prefill:
        ids += await state.prompts.run(text_ids, state.tokenizer, prefill)  # client text: no control tokens
    return ids


def _stop(out: RequestOutput, called: bool = False) -> tuple[str, str | None]:
    """(Anthropic ``stop_reason``, ``stop_sequence``) of a finished output (``called``: it ended
    after complete tool calls; one that ended inside a call keeps ``stop_sequence``/``max_tokens``/``end_turn``)."""
    if called and out.finish_reason == "stop":
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
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


def _message(msg_id: str, model: str, text: str | None, out: RequestOutput, final: bool, calls=(), called=False) -> dict:
    stop_reason, stop_sequence = _stop(out, called) if final else (None, None)
    content = [{"type": "text", "text": text}] if text is not None and (text or not calls) else []
    return {
        "id": msg_id, "type": "message", "role": "assistant", "model": model,
        "content": content + [tool_use_block(c) for c in calls],
        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": _usage(out, None if final else 0),
    }


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


async def _events(msg_id: str, model: str, stream: RequestStream):
    """Anthropic's SSE events for one request (see the module docstring)."""
    first = await anext(stream)
    yield _event("message_start", {"message": _message(msg_id, model, None, first, final=False)})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield _event("ping", {})
    out = first
    while True:
        if out.text:
            yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": out.text}})
        if out.finished:
            break
        out = await anext(stream)
    stop_reason, stop_sequence = _stop(out)
    yield _event("content_block_stop", {"index": 0})
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": _usage(out)})
    yield _event("message_stop", {})


async def _tool_events(msg_id: str, model: str, stream: RequestStream, tools: ToolStream):
    """The events of a request with tools: blocks in output order (text, tool_use, ...)."""
    out = await anext(stream)
    yield _event("message_start", {"message": _message(msg_id, model, None, out, final=False)})
    yield _event("ping", {})
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
    stop_reason, stop_sequence = _stop(out, tools.made_calls)
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": _usage(out)})
    yield _event("message_stop", {})


class ToolBlocks:
    """Content blocks of a streamed response with tools, from :mod:`quanta.server.tools_stream` events.

    A text block opens when text arrives and closes before a tool_use block;
    a tool_use block opens (``input: {}``) with the call's name, gets one
    ``input_json_delta`` per arguments fragment and closes with the call.
    """

    def __init__(self) -> None:
        self.index = -1  # of the block open or last closed
        self.text_open = False

    def events(self, event: Event) -> list[str]:
        if isinstance(event, TextDelta):
            opening = [] if self.text_open else self._open({"type": "text", "text": ""})
            self.text_open = True
            return opening + [_event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": event.text}})]
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
        self.text_open = False
        return [_event("content_block_stop", {"index": self.index})]

    def _open(self, block: dict) -> list[str]:
        self.index += 1
        return [_event("content_block_start", {"index": self.index, "content_block": block})]


def _error_event(message: str) -> str:
    return _event("error", anthropic_error_body(500, message))


async def _collect(msg_id: str, model: str, stream: RequestStream, parser) -> Response:
    texts, last = [], None
    async for out in stream:
        texts.append(out.text)
        last = out
    text, calls, called = "".join(texts), [], False
    if parser is not None:
        parsed = parser.parse(text)
        if parsed.calls:
            text, calls, called = parsed.content or "", parsed.calls, parsed.made_calls
    return JSONResponse(_message(msg_id, model, text, last, final=True, calls=calls, called=called))


def router(state: ServerState) -> APIRouter:
    """Anthropic's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over ``state``
    (their errors get Anthropic's body from :func:`quanta.server.errors.route_error_body`)."""
    routes = APIRouter()

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        check_model(state, body.model)
        return {"input_tokens": len(await render_prompt(state, body))}

    @routes.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        check_model(state, body.model)
        prompt = await render_prompt(state, body)
        forced = body.forced_tools() if body.use_tools else None
        parallel = not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)
        grammar = state.tool_parser.grammar(forced, parallel) if forced else None
        stream = await submit(state, request, prompt, body.max_tokens,
                              lambda n: constrain(state, body.sampling_params(n), grammar, "tool_choice"))
        msg_id = "msg_" + uuid.uuid4().hex
        parser = state.tool_parser if body.use_tools else None
        if body.stream:
            events = _tool_events(msg_id, body.model, stream, tool_stream(parser)) if parser else _events(msg_id, body.model, stream)
            return StreamingResponse(ending_in_error(events, stream, _error_event), media_type="text/event-stream")
        return await until_disconnect(request, _collect(msg_id, body.model, stream, parser), stream)

    return routes
