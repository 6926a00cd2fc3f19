"""Recorded agent sessions replayed on their own protocols under the real clients' timeouts.

For each sessions file (``benchmarks/data/agent_sessions``, written by ``quanta record``), a
fresh ``quanta serve`` on the embedded model (``--max-model-len``, ``--stream-keepalive``), then
every request that succeeded when recorded is sent at its recorded time on the protocol it was
recorded on (the record's ``api``: Anthropic Messages for Claude Code, Responses for Codex CLI,
chat completions for opencode), streamed, through that protocol's official Python SDK
(``anthropic``, ``openai``), prompt segments as seeded words of their recorded sizes, output
capped at the recorded length (``ignore_eos`` where the route takes it: chat and Responses).

The agent's own timeouts (:data:`CLIENTS`, with where each comes from) are applied on the client:
a watchdog follows the timeline the agent times (the events its SDK yields, every SSE event on
the wire with pings, or raw body bytes) and, when a limit is passed (silence between two items
longer than the idle limit, no response headers or no first event in time, the whole request
too long), drops the stream, counts a retry and sends the request again after the agent's
backoff, up to its retry count. :func:`deadline` is that rule (tests/test_agent_sessions_timeouts.py).

Per request: protocol, prompt and output tokens (recorded -> replayed), time to response headers,
to the first event and to the first token (TTFT), the longest silence on the agent's timeline
before the first token and overall, the same for the objects the SDK yields, the limit, retries.

Usage: ``python benchmarks/agent_sessions_timeouts.py [--files codex opencode claude-code]
[--keepalive 10] [--keepalive-off-files codex] [--max-model-len 17664] [--out PREFIX]``
(one server per file and keep-alive value; the Claude Code file decodes up to ~5,000 tokens, ~10 min).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai

from quanta.bench import prompts, sessions
from quanta.bench.server import start

DATA = Path(__file__).resolve().parent / "data" / "agent_sessions"


@dataclass(frozen=True)
class ClientRule:
    """One agent's stream limits, in seconds (None: no such limit).

    ``timeline``: what its idle timer follows: ``sdk`` (objects its SDK yields), ``events`` (every
    SSE event on the wire, keep-alive pings included) or ``bytes`` (body reads). ``header_s``: from
    the send to the response headers; ``first_event_s``: from the send to the first item of the
    timeline; ``idle_s``: between two items (from the headers to the first); ``total_s``: the whole
    request. ``retries``: sends after the first; ``backoff_s``: wait before the n-th retry is
    ``backoff_s * 2**n``.
    """

    agent: str
    timeline: str
    idle_s: float | None
    header_s: float | None = None
    first_event_s: float | None = None
    total_s: float | None = None
    retries: int = 0
    backoff_s: float = 0.0
    source: str = ""

    def describe(self) -> str:
        parts = [f"idle {self.idle_s:g} s on {self.timeline}" if self.idle_s else None,
                 f"headers {self.header_s:g} s" if self.header_s else None,
                 f"first event {self.first_event_s:g} s" if self.first_event_s else None,
                 f"whole request {self.total_s:g} s" if self.total_s else None]
        return ", ".join(p for p in parts if p) + f"; {self.retries} retries"


CLIENTS = {
    "codex": ClientRule(
        "codex", "events", idle_s=300.0, retries=5, backoff_s=0.2,
        source="Codex CLI: stream_idle_timeout_ms 300,000 (a `timeout` around each `next()` of its SSE event "
               "stream), stream_max_retries 5, request_max_retries 4, retry base delay 200 ms "
               "(openai/codex codex-rs/core/src/model_provider_info.rs); no whole-request limit"),
    "claude-code": ClientRule(
        "claude-code", "events", idle_s=300.0, header_s=600.0, first_event_s=180.0, retries=10, backoff_s=0.5,
        source="Claude Code: streaming idle watchdog on for every provider, aborts and retries after 5 minutes "
               "without events (CHANGELOG 2.1.196; CLAUDE_STREAM_IDLE_TIMEOUT_MS), keep-alive pings count on "
               "ANTHROPIC_BASE_URL gateways (2.1.222); ~3-minute first-response deadline (2.1.243 release notes, "
               "anthropics/claude-code#88178); API_TIMEOUT_MS 600,000, which the Anthropic SDK applies until the "
               "response headers; CLAUDE_CODE_MAX_RETRIES 10, the SDK's 0.5 s initial retry delay"),
    "opencode": ClientRule(
        "opencode", "bytes", idle_s=900.0, header_s=300.0, total_s=300.0, retries=5, backoff_s=1.0,
        source="opencode: provider options timeout 300,000 (AbortSignal.timeout over the whole fetch), "
               "headerTimeout 300,000, chunkTimeout 900,000 between body reads (opencode.ai provider options; "
               "packages/opencode/src/provider/provider.ts); network errors retried 5 times, exponential "
               "backoff capped at 5 s (anomalyco/opencode#19116; 1 s base taken here)"),
}


def deadline(rule: ClientRule, sent: float, headers: float | None, items: list[float]) -> float:
    """When the client gives up if nothing more arrives: the earliest limit still running, given the
    send time, the time of the response headers (None: not yet) and the times of the timeline's items
    so far (``math.inf``: no limit runs)."""
    times = [sent + rule.total_s] if rule.total_s else []
    if headers is None:
        times += [sent + rule.header_s] if rule.header_s else []
        return min(times, default=math.inf)
    if not items and rule.first_event_s:
        times.append(sent + rule.first_event_s)
    if rule.idle_s:
        times.append((items[-1] if items else headers) + rule.idle_s)
    return min(times, default=math.inf)


def first_violation(rule: ClientRule, sent: float, headers: float | None, items: list[float], end: float) -> float | None:
    """The time the client would drop a request whose timeline was this (headers, items, then the end of
    the stream at ``end``), or None when no limit is passed."""
    seen: list[float] = []
    steps = ([] if headers is None else [("headers", headers)]) + [("item", t) for t in items] + [("end", end)]
    got_headers = None
    for what, t in steps:
        limit = deadline(rule, sent, got_headers, seen)
        if limit < t:
            return limit
        if what == "headers":
            got_headers = t
        elif what == "item":
            seen.append(t)
    return None


def longest_gap(start: float, times: list[float], until: float | None = None) -> float | None:
    """The longest silence from ``start`` through ``times`` (those up to ``until``)."""
    pts = [start] + [t for t in times if until is None or t <= until]
    return max((b - a for a, b in zip(pts, pts[1:], strict=False)), default=None)


# ----------------------------------------------------------------- one streamed attempt

@dataclass
class Attempt:
    """Times (seconds since the run started) of one send."""

    sent: float
    headers: float | None = None
    bytes: list[float] = field(default_factory=list)
    events: list[float] = field(default_factory=list)
    sdk: list[float] = field(default_factory=list)
    first_token: float | None = None
    end: float | None = None
    dropped: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None


def tap(http, clock, current: list):
    """A transport of ``http`` (httpx, or httpx2 for ``anthropic``) timing the response of ``current[0]``:
    its headers, each body read and each SSE event completed by it (comments are not events)."""
    class Tapped(http.AsyncByteStream):
        def __init__(self, inner, attempt: Attempt) -> None:
            self.inner, self.attempt, self.buffer = inner, attempt, ""

        async def __aiter__(self):
            async for chunk in self.inner:
                t = clock()
                self.attempt.bytes.append(t)
                self.buffer += chunk.decode(errors="replace")
                *blocks, self.buffer = re.split(r"\r?\n\r?\n", self.buffer)
                self.attempt.events += [t for b in blocks if b.strip() and not b.lstrip().startswith(":")]
                yield chunk

        async def aclose(self) -> None:
            await self.inner.aclose()

    class Transport(http.AsyncHTTPTransport):
        async def handle_async_request(self, request):
            response = await super().handle_async_request(request)
            current[0].headers = clock()
            response.stream = Tapped(response.stream, current[0])
            return response

    return Transport()


def _text(tokens: int, seed: str) -> str:
    return prompts.text(tokens, random.Random(seed)) if tokens else "."


def _segments(req: sessions.SessionRequest, salt: str) -> list[tuple[str, str]]:
    """(role, text) of each recorded segment, the salt before the first."""
    return [(s.role, (salt + " " if i == 0 else "") + _text(s.tokens, f"{salt}:{req.id}:{i}"))
            for i, s in enumerate(req.segments)]


class Sender:
    """Sends one recorded request through the official SDK of its protocol; ``attempt`` is filled as it streams."""

    def __init__(self, base: str, model: str, clock) -> None:
        self.base, self.model, self.clock, self.current = base, model, clock, [None]
        self.openai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=None,
                                         http_client=httpx.AsyncClient(transport=tap(httpx, clock, self.current), timeout=None))
        self.anthropic = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0, timeout=None,
                                                  http_client=httpx2.AsyncClient(transport=tap(httpx2, clock, self.current), timeout=None))

    async def send(self, api: str, req: sessions.SessionRequest, salt: str, attempt: Attempt) -> None:
        self.current[0] = attempt
        segs = _segments(req, salt)
        stream = await getattr(self, "_" + api)(segs, req.completion_tokens)
        try:
            async for obj in stream:
                attempt.sdk.append(self.clock())
                self._read(api, obj, attempt)
        finally:
            await stream.close()
        attempt.end = self.clock()

    async def _chat(self, segs, n: int):
        return await self.openai.chat.completions.create(
            model=self.model, messages=[{"role": sessions.chat_role(r), "content": t} for r, t in segs], max_tokens=n,
            temperature=0.0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})

    async def _responses(self, segs, n: int):
        return await self.openai.responses.create(
            model=self.model, input=[{"role": r if r in ("user", "assistant", "system", "developer") else "user",
                                      "content": t} for r, t in segs],
            max_output_tokens=n, temperature=0.0, stream=True, extra_body={"ignore_eos": True})

    async def _messages(self, segs, n: int):
        head = 0
        while head < len(segs) and segs[head][0] == "system":
            head += 1
        system = [{"type": "text", "text": t} for _, t in segs[:head]]
        msgs = [{"role": r if r in ("user", "assistant", "system") else "user", "content": t} for r, t in segs[head:]]
        return await self.anthropic.messages.create(model=self.model, system=system or anthropic.NOT_GIVEN,
                                                    messages=msgs, max_tokens=n, stream=True, extra_body={"temperature": 0.0})

    def _read(self, api: str, obj, attempt: Attempt) -> None:
        """First token and usage from one SDK object."""
        kind = getattr(obj, "type", None)
        if attempt.first_token is None and (
                (api == "chat" and obj.choices and obj.choices[0].delta.content)
                or kind in ("response.output_text.delta", "content_block_delta")):
            attempt.first_token = self.clock()
        usage = getattr(obj, "usage", None)
        if kind in ("response.completed", "response.incomplete"):
            usage = obj.response.usage
        elif kind == "message_start":
            usage = obj.message.usage
        if usage is not None:
            attempt.prompt_tokens = (getattr(usage, "prompt_tokens", None) or getattr(usage, "input_tokens", None)
                                     or attempt.prompt_tokens)
            if kind == "message_start":
                attempt.prompt_tokens = (attempt.prompt_tokens or 0) + (usage.cache_read_input_tokens or 0)
            attempt.output_tokens = (getattr(usage, "completion_tokens", None) or getattr(usage, "output_tokens", None)
                                     or attempt.output_tokens)


async def supervise(rule: ClientRule, run, attempt: Attempt, clock, poll: float = 0.25) -> bool:
    """Run ``run`` (a coroutine streaming into ``attempt``) under ``rule``: cancel it when :func:`deadline`
    passes on the rule's timeline. Returns True when it was dropped (``attempt.dropped`` is then set)."""
    task = asyncio.ensure_future(run)
    while not task.done():
        limit = deadline(rule, attempt.sent, attempt.headers, getattr(attempt, rule.timeline))
        if clock() >= limit:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            attempt.dropped = clock()
            return True
        await asyncio.wait({task}, timeout=max(0.0, min(poll, limit - clock())))
    exc = task.exception()
    if exc is not None:
        attempt.error = f"{type(exc).__name__}: {exc}"[:300]
    return False


