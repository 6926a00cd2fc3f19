"""``quanta record --upstream URL --out FILE``: a recording pass-through proxy.

Point an agent at the proxy instead of its server (OpenAI ``base_url``
``http://HOST:PORT/v1``, Anthropic ``http://HOST:PORT``). Every request goes
to the upstream unchanged and every response comes back byte for byte as the
upstream streams it (FastAPI + httpx, no buffering of SSE). For each
``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and ``/v1/messages`` the
proxy writes one line to FILE (see :mod:`quanta.bench.sessions`): arrival
and end time, time to first token, the upstream's token counts, the prefix
relation to earlier requests (:mod:`quanta.bench.relation`) and the status.
No prompt or reply text is written unless ``--record-text``. Each line is
written whole when its request ends; requests still running when the proxy
stops are written as incomplete (not replayed).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from quanta.bench import relation
from quanta.bench.sessions import FORMAT

if TYPE_CHECKING:  # the proxy's web stack is imported when it runs: ``quanta --help`` needs none of it
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

#: recorded routes -> API name
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
          "/v1/messages": "messages"}
#: the API's segments of a request body (:mod:`quanta.bench.relation`); completions take the prompt string
SEGMENTS = {"chat": relation.chat_segments, "responses": relation.responses_segments, "messages": relation.anthropic_segments}
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding", "upgrade",
        "proxy-connection", "te", "trailer"}


class Observed:
    """What one response showed: first-token time, reply text, usage, finish reason."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.first: float | None = None
        self.pieces: list[str] = []
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.finish: str | None = None
        self.ended = False  # the protocol's last event was seen ([DONE], message_stop, a whole JSON body)
        self.sse = False
        #: a JSON body's Content-Length: the body is whole, and parsed, once that many bytes came
        self.length: int | None = None
        self._buf = b""
        self._closed = False

    def feed(self, chunk: bytes, now: float) -> None:
        """Parse a piece of the response body (SSE lines, or a JSON body kept whole)."""
        self._buf += chunk
        if not self.sse:
            if self.length is not None and len(self._buf) >= self.length:
                self.close(now)
            return
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                self.ended = self.ended or data == b"[DONE]"
                if data and data != b"[DONE]":
                    try:
                        self._event(json.loads(data), now)
                    except ValueError:
                        pass

    def close(self, now: float) -> None:
        """The body ended (or the client left): parse a JSON body kept whole (once)."""
        if self._closed:
            return
        self._closed = True
        if not self.sse and self._buf:
            try:
                self._event(json.loads(self._buf), now, whole=True)
                self.ended = True
            except ValueError:
                pass

    def _text(self, text, now: float) -> None:
        if text:
            self.pieces.append(text)
            if self.first is None:
                self.first = now

    def _usage(self, u) -> None:
        if not isinstance(u, dict):
            return
        if "prompt_tokens" in u:  # OpenAI
            self.prompt_tokens = u.get("prompt_tokens")
            self.completion_tokens = u.get("completion_tokens", self.completion_tokens)
            self.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", self.cached_tokens)
        if "input_tokens" in u and "input_tokens_details" in u:  # Responses: input tokens include cached ones
            self.prompt_tokens = u["input_tokens"]
            self.cached_tokens = (u.get("input_tokens_details") or {}).get("cached_tokens", self.cached_tokens)
        elif "input_tokens" in u:  # Anthropic: input + cache reads + cache writes = the prompt
            read = u.get("cache_read_input_tokens") or 0
            self.prompt_tokens = u["input_tokens"] + read + (u.get("cache_creation_input_tokens") or 0)
            self.cached_tokens = read
        if "output_tokens" in u:
            self.completion_tokens = u["output_tokens"]

    def _event(self, obj, now: float, whole: bool = False) -> None:
        if not isinstance(obj, dict):
            return
        self._usage(obj.get("usage"))
        for c in obj.get("choices") or []:  # OpenAI chunk or body
            if isinstance(c, dict):
                msg = c.get("delta") or c.get("message") or {}
                self._text(c.get("text") if "text" in c else msg.get("content"), now)
                self.finish = c.get("finish_reason") or self.finish
        kind = obj.get("type")
        if kind == "message_start":
            self._usage((obj.get("message") or {}).get("usage"))
        elif kind == "content_block_delta":
            self._text((obj.get("delta") or {}).get("text"), now)
        elif kind == "message_delta":
            self.finish = (obj.get("delta") or {}).get("stop_reason") or self.finish
        elif kind == "message_stop":
            self.ended = True
        elif kind == "message" and whole:
            self._text(relation._text([b for b in obj.get("content") or [] if isinstance(b, dict) and b.get("type") == "text"]), now)
            self.finish = obj.get("stop_reason") or self.finish
        elif kind == "response.output_text.delta":  # Responses stream
            self._text(obj.get("delta"), now)
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self._response(obj.get("response") or {}, now, whole=False)
            self.ended = True
        elif obj.get("object") == "response" and whole:
            self._response(obj, now, whole=True)

    def _response(self, r: dict, now: float, whole: bool) -> None:
        """A Responses ``response`` object: usage, finish (the incomplete reason or the status) and, whole, its text."""
        if not isinstance(r, dict):
            return
        self._usage(r.get("usage"))
        self.finish = (r.get("incomplete_details") or {}).get("reason") or r.get("status") or self.finish
        if whole:
            parts = [c for item in r.get("output") or [] if isinstance(item, dict) and item.get("type") == "message"
                     for c in item.get("content") or [] if isinstance(c, dict) and c.get("type") == "output_text"]
            self._text(relation._text(parts), now)

    def reply(self) -> str:
        return "".join(self.pieces)


