"""What every protocol's routes share: the server state, submission to the
engine, the client-disconnect watch, and the end of a stream that failed.

The routers (:mod:`quanta.server.openai.chat` for OpenAI chat and text completions,
:mod:`quanta.server.responses.routes`, :mod:`quanta.server.anthropic.messages`) import this
module and nothing of each other; :mod:`quanta.server.app` composes them.
Routes raise :class:`quanta.server.errors.APIError`; the handlers of
:mod:`quanta.server.errors` write it in the body of the route's protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from quanta.engine.async_engine import AsyncEngine, QueueFullError, RequestFailed, RequestStream
from quanta.engine.grammar import GrammarCompiler
from quanta.model.tokenizer import Tokenizer
from quanta.server.access import TENANT_STATE, AccessPolicy, tenant_salt
from quanta.server.errors import APIError, internal_error_message, log_internal_error, quoted
from quanta.server.limits import DEFAULT_MAX_REQUEST_BYTES, RESERVATION, BuildTimeout, PromptWork
from quanta.server.metrics import EngineMetrics
from quanta.server.tool_formats.base import ToolParser
from quanta.server.tool_formats.reasoning import ReasoningSyntax
from quanta.server.tool_formats.registry import choose_parser, choose_reasoning


@dataclass
class ServerState:
    """What the routes need: the engine, its tokenizer, names and limits.

    Attributes:
        async_engine: the engine thread's front (started by the caller).
        model_name: the model's id (the first ``--served-model-name``).
        aliases: further ids the routes accept (later ``--served-model-name`` values).
        tool_call_parser: ``--tool-call-parser`` (None: chosen from the chat template).
        reasoning_parser: ``--reasoning-parser`` (None: chosen from the chat template).
        access: ``--api-key``, ``--allowed-hosts``, ``--cors-origin`` (:mod:`quanta.server.access`).
    """

    async_engine: AsyncEngine
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
    reasoning_parser: str | None = None
    prompts: PromptWork = field(init=False)
    tool_parser: ToolParser = field(init=False)
    reasoning: ReasoningSyntax | None = field(init=False)
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self) -> None:
        self.prompts = PromptWork(self.tokenizer, self.max_model_len)
        self.tool_parser = choose_parser(self.tokenizer.chat_template, self.tool_call_parser)
        self.reasoning = choose_reasoning(self.tokenizer.chat_template, self.reasoning_parser)
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.tokenizer.eos_token_ids)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)


def check_model(state: ServerState, model: str) -> None:
    """Raise a 404 :class:`APIError` unless ``model`` is one of the served model's ids."""
    if model not in state.model_names:
        served = " or ".join(repr(n) for n in state.model_names)
        raise APIError(404, f"model {quoted(model)} does not exist; this server serves {served}", "model", "model_not_found")


async def submit(state: ServerState, request: Request, prompt: list[int], max_tokens: int, make_params,
                 prompt_param: str = "prompt") -> RequestStream:
    """Check lengths, build the sampling parameters and hand the request to the engine.

    ``max_tokens`` larger than the room the prompt leaves in ``max_model_len``
    is clamped to that room (as llama.cpp's server does; OpenAI and vLLM
    refuse): coding agents send fixed output caps (8,000-32,000) whatever the
    context, and an output the room cut ends as a ``length`` finish. A prompt
    that leaves no room (``max_model_len`` tokens or more) is a 400 naming
    ``prompt_param``, the field the prompt came from (``prompt``, ``messages``, ``input``).

    The length check comes first, so no grammar is compiled for a request that
    cannot run, and it is the request's only one: the engine is told it passed.
    ``make_params`` runs on a worker thread within a time bound
    (:meth:`PromptWork.build`): compiling a grammar never stalls the event loop.
    The request's place in the queue (:class:`quanta.server.limits.Admission`)
    goes to the engine with it. The stream comes back without waiting for the
    engine thread to accept the request (it does so between steps): a streamed
    route sends its opening events at once, and its first read waits.
    With ``--api-key``, the tenant the access gate matched (``request.state``)
    is folded into ``cache_salt`` (:func:`quanta.server.access.tenant_salt`):
    prefix reuse then stays within one key, whatever salt the body sent.

    Args:
        request: the HTTP request (its ASGI scope state names the tenant).
        max_tokens: output tokens at most.
        make_params: ``max_tokens -> SamplingParams`` (may raise ``ValueError``
            or :class:`APIError`); called on a worker thread.

    Raises:
        APIError: 400 (lengths, parameters, a grammar over its time bound),
            429 (queue full), 503 (engine down).
    """
    room = state.max_model_len - len(prompt)
    if room < 1:
        raise APIError(400, f"the prompt has {len(prompt)} tokens; at most {state.max_model_len - 1} fit "
                            f"(max_model_len {state.max_model_len} less one token of output)", prompt_param)
    max_tokens = min(max_tokens, room)  # a cap larger than the room left is clamped to it, as llama.cpp does
    try:
        state.async_engine.check_length(len(prompt), max(max_tokens, 1))
        params = await state.prompts.build(make_params, max_tokens)
        params.cache_salt = tenant_salt(request.scope.get("state", {}).get(TENANT_STATE), params.cache_salt)
    except BuildTimeout as exc:
        raise APIError(400, f"{exc}: the request's constraint (schema, regex, choices or tools) is too complex; "
                            "simplify it") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), "max_tokens" if "max_model_len" in str(exc) else None) from exc
    try:
        return await state.async_engine.submit(prompt, params, length_checked=True,
                                               reservation=request.scope.get(RESERVATION), wait=False)
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


async def ending_in_error(events: AsyncIterator[str], stream: RequestStream,
                          error_event: Callable[[str], str]) -> AsyncIterator[str]:
    """The SSE ``events`` of one request; if they fail after the response began,
    the stream ends with ``error_event(message)`` instead of a silent cut.

    The message is the engine's own for :class:`RequestFailed` (it names an
    error id); any other exception is logged under a new id that the message
    names. The request is aborted when the stream ends, however it ends.
    """
    try:
        async for event in events:
            yield event
    except Exception as exc:  # the response began: the error goes in the stream
        message = str(exc) if isinstance(exc, RequestFailed) else internal_error_message(log_internal_error("stream", exc))
        yield error_event(message)
    finally:
        stream.abort()