async def replay_one(sender: Sender, rule: ClientRule, api: str, req: sessions.SessionRequest, salt: str) -> list[Attempt]:
    """Send ``req`` at its recorded time, again after each drop (the agent's backoff), at most ``1 + retries`` times."""
    await asyncio.sleep(max(0.0, req.t - sender.clock()))
    attempts: list[Attempt] = []
    while True:
        attempt = Attempt(sent=sender.clock())
        attempts.append(attempt)
        dropped = await supervise(rule, sender.send(api, req, salt, attempt), attempt, sender.clock)
        if not dropped or len(attempts) > rule.retries:
            return attempts
        await asyncio.sleep(rule.backoff_s * 2 ** (len(attempts) - 1))


# ----------------------------------------------------------------- per file, report

def _apis(path: Path) -> dict[int, str]:
    """Each recorded request's protocol (the record's ``api``: chat, responses or messages)."""
    lines = [json.loads(ln) for ln in path.read_text().splitlines()[1:] if ln.strip()]
    return {d["id"]: d.get("api") or "chat" for d in lines}


def _r(v, digits: int = 1):
    return None if v is None else round(v, digits)


def row(agent: str, keepalive: float, rule: ClientRule, api: str, req: sessions.SessionRequest,
        attempts: list[Attempt]) -> dict:
    """One result row: the last attempt's figures and the retries before it."""
    a = attempts[-1]
    line = getattr(a, rule.timeline)
    start = a.sent
    return {
        "file": f"{agent}.jsonl", "keepalive_s": keepalive, "request": f"session{req.session}/turn{req.turn}",
        "protocol": api, "prompt_recorded": req.prompt_tokens, "prompt_replayed": a.prompt_tokens,
        "output_recorded": req.completion_tokens, "output_replayed": a.output_tokens,
        "headers_s": _r(a.headers - start if a.headers else None, 3),
        "first_event_s": _r(line[0] - start if line else None, 3),
        "ttft_s": _r(a.first_token - start if a.first_token else None),
        "e2e_s": _r(a.end - start if a.end else None),
        "timeline": rule.timeline,
        "gap_before_first_token_s": _r(longest_gap(start, line, a.first_token), 2),
        "gap_overall_s": _r(longest_gap(start, line, a.end), 2),
        "sdk_gap_before_first_token_s": _r(longest_gap(start, a.sdk, a.first_token), 2),
        "sdk_gap_overall_s": _r(longest_gap(start, a.sdk, a.end), 2),
        "items": len(line), "sdk_items": len(a.sdk), "limit": rule.describe(),
        "retries": len(attempts) - 1, "dropped_after_s": [_r(x.dropped - x.sent) for x in attempts if x.dropped],
        "error": a.error,
    }


