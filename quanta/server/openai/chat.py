"""OpenAI chat and text completions over the engine: prompts with tools,
constraints, and the response shapes (JSON and SSE).

- Tools reach the model through its chat template (:mod:`quanta.server.tool_formats.base`);
  with ``tool_choice`` ``auto`` the output is parsed for calls in the model's
  native format; ``required`` or a named function is enforced by a grammar.
- ``response_format`` and the ``guided_*`` fields become a grammar
  (:mod:`quanta.engine.grammar`); an invalid schema or regex is a 400 naming it.
- ``logprobs`` come from the sampler's records (:mod:`quanta.server.openai.logprobs`).
- Streamed tool calls (:mod:`quanta.server.tool_formats.stream`): text around the
  calls streams as ``content``; a call's first ``delta.tool_calls`` chunk
  carries ``index``, ``id``, ``type`` and ``function.name`` (``arguments:
  ""``), the next ones ``function.arguments`` fragments as the model writes
  them (Hermes; Llama 3 JSON and Mistral send one fragment at the end),
  which concatenate to the non-streamed call's ``arguments``.
  ``finish_reason`` is ``tool_calls`` only when the model stopped after
  complete calls; an output that ended inside a call (a stop string,
  ``max_tokens``, EOS) keeps ``stop`` or ``length`` (its streamed call's
  ``arguments`` are incomplete), streamed or not.
- Streams open at admission (chat's role chunk before the prompt is
  computed) and get a keep-alive chunk (empty ``delta``; completions: empty
  ``text``) every ``--stream-keepalive`` seconds with no chunk
  (:mod:`quanta.server.keepalive`).
- Reasoning the model writes before its answer (``<think>``, harmony's
  analysis channel; :mod:`quanta.server.tool_formats`) is the message's
  ``reasoning_content``, streamed as ``delta.reasoning_content``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from quanta.engine.async_engine import RequestStream
from quanta.engine.grammar import Grammar, GrammarError
from quanta.engine.output import RequestOutput
from quanta.engine.sampling import SamplingParams, TokenLogprob
from quanta.server.defaults import output_cap, served_model, with_defaults
from quanta.server.errors import APIError, stream_error_event
from quanta.server.field_rule import log_fields
from quanta.server.keepalive import keepalive_interval, with_keepalive
from quanta.server.limits import PromptError
from quanta.server.live_log import label_request
from quanta.server.openai.logprobs import LogprobFormatter
from quanta.server.openai.requests import ChatRequest, CompletionsRequest
from quanta.server.serving import ServerState, check_model, ending_in_error, submit, until_disconnect
from quanta.server.system_turns import prompt_ids
from quanta.server.tool_formats.registry import forced_grammar, parser_params, request_parser, schema_grammar
from quanta.server.tool_formats.stream import ArgumentsDelta, CallOpened, Event, ReasoningDelta, TextDelta, ToolStream
from quanta.server.tool_formats.templates import template_input


async def chat_prompt(state, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """Prompt ids of OpenAI-shaped ``messages`` and ``tools`` through the model's
    template, rendered off the event loop (:class:`quanta.server.limits.PromptWork`);
    a later ``system`` message is placed as :mod:`quanta.server.system_turns` says.

    Raises:
        APIError: 400 for lone surrogates, a prompt too long for the context,
            or when the template rejects the conversation.
    """
    msgs, template_tools = template_input(state.tokenizer, messages, tools)
    try:
        state.prompts.check((m.get("content") or "" for m in msgs), "messages")
        return await state.prompts.run(prompt_ids, state.tokenizer, msgs, template_tools)
    except PromptError as exc:
        raise APIError(400, str(exc), exc.param) from exc
    except Exception as exc:  # the model's own template may reject a conversation
        raise APIError(400, f"chat template failed: {exc}", "messages") from exc


def constrain(state, params: SamplingParams, grammar: Grammar | None, param: str | None) -> SamplingParams:
    """``params`` with a fresh matcher of ``grammar`` (unchanged if None).

    Raises:
        APIError: 400 naming ``param`` when the grammar does not compile.
    """
    if grammar is None:
        return params
    try:
        return replace(params, constraint=state.grammars.constraint(grammar))
    except GrammarError as exc:
        raise APIError(400, f"{param}: cannot enforce it: {exc}", param) from exc


def _request_grammar(state, body, prompt: list[int]) -> tuple[Grammar | None, str | None]:
    try:
        guided = body.guided_grammar()
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    if guided is not None:
        return guided
    if isinstance(body, ChatRequest):
        forced = body.forced_tools()
        if forced:
            return forced_grammar(state, prompt, forced, body.parallel_tool_calls), "tool_choice"
        schema = body.response_format.schema() if body.response_format is not None else None
        if schema is not None:
            return schema_grammar(state, prompt, schema), "response_format"
    return None, None


async def serve_chat(state, request: Request, body: ChatRequest) -> Response:
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.use_tools else None
    prompt = await chat_prompt(state, [m.as_dict() for m in body.messages], tools)
    parser = request_parser(state, tools, prompt)
    fmt = ChatFormat(LogprobFormatter(state.tokenizer), parser.stream() if parser is not None else None)
    return await _serve(state, request, body, prompt, fmt, parser)


async def serve_completion(state, request: Request, body: CompletionsRequest) -> Response:
    if isinstance(body.prompt, list):
        prompt = body.prompt
    else:
        try:
            prompt = await state.prompts.encode(body.prompt, "prompt")
        except PromptError as exc:
            raise APIError(400, str(exc), exc.param) from exc
    vocab = state.tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
    return await _serve(state, request, body, prompt, CompletionFormat(LogprobFormatter(state.tokenizer)))


async def _serve(state, request: Request, body, prompt: list[int], fmt: _Format, parser=None) -> Response:
    check_model(state, served_model(state, body))
    log_fields(request.url.path, body)
    grammar, param = _request_grammar(state, body, prompt)
    made: list[SamplingParams] = []

    def make_params(max_tokens: int) -> SamplingParams:
        params = replace(with_defaults(state.config, body, body.sampling_params(max_tokens)), logprobs=body.num_logprobs)
        params = parser_params(state, parser, params)
        made.append(constrain(state, params, grammar, param))
        return made[-1]

    max_tokens = output_cap(state.config, state.max_model_len, len(prompt), body.max_tokens)
    stream = await submit(state, request, prompt, max_tokens, make_params,
                          "messages" if isinstance(body, ChatRequest) else "prompt")
    fmt.meta = _Meta(fmt.prefix + uuid.uuid4().hex, int(time.time()), body.model)
    label_request(state.metrics.live, stream, fmt.meta.id, request.url.path)
    records = made[0].logprob_records if body.num_logprobs is not None else None
    if body.stream:
        events = with_keepalive(_sse(fmt, stream, body.include_usage, records), keepalive_interval(state.config),
                                _event(fmt.keepalive(), body.include_usage))
        return StreamingResponse(events, media_type="text/event-stream")
    return await until_disconnect(request, _collect(fmt, stream, records), stream)


@dataclass
class _Meta:
    id: str
    created: int
    model: str


async def _collect(fmt: _Format, stream: RequestStream, records: list | None) -> Response:
    texts, last = [], None
    async for out in stream:
        texts.append(out.text)
        last = out
    return JSONResponse(fmt.full("".join(texts), last, records))


async def _sse(fmt: _Format, stream: RequestStream, include_usage: bool, records: list | None):
    """The chunks, then ``data: [DONE]``, also after an error event (as vLLM sends it)."""
    async for event in ending_in_error(_chunks(fmt, stream, include_usage, records), stream, _error_event):
        yield event
    yield "data: [DONE]\n\n"


def _error_event(message: str) -> str:
    return stream_error_event("/v1/chat/completions", message)


def _event(payload: dict, include_usage: bool) -> str:
    """One chunk's SSE event (``usage: null`` on each when the final chunk carries usage)."""
    if include_usage:
        payload["usage"] = None
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _chunks(fmt: _Format, stream: RequestStream, include_usage: bool, records: list | None):
    def event(payload: dict) -> str:
        return _event(payload, include_usage)

    seen = 0
    for opening in fmt.opening():
        yield event(opening)
    async for out in stream:
        mine = None
        if records is not None:
            mine, seen = records[seen:seen + len(out.token_ids)], seen + len(out.token_ids)
        for payload in fmt.chunks(out, mine):
            yield event(payload)
    if include_usage:
        yield f"data: {json.dumps(fmt.usage_chunk(out))}\n\n"


