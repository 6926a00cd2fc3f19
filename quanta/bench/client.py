"""One streamed OpenAI request, timed on the client.

Every outcome lands in the returned :class:`RequestSample`; a failure sets
``error`` to one condition name (``ERRORS``) and ``error_detail`` to a
human-readable message, so a report can count failures per condition.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quanta.analysis.requests import RequestSample

if TYPE_CHECKING:  # httpx loads when a request is sent: ``quanta --help`` and ``--version`` need none of it
    import httpx

#: failure conditions a sample's ``error`` may name (plus ``http_<status>``).
ERRORS = {
    "unreachable": "could not connect to the server",
    "timeout": "no response within --request-timeout",
    "truncated": "the stream ended before a finish_reason or [DONE]",
    "non_openai": "the response is not an OpenAI completion stream",
    "stream_error": "the server sent an error object inside the stream",
    "deadline": "still running at --max-duration; cancelled",
    "client_error": "unexpected client-side exception",
}


@dataclass
class Target:
    """Where and how to send requests.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1`` is appended).
        model: model id sent in every request.
        endpoint: ``completions`` or ``chat``.
        ignore_eos: send ``ignore_eos: true`` so outputs have exactly ``max_tokens``.
        extra: more body fields merged into every request.
    """

    base_url: str
    model: str
    endpoint: str = "completions"
    ignore_eos: bool = True
    extra: dict = field(default_factory=dict)

    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path


class Clock:
    """Seconds since the run started (``time.perf_counter`` based). ``origin``: ``time.monotonic()`` at the
    start, so a time of this clock is ``origin + t`` on the host's monotonic clock, the one a local server's
    trace is written in."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.origin = time.monotonic()

    def now(self) -> float:
        return time.perf_counter() - self.t0


def body(target: Target, prompt: str | list[dict], max_tokens: int, ignore_eos: bool = True) -> dict:
    """The JSON body of one streamed request (temperature 0, usage requested); ``ignore_eos`` is sent
    when both the target and the request ask for it."""
    b = {"model": target.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
         "stream_options": {"include_usage": True}}
    if target.endpoint == "chat":
        b["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    if target.ignore_eos and ignore_eos:
        b["ignore_eos"] = True
    return {**b, **target.extra}


def _chunk_text(obj: dict) -> tuple[str, str | None]:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise ValueError("chunk without a choices list")
    if not choices:
        return "", None
    c = choices[0]
    text = c.get("text")
    if text is None:
        text = (c.get("delta") or {}).get("content")
    return text or "", c.get("finish_reason")


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        return str(err) if err else raw[:200].decode(errors="replace")
    except (ValueError, AttributeError):
        return raw[:200].decode(errors="replace")


async def send(client: httpx.AsyncClient, target: Target, sample: RequestSample, prompt, max_tokens: int,
               clock: Clock, keep_text: list[str] | None = None, ignore_eos: bool = True) -> RequestSample:
    """Send one request and fill ``sample`` (its ``scheduled`` already set).

    ``keep_text``, when given, receives the streamed text pieces (for
    multi-turn replay). ``ignore_eos`` False lets this request end at EOS even
    when the target sends ``ignore_eos``. Cancellation marks the sample
    ``deadline`` unless it already finished, then re-raises.
    """
    import httpx

    sample.max_tokens = max_tokens
    sample.ignore_eos = target.ignore_eos and ignore_eos
    sample.sent = clock.now()
    got_done = False
    try:
        async with client.stream("POST", target.url(), json=body(target, prompt, max_tokens, ignore_eos)) as resp:
            if resp.status_code != 200:
                sample.error, sample.error_detail = f"http_{resp.status_code}", _error_message(await resp.aread())
                return sample
            ctype = resp.headers.get("content-type", "")
            if "text/event-stream" not in ctype:
                sample.error = "non_openai"
                sample.error_detail = f"expected text/event-stream, got {ctype or 'no content-type'}: {(await resp.aread())[:120]!r}"
                return sample
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    got_done = True
                    break
                t = clock.now()
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    raise ValueError("chunk is not a JSON object")
                if "error" in obj and "choices" not in obj:
                    sample.error, sample.error_detail = "stream_error", str(obj["error"])[:300]
                    return sample
                text, finish = _chunk_text(obj)
                if text:
                    sample.chunks.append([t, len(text)])
                    if keep_text is not None:
                        keep_text.append(text)
                if finish:
                    sample.finish_reason = finish
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    sample.prompt_tokens = usage.get("prompt_tokens", sample.prompt_tokens)
                    sample.completion_tokens = usage.get("completion_tokens", sample.completion_tokens)
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                        sample.cached_tokens = details["cached_tokens"]
        if not got_done and sample.finish_reason is None:
            sample.error, sample.error_detail = "truncated", f"stream closed after {len(sample.chunks)} text chunks"
    except asyncio.CancelledError:
        if sample.error is None and sample.finish_reason is None and not got_done:
            sample.error, sample.error_detail = "deadline", ERRORS["deadline"]
        raise
    except httpx.ConnectError as exc:
        sample.error, sample.error_detail = "unreachable", f"{target.url()}: {exc}"
    except httpx.TimeoutException as exc:
        sample.error, sample.error_detail = "timeout", f"{type(exc).__name__}: {exc}"
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        sample.error, sample.error_detail = "truncated", f"{type(exc).__name__}: {exc}"
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        sample.error, sample.error_detail = "non_openai", f"unparseable stream chunk: {exc}"
    except httpx.HTTPError as exc:
        sample.error, sample.error_detail = "client_error", f"{type(exc).__name__}: {exc}"
    finally:
        sample.done = clock.now()
    return sample