async def replay_file(path: Path, keepalive: float, max_model_len: int) -> list[dict]:
    header, _ = sessions.load(str(path))
    agent = header.get("agent") or path.stem
    rule, apis = CLIENTS[agent], _apis(path)
    flags = ["--max-model-len", str(max_model_len), "--stream-keepalive", f"{keepalive:g}"]
    server = start(flags, Path(tempfile.mkdtemp(prefix="sessions-timeouts-")), timeout=300)
    try:
        model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        t0 = time.monotonic()
        sender = Sender(server.base_url, model, lambda: time.monotonic() - t0)
        salt = prompts.text(sessions.SALT_WORDS, random.Random())
        reqs = sessions.replayed(str(path))
        for step in sessions.plan_steps(reqs):
            if step.parent is not None:
                raise SystemExit(f"{path}: request {step.request.id} continues request {step.parent.id}; "
                                 "this replay sends only requests without a replayed parent")
        print(f"{path.name}: {len(reqs)} request(s), quanta serve {' '.join(flags)} ({rule.describe()})", flush=True)
        results = await asyncio.gather(*(replay_one(sender, rule, apis[r.id], r, salt) for r in reqs))
        rows = [row(agent, keepalive, rule, apis[r.id], r, a) for r, a in zip(reqs, results, strict=True)]
        for x in rows:
            print("  " + json.dumps(x), flush=True)
        return rows
    finally:
        server.stop()


