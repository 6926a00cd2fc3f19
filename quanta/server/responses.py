"""OpenAI's Responses API: ``POST /v1/responses`` (text and function calls).

Served: ``input`` (a string, or items: messages with ``input_text``/``output_text``
parts, ``function_call`` and ``function_call_output``), ``instructions``,
function ``tools``, ``tool_choice`` (``auto``, ``none``, ``required``, a named
function), ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``,
``top_p``, ``text.format`` (``text``, ``json_object``, ``json_schema``) and
``stream``. Nothing is stored: ``previous_response_id`` is refused (send the
whole conversation, as Codex-style clients with ``store: false`` do), and so
are built-in tools (web search, file search, computer use) and non-text inputs.
An unknown field is a 400 naming it; fields that change nothing here are
accepted (``user``, ``metadata``, ``store`` false, ``service_tier``,
``prompt_cache_key``, ``safety_identifier``, ``include`` empty or
``reasoning.encrypted_content``, ``reasoning`` effort/summary: the model does
not reason, ``truncation`` "disabled"). Tool names are unique and each
``parameters`` schema must compile.

Streaming sends the API's events, each with a ``sequence_number``:
``response.created``, ``response.in_progress``, per output item
``response.output_item.added`` / ``.done``, for text
``response.content_part.added``, ``response.output_text.delta`` /
``.done``, ``response.content_part.done``, for calls
``response.function_call_arguments.delta`` / ``.done``, then
``response.completed`` (or ``response.incomplete`` when ``max_output_tokens``
cut it), or ``error`` if the engine failed mid-stream.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from quanta.engine.async_engine import RequestStream
from quanta.engine.sampling import SamplingParams
from quanta.server.chat import chat_prompt, constrain
from quanta.server.errors import APIError
from quanta.server.openai_requests import ResponseFormat, ToolSchema, unique_tools
from quanta.server.protocol import CacheSalt, NoEffect, NonEmptyText, ReasoningEffort, StrictFlag, UnicodeText, integer, number, only
from quanta.server.serving import ServerState, check_model, ending_in_error, submit, until_disconnect
from quanta.server.tools import ToolCall
from quanta.server.tools_stream import ArgumentsDelta, CallOpened, Event, TextDelta, ToolStream, tool_stream


def served(*kinds: str):
    """A ``type`` string whose served values the schema lists (the route names any other in its 400)."""
    return Annotated[str, Field(json_schema_extra={"enum": list(kinds)})]


class InputPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: served("input_text", "output_text", "text")
    text: str | None = None


class InputItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: served("message", "function_call", "function_call_output") = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: served("function")
    #: required (a forced call needs it), as OpenAI's chat tools spell it
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: UnicodeText | None = None
    parameters: ToolSchema | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f"built-in tools of type {kind!r} are not supported (function tools only)")
        return kind


class NamedChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class Reasoning(BaseModel):
    """``reasoning`` as Codex-style clients send it: accepted, no effect (the model does not reason)."""

    model_config = ConfigDict(extra="forbid")
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(NoEffect):
    """``POST /v1/responses``: an unknown field is a 400; :class:`NoEffect`'s fields,
    ``include`` (empty, or ``reasoning.encrypted_content``), ``reasoning`` (an
    effort and summary; no effect: the model does not reason, so no reasoning
    items are produced or included) and ``truncation`` ("disabled") are accepted."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: NonEmptyText | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], unique_tools(lambda t: t.name)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: StrictFlag = True
    #: OpenAI's minimum is 16
    max_output_tokens: integer(ge=16) | None = None
    temperature: number(ge=0.0, le=2.0) | None = None
    top_p: number(gt=0.0, le=1.0) | None = None
    stream: StrictFlag = False
    text: TextOptions | None = None
    #: must be null (nothing is stored)
    previous_response_id: Any = Field(None, json_schema_extra={"type": "null"})
    cache_salt: CacheSalt | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    reasoning: Reasoning | None = None
    truncation: only(None, "disabled") = None

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, value):
        if value is not None:
            raise ValueError("responses are not stored; send the whole conversation in input instead")
        return value

    def chat_tools(self) -> list[dict]:
        return [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in self.tools or []]

    def messages(self) -> list[dict]:
        """The conversation as OpenAI chat messages (consecutive calls form one assistant turn)."""
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            if item.type == "message":
                out.append({"role": item.role or "user", "content": _text(item.content, f"input.{i}.content")})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments or "{}"}}
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif item.type == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"input.{i}.output")})
            else:
                raise APIError(400, f"input.{i}: items of type {item.type!r} are not supported", f"input.{i}.type")
        return out


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise APIError(400, f"{where}.{j}: content of type {part.type!r} is not supported (text only)", f"{where}.{j}.type")
    return "".join(p.text for p in content)