def usage(out: RequestOutput) -> dict:
    """OpenAI's ``usage`` object of a (finished) output."""
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


class _Format:
    """Response shapes of one endpoint, for one request."""

    prefix: str
    object: str
    chunk_object: str
    meta: _Meta

    def __init__(self, logprobs: LogprobFormatter) -> None:
        self.logprobs = logprobs

    def opening(self) -> list[dict]:
        return []

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.meta.id, "object": obj, "created": self.meta.created, "model": self.meta.model, "choices": choices}

    def usage_chunk(self, out: RequestOutput) -> dict:
        return {**self.envelope(self.chunk_object, []), "usage": usage(out)}

    def keepalive(self) -> dict:
        """A chunk that says nothing: the stream's keep-alive (:mod:`quanta.server.keepalive`)."""
        raise NotImplementedError


class CompletionFormat(_Format):
    prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def _lp(self, records: list[TokenLogprob] | None) -> dict | None:
        return self.logprobs.completion(records) if records is not None else None

    def full(self, text: str, last: RequestOutput, records: list | None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": self._lp(records), "finish_reason": last.finish_reason}
        return {**self.envelope(self.object, [choice]), "usage": usage(last)}

    def chunks(self, out: RequestOutput, records: list | None) -> list[dict]:
        if not (out.text or out.finished or records):
            return []
        finish = out.finish_reason if out.finished else None
        choice = {"index": 0, "text": out.text, "logprobs": self._lp(records), "finish_reason": finish}
        return [self.envelope(self.chunk_object, [choice])]

    def keepalive(self) -> dict:
        return self.envelope(self.chunk_object, [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}])