COLUMNS = [("file", "file"), ("keepalive_s", "keep-alive s"), ("request", "request"), ("protocol", "protocol"),
           ("prompt", "prompt tokens rec -> replayed"), ("output", "output tokens rec -> replayed"),
           ("headers_s", "headers s"), ("first_event_s", "first event s"), ("ttft_s", "TTFT s"), ("e2e_s", "end s"),
           ("gap_before_first_token_s", "longest gap before 1st token s"), ("gap_overall_s", "longest gap s"),
           ("sdk_gap_before_first_token_s", "SDK-yielded: gap before 1st token s"), ("sdk_gap_overall_s", "SDK-yielded: gap s"),
           ("limit", "client limit"), ("retries", "retries")]


def _cell(x: dict, key: str) -> str:
    if key in ("prompt", "output"):
        return f"{x[key + '_recorded']} -> {x[key + '_replayed']}"
    v = x[key]
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def markdown(rows: list[dict], meta: dict) -> str:
    out = ["# Recorded agent sessions under the real clients' timeouts", "",
           f"- date: {meta['date']}", f"- machine: {meta['machine']}", f"- quanta: {meta['commit']}",
           f"- command: `{meta['command']}`", "",
           "Client limits applied (the replay drops and re-sends a request when one is passed):", ""]
    out += [f"- **{c.agent}** ({c.describe()}): {c.source}" for c in CLIENTS.values()]
    out += ["", "Gaps are on the timeline the agent times (its column `timeline` in the JSON: `events` = every SSE "
            "event on the wire, pings included; `bytes` = body reads), from the send; the SDK-yielded columns time "
            "only the objects the Python SDK hands on (it drops Anthropic's `ping`).", "",
            "| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(_cell(x, k) for k, _ in COLUMNS) + " |" for x in rows]
    return "\n".join(out) + "\n"


def _machine() -> str:
    flags = sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|avx2|fma|f16c)\b", Path("/proc/cpuinfo").read_text())))
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} cpus, flags {' '.join(flags)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--files", nargs="+", default=["codex", "opencode", "claude-code"], choices=sorted(CLIENTS),
                    help="sessions files (by agent) to replay (default: all three)")
    ap.add_argument("--keepalive", type=float, default=10.0, help="--stream-keepalive of the servers (default 10)")
    ap.add_argument("--keepalive-off-files", nargs="*", default=[], choices=sorted(CLIENTS),
                    help="also replay these files with --stream-keepalive 0")
    ap.add_argument("--max-model-len", type=int, default=17664)
    ap.add_argument("--out", help="write OUT.md and OUT.json")
    args = ap.parse_args()
    runs = [(f, args.keepalive) for f in args.files] + [(f, 0.0) for f in args.keepalive_off_files]
    rows: list[dict] = []
    for agent, keepalive in runs:
        rows += asyncio.run(replay_file(DATA / f"{agent}.jsonl", keepalive, args.max_model_len))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": _machine(),
            "commit": commit, "command": "python " + " ".join(sys.argv),
            "clients": {k: asdict(v) for k, v in CLIENTS.items()}}
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        Path(args.out + ".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 1 if any(x["retries"] or x["error"] for x in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