class Recorder:
    """Appends one JSON line per recorded request to the sessions file."""

    def __init__(self, out: Path, upstream: str, record_text: bool) -> None:
        self.out, self.record_text = out, record_text
        self.t0 = time.monotonic()
        self.tracker = relation.Tracker()
        self.pending: dict[int, tuple] = {}
        self.written = 0
        self.file = open(out, "x", encoding="utf-8")  # never overwrites (checked before; 'x' closes the race)
        self._line({"format": FORMAT, "upstream": upstream, "started": datetime.now(UTC).isoformat(timespec="seconds"),
                    "record_text": record_text, "time_unit": "s", "token_source": "upstream usage"})

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _line(self, obj: dict) -> None:
        if self.file is None:  # closed: the proxy is shutting down
            return
        self.file.write(json.dumps(obj, separators=(",", ":")) + "\n")  # one write per line: never half a record
        self.file.flush()

    def begin(self, api: str, path: str, body: dict):
        """Register a request; returns a handle for :meth:`finish`."""
        t = self.now()
        if api == "completions":
            prompt = body.get("prompt")
            prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
            entry, rel = self.tracker.begin(t, prompt=prompt)
        else:
            entry, rel = self.tracker.begin(t, segs=SEGMENTS[api](body))
        meta = {"api": api, "path": path, "model": body.get("model"), "stream": bool(body.get("stream")),
                "max_tokens": body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens")}
        self.pending[entry.id] = (entry, rel, meta)
        return entry.id

    def finish(self, handle: int, status: int | None, obs: Observed | None, complete: bool) -> None:
        """Write the record of request ``handle`` (once; later calls are ignored)."""
        if handle not in self.pending:
            return
        entry, rel, meta = self.pending.pop(handle)
        now = self.now()
        ok = status == 200 and complete
        reply = obs.reply() if obs else ""
        toks = self.tracker.finish(entry, rel, ok, obs.prompt_tokens if obs else None, obs.completion_tokens if obs else None, reply)
        segs = [{"role": s.role, "tokens": n, **({"text": s.text} if self.record_text else {})} for s, n in toks["new"]]
        rec = {"id": entry.id, "t": round(entry.t, 6), "done": round(now, 6),
               "ttft": round(obs.first - entry.t, 6) if obs and obs.first is not None else None,
               "session": entry.session, "turn": entry.turn, **rel, "shared_tokens": toks["shared_tokens"], "segments": segs,
               "prompt_tokens": obs.prompt_tokens if obs else None, "completion_tokens": obs.completion_tokens if obs else None,
               "cached_tokens": obs.cached_tokens if obs else None, "usage_estimated": toks["usage_estimated"],
               "status": status, "complete": complete, "finish_reason": obs.finish if obs else None, **meta}
        if self.record_text:
            rec["reply"] = reply
        self._line(rec)
        self.written += 1

    def close(self) -> None:
        """Write every request still running as incomplete, then close the file."""
        for handle in sorted(self.pending):
            self.finish(handle, None, None, complete=False)
        self.file.close()
        self.file = None


def _error(api: str | None, status: int, message: str) -> JSONResponse:
    from fastapi.responses import JSONResponse

    if api == "messages":
        return JSONResponse({"type": "error", "error": {"type": "api_error", "message": message}}, status_code=status)
    return JSONResponse({"error": {"message": message, "type": "upstream_error", "param": None, "code": status}}, status_code=status)


def build_app(upstream: str, recorder: Recorder) -> FastAPI:
    """The proxy app: every route passed through to ``upstream``; :data:`ROUTES` recorded."""
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=10.0))

    @asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()
        recorder.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    async def proxy(request):  # a plain Starlette endpoint: no annotations for FastAPI to resolve
        raw = await request.body()
        route = "/" + request.path_params["path"]
        api = ROUTES.get(route) if request.method == "POST" else None
        body = None
        if api:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                api = None  # the upstream answers the malformed body; nothing to record
        handle = recorder.begin(api, route, body) if api else None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP] + [("accept-encoding", "identity")]
        req = client.build_request(request.method, route, params=request.query_params, headers=headers, content=raw)
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            if handle is not None:
                recorder.finish(handle, 502, None, complete=False)
            return _error(api, 502, f"upstream {upstream} failed: {type(exc).__name__}: {exc}")
        obs = Observed(api) if api else None
        if obs:
            obs.sse = "text/event-stream" in resp.headers.get("content-type", "")
            length = resp.headers.get("content-length", "")
            obs.length = int(length) if length.isdigit() else None

        async def relay():
            complete = False
            try:
                async for chunk in resp.aiter_raw():
                    if obs:
                        obs.feed(chunk, recorder.now())
                        if obs.ended and handle is not None:
                            # written before the client sees the end: an agent's next turn, sent as soon as it
                            # has this reply, must find this request finished to relate to it
                            recorder.finish(handle, resp.status_code, obs, True)
                    yield chunk
                complete = True
            finally:
                await resp.aclose()
                if handle is not None:
                    obs.close(recorder.now())
                    # a client may close as soon as it has the last event, before the upstream's EOF reaches us
                    recorder.finish(handle, resp.status_code, obs, complete or obs.ended)

        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP and k.lower() != "content-encoding"}
        return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)

    app.add_route("/{path:path}", proxy, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    return app


def add_parser(sub, register_once) -> None:
    """Register ``quanta record`` on the root CLI's subparsers."""
    p = sub.add_parser("record", help="record an agent's requests through a pass-through proxy, for --workload sessions")
    register_once(p)
    p.add_argument("--upstream", required=True, help="server root the requests go to, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", required=True, help="sessions file to write (JSONL; refused if it exists, unless --force)")
    p.add_argument("--host", default="127.0.0.1", help="proxy address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="proxy port (default 8100; 0: any free port)")
    p.add_argument("--record-text", action="store_true", help="also write prompt and reply text (default: lengths and relations only)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``quanta record``: exit 2 on bad flags, 1 if the upstream is unreachable; else serve until SIGINT/SIGTERM."""
    import httpx
    import uvicorn

    from quanta.flags import base_url

    try:
        upstream = base_url(args.upstream)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--upstream: {exc}")
    out = Path(args.out)
    if out.exists() and not args.force:
        parser.error(f"--out {out} exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        parser.error(f"--out {out}: no directory {out.parent}")
    try:
        httpx.get(upstream + "/v1/models", timeout=10.0)
    except httpx.HTTPError as exc:
        print(f"quanta record: error: cannot reach upstream {upstream}: {exc}", file=sys.stderr)
        return 1
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        sock.close()
        parser.error(f"cannot listen on {args.host}:{args.port}: {exc}")
    if args.force:
        out.unlink(missing_ok=True)
    recorder = Recorder(out, upstream, args.record_text)
    host, port = sock.getsockname()[:2]
    print(f"quanta record: {upstream} -> {out}; point the agent at http://{host}:{port}/v1 (OpenAI) or "
          f"http://{host}:{port} (Anthropic); Ctrl-C to stop", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(build_app(upstream, recorder), log_level="warning"))
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # uvicorn re-raises the signal it stopped on
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # the same for Ctrl-C: the recording is complete either way
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"quanta record: wrote {recorder.written} requests of {recorder.tracker.sessions} sessions to {out}", file=sys.stderr)
    return 0