def _forced(body: ResponsesRequest, tools: list[dict]) -> list[dict] | None:
    if body.tool_choice == "required":
        return tools
    if isinstance(body.tool_choice, NamedChoice):
        named = [t for t in tools if t["function"]["name"] == body.tool_choice.name]
        if not named:
            raise APIError(400, f"tool_choice names {body.tool_choice.name!r}, which is not among tools", "tool_choice")
        return named
    return None


def _grammar(state, body: ResponsesRequest, tools: list[dict]):
    forced = _forced(body, tools) if tools else None
    if forced:
        return state.tool_parser.grammar(forced, body.parallel_tool_calls), "tool_choice"
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        schema = {"schema": fmt.schema_ or {"type": "object"}} if fmt.type == "json_schema" else None
        return ResponseFormat(type=fmt.type, json_schema=schema).grammar(), "text.format"
    if body.tool_choice not in (None, "auto", "none") and not tools:
        raise APIError(400, "tool_choice requires tools", "tool_choice")
    return None, None


class _Builder:
    """Output items and the response object for one request."""

    def __init__(self, body: ResponsesRequest, tools: list[dict]) -> None:
        self.body, self.tools = body, tools
        self.id = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())

    def message(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}

    @staticmethod
    def call(call: ToolCall, status: str = "completed") -> dict:
        return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
                "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}

    def response(self, output: list[dict], last, status: str = "completed") -> dict:
        incomplete = last is not None and last.finish_reason == "length"
        body = self.body
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "model": body.model,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output, "error": None, "instructions": body.instructions,
            "parallel_tool_calls": body.parallel_tool_calls, "tool_choice": _choice_json(body.tool_choice),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "text": {"format": {"type": "text"}} if body.text is None else body.text.model_dump(by_alias=True, exclude_none=True),
            "metadata": {}, "store": False,
        }
        if last is not None:
            cached = last.num_cached_tokens
            out["usage"] = {
                "input_tokens": last.num_prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": last.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
            }
        return out

    def items(self, text: str, calls: list[ToolCall]) -> list[dict]:
        items = [self.message(text)] if text or not calls else []
        return items + [self.call(c) for c in calls]


def _choice_json(choice) -> Any:
    if isinstance(choice, NamedChoice):
        return choice.model_dump()
    return choice or "auto"


async def _collect(builder: _Builder, stream: RequestStream, parser) -> Response:
    texts, last = [], None
    async for out in stream:
        texts.append(out.text)
        last = out
    text, calls = "".join(texts), []
    if parser is not None:
        parsed = parser.parse(text)
        if parsed.calls:
            text, calls = parsed.content or "", parsed.calls
    return JSONResponse(builder.response(builder.items(text, calls), last))


class _Events:
    """Numbered SSE events of one streamed response."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, payload: dict) -> str:
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.n - 1, **payload}, ensure_ascii=False)}\n\n"


def _stream(b: _Builder, stream: RequestStream, tools: ToolStream | None):
    """The response's events; a failure mid-stream ends them with an ``error`` event."""
    ev = _Events()
    return ending_in_error(_events(ev, b, stream, tools), stream,
                           lambda message: ev("error", {"code": "server_error", "message": message, "param": None}))


async def _events(ev: _Events, b: _Builder, stream: RequestStream, tools: ToolStream | None):
    out = None
    yield ev("response.created", {"response": b.response([], None, "in_progress")})
    yield ev("response.in_progress", {"response": b.response([], None, "in_progress")})
    items = _Items(ev, b)
    async for out in stream:
        if tools is None:
            events = [TextDelta(out.text)] if out.text else []
        else:
            events = tools.feed(out.text) + (tools.finish() if out.finished else [])
        for event in events:
            for sse in items.on(event):
                yield sse
    for sse in items.close():
        yield sse
    final = b.response(items.output, out)
    yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", {"response": final})


