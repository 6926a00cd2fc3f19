"""OpenAI's Responses API: ``POST /v1/responses`` (text and function calls).

Served: ``input`` (a string, or items: messages with ``input_text``/``output_text``
parts, ``function_call`` and ``function_call_output``), ``instructions``,
function and ``namespace`` ``tools``, ``tool_choice`` (``auto``, ``none``,
``required``, a named function), ``parallel_tool_calls``,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (``text``,
``json_object``, ``json_schema``), ``ignore_eos`` and ``stream``. The body,
what is mapped, accepted with no effect (hosted tools, ``client_metadata``,
``reasoning``) or refused (stored state), is
:mod:`quanta.server.responses.requests`, under
:mod:`quanta.server.field_rule`. Non-text inputs are refused. Output items
come in output order (text, calls, text, as generated), streamed or not; a
message item that ``max_output_tokens`` cut is ``incomplete``, as the response is.
Reasoning the model writes first (:mod:`quanta.server.tool_formats`) is a
``reasoning`` item ahead of them (``response.reasoning_text.delta`` events when streamed).

Streaming sends the API's events, each with a ``sequence_number``:
``response.created``, ``response.in_progress``, per output item
``response.output_item.added`` / ``.done``, for text
``response.content_part.added``, ``response.output_text.delta`` /
``.done``, ``response.content_part.done``, for calls
``response.function_call_arguments.delta`` / ``.done``, then
``response.completed`` (or ``response.incomplete`` when ``max_output_tokens``
cut it), or ``error`` if the engine failed mid-stream. ``response.created``
and ``response.in_progress`` go out at admission, before the prompt is
computed; ``response.in_progress`` again (numbered in sequence) follows every
``--stream-keepalive`` seconds with no event (:mod:`quanta.server.keepalive`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from quanta.engine.async_engine import RequestStream
from quanta.server.defaults import output_cap, served_model, with_defaults
from quanta.server.field_rule import log_fields
from quanta.server.keepalive import keepalive_interval, with_keepalive
from quanta.server.live_log import label_request
from quanta.server.openai.chat import chat_prompt, constrain
from quanta.server.responses.requests import NamedChoice, ResponsesRequest, request_grammar
from quanta.server.serving import ServerState, check_model, ending_in_error, submit, until_disconnect
from quanta.server.tool_formats.calls import ToolCall
from quanta.server.tool_formats.registry import parser_params, request_parser
from quanta.server.tool_formats.stream import ArgumentsDelta, CallOpened, Event, ReasoningDelta, TextDelta, ToolStream

__all__ = ["ResponsesRequest", "router"]


class _Builder:
    """Output items and the response object for one request."""

    def __init__(self, body: ResponsesRequest, tools: list[dict]) -> None:
        self.body, self.tools = body, tools
        self.id = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())

    def message(self, text: str, status: str = "completed", msg_id: str | None = None) -> dict:
        """A message item (``in_progress``: no content yet; ``incomplete``: cut by ``max_output_tokens``)."""
        return {"type": "message", "id": msg_id or self.msg_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": []}]}

    def reasoning(self, text: str, item_id: str | None = None, status: str = "completed") -> dict:
        """A reasoning item: the model's reasoning before its answer, as ``reasoning_text`` content."""
        return {"type": "reasoning", "id": item_id or "rs_" + self.id.removeprefix("resp_"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    def call(self, call: ToolCall, status: str = "completed") -> dict:
        """A function_call item; a namespaced tool's call names its ``namespace`` apart."""
        return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
                **self.body.call_name(call.name), "arguments": call.arguments if status == "completed" else "", "status": status}

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

    def items(self, order: list[str | ToolCall], incomplete: bool) -> list[dict]:
        """The output items of text pieces and calls in output order (a message cut at the end is ``incomplete``)."""
        items, msg_id = [], self.msg_id
        for piece in order or [""]:
            if isinstance(piece, ToolCall):
                items.append(self.call(piece))
            else:
                items.append(self.message(piece, msg_id=msg_id))
                msg_id = "msg_" + uuid.uuid4().hex
        if incomplete and items[-1]["type"] == "message":
            items[-1]["status"] = "incomplete"
        return items


def _choice_json(choice) -> Any:
    if isinstance(choice, NamedChoice):
        return choice.model_dump()
    return choice or "auto"


async def _collect(builder: _Builder, stream: RequestStream, parser) -> Response:
    texts, last = [], None
    async for out in stream:
        texts.append(out.text)
        last = out
    text = "".join(texts)
    parsed = parser.parse(text) if parser is not None else None
    order = parsed.order if parsed is not None and parsed.calls else [text if parsed is None else parsed.content or ""]
    thinking = [builder.reasoning(parsed.reasoning)] if parsed is not None and parsed.reasoning is not None else []
    return JSONResponse(builder.response(thinking + builder.items(order, last.finish_reason == "length"), last))


class _Events:
    """Numbered SSE events of one streamed response."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, payload: dict) -> str:
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.n - 1, **payload}, ensure_ascii=False)}\n\n"


def _stream(b: _Builder, stream: RequestStream, tools: ToolStream | None, ev: _Events):
    """The response's events, numbered by ``ev``; a failure mid-stream ends them with an ``error`` event."""
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
    for sse in items.close(out is not None and out.finish_reason == "length"):
        yield sse
    final = b.response(items.output, out)
    yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", {"response": final})


class _Items:
    """The output items of a streamed response, in output order, from
    :mod:`quanta.server.tool_formats.stream` events: a message item opens when text
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
        self.thought: str | None = None  # of the open reasoning item; None when none is open
        self.reasoning_id = ""

    def on(self, event: Event) -> list[str]:
        """The SSE events of one stream event."""
        if isinstance(event, ReasoningDelta):
            return self._reason(event.text)
        closing = self._close_reasoning()
        return closing + self._on(event)

    def _on(self, event: Event) -> list[str]:
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

    def _reason(self, delta: str) -> list[str]:
        opening = []
        if self.thought is None:
            self.thought, self.reasoning_id = "", "rs_" + uuid.uuid4().hex
            opening = self._close_message() + [self.ev("response.output_item.added", {
                "output_index": len(self.output), "item": {**self.b.reasoning("", self.reasoning_id, "in_progress"), "content": []}})]
        self.thought += delta
        return opening + [self.ev("response.reasoning_text.delta", {"item_id": self.reasoning_id, "output_index": len(self.output),
                                                                    "content_index": 0, "delta": delta})]

    def _close_reasoning(self) -> list[str]:
        if self.thought is None:
            return []
        item, index, self.thought = self.b.reasoning(self.thought, self.reasoning_id), len(self.output), None
        self.output.append(item)
        return [self.ev("response.reasoning_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                                         "text": item["content"][0]["text"]}),
                self.ev("response.output_item.done", {"output_index": index, "item": item})]

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
                    {"item_id": item["id"], "output_index": index, "name": item["name"], "arguments": call.arguments}),
            self.ev("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def close(self, cut: bool = False) -> list[str]:
        """Events that end the output: the open message done (an empty one if there was no item),
        ``incomplete`` when ``max_output_tokens`` (``cut``) ended the output inside it."""
        closing = self._close_reasoning()
        opening = self._open_message() if not self.output and self.text is None else []
        return closing + opening + self._close_message("incomplete" if cut else "completed")

    def _open_message(self) -> list[str]:
        if self.output:
            self.msg_id = "msg_" + uuid.uuid4().hex
        self.text, index = "", len(self.output)
        return [
            self.ev("response.output_item.added", {"output_index": index, "item": self._message("", "in_progress")}),
            self.ev("response.content_part.added", {"item_id": self.msg_id, "output_index": index, "content_index": 0,
                                                    "part": {"type": "output_text", "text": "", "annotations": []}}),
        ]

    def _close_message(self, status: str = "completed") -> list[str]:
        if self.text is None:
            return []
        text, index, self.text = self.text, len(self.output), None
        part = {"type": "output_text", "text": text, "annotations": []}
        item = self._message(text, status)
        self.output.append(item)
        return [
            self.ev("response.output_text.done", {"item_id": self.msg_id, "output_index": index, "content_index": 0,
                                                  "text": text, "logprobs": []}),
            self.ev("response.content_part.done", {"item_id": self.msg_id, "output_index": index, "content_index": 0, "part": part}),
            self.ev("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _message(self, text: str, status: str = "completed") -> dict:
        return self.b.message(text, status, self.msg_id)


def router(state: ServerState) -> APIRouter:
    """OpenAI's ``POST /v1/responses`` over ``state``."""
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        check_model(state, served_model(state, body))
        log_fields("/v1/responses", body)
        tools = body.chat_tools() if body.tool_choice != "none" else []
        prompt = await chat_prompt(state, body.messages(), tools or None)
        grammar, param = request_grammar(state, body, tools, prompt)
        max_tokens = output_cap(state.config, state.max_model_len, len(prompt), body.max_output_tokens)
        parser = request_parser(state, tools, prompt)
        stream = await submit(state, request, prompt, max_tokens, lambda n: constrain(
            state, parser_params(state, parser, with_defaults(state.config, body, body.sampling_params(n))), grammar, param),
            "input")
        builder = _Builder(body, tools)
        label_request(state.metrics.live, stream, builder.id, "/v1/responses")
        if body.stream:
            ev = _Events()  # the keep-alive, response.in_progress again, takes its number in the same sequence
            events = with_keepalive(_stream(builder, stream, parser.stream() if parser else None, ev),
                                    keepalive_interval(state.config),
                                    lambda: ev("response.in_progress", {"response": builder.response([], None, "in_progress")}))
            return StreamingResponse(events, media_type="text/event-stream")
        return await until_disconnect(request, _collect(builder, stream, parser), stream)

    return routes
