"""Input limits that keep one request from stalling the server.

* :class:`BodyLimit`: an ASGI middleware answering HTTP 413 to a request body
  over ``--max-request-bytes`` before any of it is parsed (chunked bodies
  included: it stops reading at the limit), and HTTP 408 to one that has not
  all arrived :data:`BODY_TIMEOUT_S` seconds after its head (a client
  trickling its body would otherwise hold its connection for ever). It
  also answers 413, before the body is parsed, to one with more commas,
  colons and opening brackets (strings included: a count of each byte,
  ~2 ms a MiB) than a request the server can run holds
  (:attr:`PromptWork.max_structure`): parsing and validating JSON hold the
  GIL, so a worker thread would not free the event loop for them, and their
  cost grows with that count (16 MiB of token ids take ~0.5 s to parse, of
  empty lists ~1.6 s).
* :class:`Admission`: an ASGI middleware that makes each request to a
  generation route hold a place in ``--max-queue`` from the moment its body
  is read (:meth:`quanta.engine.async_engine.AsyncEngine.reserve`), so
  templating, tokenizing and grammar compilation count as waiting; a full
  queue is a 429 before any of that work. It also sets
  :data:`PROMPT_TOKEN_LIMIT` for the request, so that validation refuses a
  token-id prompt longer than the context by its length alone, before
  checking each id (and a conversation of more turns than it can hold by
  their number, before validating each: :func:`too_many_messages`), and
  makes the tool schemas that validation compiles count toward one
  request-wide budget
  (:func:`quanta.engine.grammar_bounds.count_request_schemas`).
* :class:`PromptWork`: tokenization and chat templating on a small thread
  pool, never on the event loop (Hugging Face's fast tokenizer releases the
  GIL, so ``/health`` and other streams keep being served), after cheap
  checks on the text: no lone UTF-16 surrogates (``"a\\ud800b"`` is valid JSON
  but no text; the tokenizer cannot take it), no more characters than
  ``max_model_len`` tokens could span and no more messages than
  ``max_model_len - 1`` (each takes a token at least), so an oversized
  prompt is refused before it is tokenized. Sampling parameters (grammar
  compilation) are built on a second pool, within :data:`BUILD_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import TypeVar

from quanta.engine.async_engine import AsyncEngine, QueueFullError
from quanta.engine.grammar_bounds import MAX_GRAMMAR_CHARS, count_request_schemas
from quanta.model.tokenizer import Tokenizer
from quanta.server import DEFAULT_MAX_REQUEST_BYTES
from quanta.server.access import refuse
from quanta.server.errors import RAW_BODY

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "PROMPT_TOKEN_LIMIT", "RESERVATION", "Admission", "BodyLimit", "BuildTimeout",
           "PromptError", "PromptWork", "surrogate_problem", "too_many_messages"]

#: Threads that tokenize and render chat templates; threads that build sampling parameters (compile grammars).
PROMPT_WORKERS, BUILD_WORKERS = 2, 2

#: Seconds a request's sampling parameters (its grammar) may take to build, waiting for a thread included.
BUILD_TIMEOUT_S = 10.0

#: Seconds a request body may take to arrive (measured from the route's first read).
BODY_TIMEOUT_S = 60.0

#: The bytes :class:`BodyLimit` counts in a body before it is parsed: JSON's separators and opening brackets.
STRUCTURE_BYTES = (b",", b":", b"[", b"{")

#: ASGI scope key of the request's :class:`quanta.engine.async_engine.Reservation`.
RESERVATION = "quanta.reservation"

#: Token ids a prompt may have on the server handling the current request
#: (``max_model_len - 1``; set by :class:`Admission`, None outside a request).
PROMPT_TOKEN_LIMIT: ContextVar[int | None] = ContextVar("quanta_prompt_token_limit", default=None)

#: Bytes of an oversized body read and discarded before the 413 goes out, so
#: that the client, still sending, reads the answer instead of a connection
#: reset (closing a socket with unread data resets it).
DRAIN_BYTES = 64 * 2**20

T = TypeVar("T")


class BodyLimit:
    """ASGI middleware: HTTP 413 for a request body over ``max_bytes`` bytes,
    or with more :data:`STRUCTURE_BYTES` than a request can need.

    The body is read here (up to the limit) and handed on to the app
    unchanged; the 413 carries the error body of the route's API. The rest
    of an oversized body is read and dropped (up to :data:`DRAIN_BYTES`)
    before answering; memory never holds more than ``max_bytes`` of it.

    Args:
        app: the wrapped ASGI app.
        max_bytes: the largest body accepted; None disables both limits.
        max_structure: the most :data:`STRUCTURE_BYTES` a body may hold (:attr:`PromptWork.max_structure`).
    """

    def __init__(self, app, max_bytes: int | None, max_structure: int) -> None:
        self.app, self.max_bytes, self.max_structure = app, max_bytes, max_structure

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.max_bytes is None:
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                body = await self._read(scope, receive, send)
        except TimeoutError:
            await refuse(scope, send, 408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                         [(b"connection", b"close")])
            return
        if body is None:
            return
        structure = sum(map(body.count, STRUCTURE_BYTES))
        if structure > self.max_structure:
            await refuse(scope, send, 413, f"the request body has {structure} commas, colons and opening brackets; no request "
                         f"that fits this server's context (--max-model-len) has more than {self.max_structure}")
            return
        scope[RAW_BODY] = body  # for the error handlers (quanta.server.errors)
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once answered (413) or the client left."""
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if await _drain(receive, DRAIN_BYTES):
                await self._refuse(scope, send, int(declared))
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                chunks.clear()
                if not message.get("more_body", False) or await _drain(receive, DRAIN_BYTES):
                    await self._refuse(scope, send, None)
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope, send, size: int | None) -> None:
        got = f"{size} bytes" if size is not None else "more"
        message = f"the request body has {got}; this server accepts at most {self.max_bytes} bytes (--max-request-bytes)"
        await refuse(scope, send, 413, message, [(b"connection", b"close")])