class ChatFormat(_Format):
    prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, logprobs: LogprobFormatter, tools: ToolStream | None) -> None:
        super().__init__(logprobs)
        self.tools = tools

    def _lp(self, records: list[TokenLogprob] | None) -> dict | None:
        return self.logprobs.chat(records) if records is not None else None

    def opening(self) -> list[dict]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self.envelope(self.chunk_object, [choice])]

    def full(self, text: str, last: RequestOutput, records: list | None) -> dict:
        message: dict = {"role": "assistant", "content": text}
        finish = last.finish_reason
        if self.tools is not None:
            parsed = self.tools.parser.parse(text)
            if parsed.calls or parsed.content != (text or None):
                message["content"] = parsed.content
            if parsed.reasoning is not None:
                message["reasoning_content"] = parsed.reasoning
            if parsed.calls:
                message["tool_calls"] = [c.openai() for c in parsed.calls]
            if parsed.made_calls:
                finish = _tool_finish(finish)
        choice = {"index": 0, "message": message, "logprobs": self._lp(records), "finish_reason": finish}
        return {**self.envelope(self.object, [choice]), "usage": usage(last)}

    def keepalive(self) -> dict:
        return self._chunk({})

    def _chunk(self, delta: dict, finish: str | None = None, records: list | None = None) -> dict:
        return self.envelope(self.chunk_object, [{"index": 0, "delta": delta, "logprobs": self._lp(records), "finish_reason": finish}])

    def chunks(self, out: RequestOutput, records: list | None) -> list[dict]:
        finish = out.finish_reason if out.finished else None
        if self.tools is None:
            if not (out.text or out.finished or records):
                return []
            return [self._chunk({"content": out.text} if out.text else {}, finish, records)]
        events = self.tools.feed(out.text) + (self.tools.finish() if out.finished else [])
        deltas = [d for d in map(_tool_delta, events) if d is not None]
        if records and not deltas:
            deltas = [{"content": ""}]
        chunks = [self._chunk(d, None, records if i == 0 else None) for i, d in enumerate(deltas)]
        if out.finished:
            chunks.append(self._chunk({}, _tool_finish(finish) if self.tools.made_calls else finish))
        return chunks


def _tool_delta(event: Event) -> dict | None:
    """The chat ``delta`` of one stream event (None for a call's end, which OpenAI does not mark)."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, CallOpened):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    if isinstance(event, ArgumentsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return None


def _tool_finish(finish: str | None) -> str | None:
    """``tool_calls`` when the model stopped after complete calls (a cut-off output keeps ``length``;
    one that ended inside a call keeps ``stop`` or ``length``: callers check ``made_calls`` first)."""
    return "tool_calls" if finish == "stop" else finish


def router(state: ServerState) -> APIRouter:
    """OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions`` over ``state``."""
    routes = APIRouter()

    @routes.post("/v1/completions")
    async def completions(body: CompletionsRequest, request: Request) -> Response:
        return await serve_completion(state, request, body)

    @routes.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        return await serve_chat(state, request, body)

    return routes