class _Items:
    """The output items of a streamed response, in output order, from
    :mod:`quanta.server.tools_stream` events: a message item opens when text
    arrives and is done before a function_call item opens; a call's item
    gets one ``response.function_call_arguments.delta`` per arguments
    fragment, then ``.done`` (item ``status: incomplete`` when the output
    ended inside the call). A response with no item gets an empty message."""

    def __init__(self, ev: _Events, b: _Builder) -> None:
        self.ev, self.b = ev, b
        self.output: list[dict] = []  # finished items
        self.text: str | None = None  # of the open message; None when none is open
        self.msg_id = b.msg_id
        self.call_item_id = ""

    def on(self, event: Event) -> list[str]:
        """The SSE events of one stream event."""
        if isinstance(event, TextDelta):
            return self._text(event.text)
        if isinstance(event, CallOpened):
            item = self.b.call(ToolCall(event.name, "", event.id), "in_progress")
            self.call_item_id = item["id"]
            events = self._close_message()
            return events + [self.ev("response.output_item.added", {"output_index": len(self.output), "item": item})]
        if isinstance(event, ArgumentsDelta):
            return [self.ev("response.function_call_arguments.delta",
                            {"item_id": self.call_item_id, "output_index": len(self.output), "delta": event.text})]
        return self._call_done(event.call, "completed" if event.complete else "incomplete")

    def _text(self, delta: str) -> list[str]:
        opening = self._open_message() if self.text is None else []
        self.text += delta
        return opening + [self.ev("response.output_text.delta", {"item_id": self.msg_id, "output_index": len(self.output),
                                                                 "content_index": 0, "delta": delta, "logprobs": []})]

    def _call_done(self, call: ToolCall, status: str) -> list[str]:
        item, index = {**self.b.call(call), "status": status}, len(self.output)
        self.output.append(item)
        return [
            self.ev("response.function_call_arguments.done",
                    {"item_id": item["id"], "output_index": index, "name": call.name, "arguments": call.arguments}),
            self.ev("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def close(self) -> list[str]:
        """Events that end the output: the open message done (an empty one if there was no item)."""
        opening = self._open_message() if not self.output and self.text is None else []
        return opening + self._close_message()

    def _open_message(self) -> list[str]:
        if self.output:
            self.msg_id = "msg_" + uuid.uuid4().hex
        self.text, index = "", len(self.output)
        return [
            self.ev("response.output_item.added", {"output_index": index, "item": self._message("", "in_progress")}),
            self.ev("response.content_part.added", {"item_id": self.msg_id, "output_index": index, "content_index": 0,
                                                    "part": {"type": "output_text", "text": "", "annotations": []}}),
        ]

    def _close_message(self) -> list[str]:
        if self.text is None:
            return []
        text, index, self.text = self.text, len(self.output), None
        part = {"type": "output_text", "text": text, "annotations": []}
        item = self._message(text)
        self.output.append(item)
        return [
            self.ev("response.output_text.done", {"item_id": self.msg_id, "output_index": index, "content_index": 0,
                                                  "text": text, "logprobs": []}),
            self.ev("response.content_part.done", {"item_id": self.msg_id, "output_index": index, "content_index": 0, "part": part}),
            self.ev("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _message(self, text: str, status: str = "completed") -> dict:
        return {**self.b.message(text, status), "id": self.msg_id}


def router(state: ServerState) -> APIRouter:
    """OpenAI's ``POST /v1/responses`` over ``state``."""
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        check_model(state, body.model)
        tools = body.chat_tools() if body.tool_choice != "none" else []
        prompt = await chat_prompt(state, body.messages(), tools or None)
        grammar, param = _grammar(state, body, tools)
        temperature = 1.0 if body.temperature is None else body.temperature

        def make_params(max_tokens: int) -> SamplingParams:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=body.top_p or 1.0,
                                    cache_salt=body.cache_salt)
            return constrain(state, params, grammar, param)

        max_tokens = body.max_output_tokens or state.max_model_len - len(prompt)
        stream = await submit(state, request, prompt, max_tokens, make_params)
        builder = _Builder(body, tools)
        parser = state.tool_parser if tools else None
        if body.stream:
            return StreamingResponse(_stream(builder, stream, tool_stream(parser) if parser else None), media_type="text/event-stream")
        return await until_disconnect(request, _collect(builder, stream, parser), stream)

    return routes