class Admission:
    """ASGI middleware: a POST to one of ``paths`` holds a place in the engine's
    queue (:meth:`AsyncEngine.reserve`) while the route prepares it; the place
    is in the scope under :data:`RESERVATION` for :func:`quanta.server.serving.submit`
    to hand to the engine. A full queue is answered 429 here. Every request
    runs with :data:`PROMPT_TOKEN_LIMIT` set to ``max_prompt_tokens`` and its
    own schema budget (:func:`quanta.engine.grammar_bounds.count_request_schemas`).
    """

    def __init__(self, app, engine: AsyncEngine, paths: frozenset[str], max_prompt_tokens: int) -> None:
        self.app, self.engine, self.paths = app, engine, paths
        self.max_prompt_tokens = max_prompt_tokens

    async def __call__(self, scope, receive, send) -> None:
        PROMPT_TOKEN_LIMIT.set(self.max_prompt_tokens)  # this request's context only
        count_request_schemas()
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        try:
            reservation = self.engine.reserve()
        except QueueFullError as exc:
            await refuse(scope, send, 429, str(exc))
            return
        with reservation:
            scope[RESERVATION] = reservation
            await self.app(scope, receive, send)


async def _drain(receive, limit: int) -> bool:
    """Read and drop body messages until the body ends (True) or ``limit``
    bytes went by; False when the client disconnected."""
    dropped = 0
    while dropped <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return False
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return True


def _replay(body: bytes, receive):
    """A ``receive`` that yields ``body`` once, then the client's later messages (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class PromptError(ValueError):
    """A prompt refused before or while tokenizing it; ``param`` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class BuildTimeout(TimeoutError):
    """Building a request's sampling parameters (its grammar) took longer than :data:`BUILD_TIMEOUT_S`."""


class PromptWork:
    """Checks prompt text, then tokenizes it on a thread pool; builds sampling parameters on another.

    Args:
        tokenizer: the served model's tokenizer.
        max_model_len: context length in tokens; a prompt must leave room for
            one output token.
        workers: threads of the pool.
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, workers: int = PROMPT_WORKERS) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_model_len - 1
        #: no token of the vocabulary decodes to more characters than this
        self.max_token_chars = tokenizer.max_token_chars
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="quanta-prompt")
        self._build_pool = ThreadPoolExecutor(BUILD_WORKERS, thread_name_prefix="quanta-build")

    @property
    def max_chars(self) -> int:
        """Characters beyond which a prompt cannot fit in ``max_prompt_tokens`` tokens."""
        return self.max_prompt_tokens * self.max_token_chars

    @property
    def max_structure(self) -> int:
        """:data:`STRUCTURE_BYTES` beyond which no request body fits: one per character of the
        longest prompt (the JSON around a prompt's parts is far within that bound's slack: a
        token is a few characters, rarely :attr:`max_token_chars`), plus
        :data:`~quanta.engine.grammar_bounds.MAX_GRAMMAR_CHARS` for a grammar, no part of the prompt."""
        return self.max_chars + MAX_GRAMMAR_CHARS

    def check(self, texts: Iterable[str], param: str) -> None:
        """Refuse lone surrogates and text longer than any fitting prompt.

        ``texts`` are parts of one prompt (message contents, one per message):
        their total length and their number are bounded.

        Raises:
            PromptError: naming ``param``.
        """
        total = count = 0
        for text in texts:
            count += 1
            if count > self.max_prompt_tokens:
                raise PromptError(f"{param}: {too_many_messages(self.max_prompt_tokens)}", param)
            _check_surrogates(text, param)
            total += len(text)
        if total > self.max_chars:
            raise PromptError(
                f"{param}: the prompt has {total} characters, more than {self.max_prompt_tokens} tokens "
                f"(max_model_len - 1) can hold: no token of this model spans more than {self.max_token_chars} characters",
                param,
            )

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the pool (tokenizing, templating); its exceptions propagate."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def build(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the build pool (sampling parameters: grammar compilation).

        Raises:
            BuildTimeout: it took longer than :data:`BUILD_TIMEOUT_S` (the thread
                finishes in the background; its result is dropped).
        """
        work = asyncio.get_running_loop().run_in_executor(self._build_pool, fn, *args)
        try:
            return await asyncio.wait_for(work, BUILD_TIMEOUT_S)
        except TimeoutError as exc:
            raise BuildTimeout(f"building the request took more than {BUILD_TIMEOUT_S:g} s") from exc

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        """:meth:`check` then ``tokenizer.encode`` off the event loop."""
        self.check([text], param)
        return await self.run(self.tokenizer.encode, text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._build_pool.shutdown(wait=False, cancel_futures=True)


def too_many_messages(max_prompt_tokens: int) -> str:
    """Why more than ``max_prompt_tokens`` messages are refused, before anything else is done with them."""
    return (f"more than {max_prompt_tokens} messages; a prompt of at most {max_prompt_tokens} tokens "
            "(max_model_len - 1) cannot hold them (each message takes a token at least)")


def _check_surrogates(text: str, param: str) -> None:
    problem = surrogate_problem(text)
    if problem is not None:
        raise PromptError(f"{param}: {problem}", param)


def surrogate_problem(text: str) -> str | None:
    """What is wrong with ``text`` if it holds a lone UTF-16 surrogate (valid JSON, no text), else None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"the text has a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}; send valid Unicode"
    return None
