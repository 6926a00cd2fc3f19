"""Ollama's response objects: chat messages, generate responses, NDJSON lines and the final statistics.

A streamed response is NDJSON (``application/x-ndjson``): one object a line,
each ``done: false`` with the text the step released (``message.content`` /
``response``; ``thinking`` for reasoning), then one ``done: true`` object with
``done_reason`` (``stop`` or ``length``; ``load`` for a request with nothing
to generate) and the statistics, durations in nanoseconds:
``total_duration`` (the route's whole time), ``load_duration`` (0: the model
is loaded before the server answers), ``prompt_eval_count`` (the prompt's
tokens, cached ones included), ``prompt_eval_duration`` (from the request's
arrival at the engine to its first token), ``eval_count`` (output tokens)
and ``eval_duration`` (first token to last; at least 1 ns). A failure after
the stream began is a last line ``{"error": "..."}``, as Ollama sends it.

Tool calls are sent whole, as Ollama sends them: ``message.tool_calls``
``[{"id", "function": {"index", "name", "arguments": {...}}}]``, arguments an
object. A call the output cut off (``num_predict``, a stop string) is not
sent when streamed; the non-streamed answer keeps its text as content.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from quanta.engine.output import RequestOutput
from quanta.server.openai.logprobs import LogprobFormatter
from quanta.server.tool_formats.calls import ToolCall, parse_json
from quanta.server.tool_formats.stream import CallClosed, Event, ReasoningDelta, TextDelta, ToolStream


def created_at() -> str:
    """Now in RFC 3339 (UTC), as Ollama's ``created_at``."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def line(payload: dict) -> str:
    """One NDJSON line."""
    return json.dumps(payload, ensure_ascii=False) + "\n"


def error_line(message: str) -> str:
    return line({"error": message})


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def final_fields(started: float, first_token: float | None, last: RequestOutput) -> dict:
    """``done``, ``done_reason`` and the statistics of a finished output (see the module docstring);
    ``started`` and ``first_token`` are ``time.monotonic`` seconds, the engine's clock."""
    first = last.time if first_token is None else first_token
    return {"done": True, "done_reason": last.finish_reason, "total_duration": _ns(time.monotonic() - started),
            "load_duration": 0, "prompt_eval_count": last.num_prompt_tokens,
            "prompt_eval_duration": _ns(first - last.arrival_time), "eval_count": last.num_output_tokens,
            "eval_duration": max(1, _ns(last.time - first))}


def loaded(model: str, chat: bool) -> dict:
    """The answer to a request with nothing to generate (no messages, an empty prompt): the model is loaded."""
    body = {"model": model, "created_at": created_at()}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return {**body, "done": True, "done_reason": "load"}


def ollama_call(call: ToolCall, index: int) -> dict:
    """A call in Ollama's shape (arguments an object)."""
    arguments = parse_json(call.arguments)
    return {"id": call.id, "function": {"index": index, "name": call.name,
                                        "arguments": arguments if isinstance(arguments, dict) else {}}}


class Shape:
    """The objects of one response: ``chat`` (``message``) or generate (``response``).

    Attributes:
        parser: the output's parser (tools, reasoning), or None for plain text.
        keep_thinking: reasoning is returned as ``thinking`` (``think: false`` drops it).
        logprobs: formats the sampler's records when the request asked for them.
    """

    def __init__(self, model: str, chat: bool, parser, keep_thinking: bool, logprobs: LogprobFormatter | None,
                 started: float) -> None:
        self.model, self.chat, self.parser = model, chat, parser
        self.keep_thinking, self.logprobs = keep_thinking, logprobs
        self.stream: ToolStream | None = parser.stream() if parser is not None else None
        self.started = started  # time.monotonic() when the route began
        self.first_token: float | None = None
        self.token_ids: list[int] = []  # the output's, for generate's ``context``
        self._calls = 0

    def _object(self, content: str, thinking: str | None = None, calls: list[dict] | None = None) -> dict:
        body = {"model": self.model, "created_at": created_at()}
        if self.chat:
            message = {"role": "assistant", "content": content}
            message.update({"thinking": thinking} if thinking else {}, **({"tool_calls": calls} if calls else {}))
            return {**body, "message": message}
        return {**body, "response": content, **({"thinking": thinking} if thinking else {})}

    def _lp(self, records) -> dict:
        if self.logprobs is None or records is None:
            return {}
        return {"logprobs": self.logprobs.chat(records)["content"]}

    def observe(self, out: RequestOutput) -> None:
        if out.token_ids and self.first_token is None:
            self.first_token = out.time
        self.token_ids += out.token_ids

    def chunk(self, out: RequestOutput, records: list | None) -> dict | None:
        """The ``done: false`` object of one step's output (None when it released nothing)."""
        self.observe(out)
        if self.stream is None:
            text, thinking, calls = out.text, None, []
        else:
            text, thinking, calls = self._events(self.stream.feed(out.text) + (self.stream.finish() if out.finished else []))
        if not (text or thinking or calls or records):
            return None
        return {**self._object(text, thinking, calls), **self._lp(records), "done": False}

    def _events(self, events: list[Event]) -> tuple[str, str | None, list[dict]]:
        text, thinking, calls = [], [], []
        for event in events:
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, ReasoningDelta) and self.keep_thinking:
                thinking.append(event.text)
            elif isinstance(event, CallClosed) and event.complete:
                calls.append(ollama_call(event.call, self._calls))
                self._calls += 1
        return "".join(text), "".join(thinking) or None, calls

    def final(self, last: RequestOutput, prompt: list[int] | None = None) -> dict:
        """The streamed response's last object: no text, the statistics (generate: ``context`` too)."""
        context = {"context": prompt + self.token_ids} if prompt is not None and not self.chat else {}
        return {**self._object(""), **final_fields(self.started, self.first_token, last), **context}

    def full(self, text: str, last: RequestOutput, records: list | None, prompt: list[int] | None = None) -> dict:
        """The non-streamed response: the whole output parsed (calls, reasoning), the statistics."""
        thinking, calls = None, []
        if self.parser is not None:
            parsed = self.parser.parse(text)
            text = parsed.content or ""
            thinking = parsed.reasoning if self.keep_thinking else None
            calls = [ollama_call(c, i) for i, c in enumerate(parsed.calls)]
        body = {**self._object(text, thinking, calls), **self._lp(records)}
        return {**body, **self.final(last, prompt), **{k: body[k] for k in ("message", "response") if k in body}}
