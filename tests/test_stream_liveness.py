"""Streamed responses stay alive through long prefills: opening events at once,
keep-alives while the prompt is computed, a client that leaves mid-prefill has
its request aborted and a retry resumes from the prefix cache; ``HEAD /``.

The server runs the embedded model with one-block prefill steps (32 tokens),
so a ~600-token prompt takes many steps and a keep-alive every 0.1 s comes
several times before the first token.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid

import anthropic
import httpx
import httpx2
import openai
import pytest

from quanta.config import SchedulerConfig
from quanta.engine.async_engine import AsyncEngine, RequestFailed
from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepInterrupted, StepResult
from quanta.engine.sampling import SamplingParams
from quanta.server.keepalive import with_keepalive
from quanta.server.live_log import LiveLog

KEEPALIVE_S = 0.1
FLAGS = ("--max-model-len", "2048", "--stream-keepalive", str(KEEPALIVE_S), "--prefill-quantum", "32",
         "--mixed-prefill-quantum", "32", "--prefill-cap", "32", "--max-num-seqs", "2", "--stats-interval", "0.5")
ROUTES = ("chat", "completions", "messages", "responses")
ABORTS = re.compile(r'^quanta:request_aborts_total\{cause="disconnect",phase="prefill"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def live(launch_server):
    handle = launch_server(*FLAGS)
    yield handle
    handle.stop()


def _text() -> str:
    """A prompt of ~600 tokens whose first block no other test shares (no prefix-cache hit)."""
    return uuid.uuid4().hex + " " + " ".join(f"w{i}" for i in range(150))


# ----------------------------------------------------------------- raw SSE as written


def recorder(http):
    """A transport of the ``http`` package (httpx, or httpx2 for the anthropic client) that keeps each
    chunk of a response body with its arrival time (seconds after the request) in ``.writes``."""

    class Tap(http.SyncByteStream):
        def __init__(self, inner, writes: list, start: float) -> None:
            self.inner, self.writes, self.start = inner, writes, start

        def __iter__(self):
            for chunk in self.inner:
                self.writes.append((time.monotonic() - self.start, chunk))
                yield chunk

        def close(self) -> None:
            self.inner.close()

    class Recorder(http.HTTPTransport):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[tuple[float, bytes]] = []

        def handle_request(self, request):
            start = time.monotonic()
            response = super().handle_request(request)
            response.stream = Tap(response.stream, self.writes, start)
            return response

    return Recorder()


def sse_blocks(writes) -> list[tuple[float, str]]:
    """The SSE blocks of timed chunks, each with the time of the chunk that completed it."""
    blocks, buffer = [], ""
    for t, chunk in writes:
        buffer += chunk.decode()
        *done, buffer = buffer.split("\n\n")
        blocks += [(t, b) for b in done if b]
    return blocks


def kind(route: str, block: str) -> str:
    """``keepalive``, ``opening`` (the route's opening events) or ``output`` (anything after them).

    A keep-alive is an event the protocol's clients parse (not an SSE comment, which they skip): a
    chat chunk with an empty delta, a completions chunk of empty text, Responses'
    ``response.in_progress`` (also sent once at once, after ``response.created``), Anthropic's ping."""
    assert not block.startswith(":"), "an SSE comment: clients skip it, so it keeps no event-timed client"
    if block.startswith("event: ping\n"):
        return "keepalive"
    event = json.loads(block.split("data: ", 1)[1]) if "data: {" in block else {}
    choice = (event.get("choices") or [{}])[0]
    if route == "chat" and choice.get("delta") == {} and choice.get("finish_reason") is None:
        return "keepalive"
    if route == "completions" and choice.get("text") == "" and choice.get("finish_reason") is None:
        return "keepalive"
    if route == "responses" and event.get("type") == "response.in_progress":
        return "keepalive"
    if route == "chat" and choice.get("delta", {}).get("role") == "assistant":
        return "opening"
    if route in ("messages", "responses") and event.get("type") in ("message_start", "response.created"):
        return "opening"
    return "output"


def _before_output(route: str, writes) -> list[tuple[float, str]]:
    kinds = [(t, kind(route, b)) for t, b in sse_blocks(writes)]
    first = next(i for i, (_, k) in enumerate(kinds) if k == "output")
    return kinds[:first]


OPENINGS = {"chat": 1, "completions": 0, "messages": 1, "responses": 1}


def _official_stream(route: str, base: str, model: str, text: str) -> tuple[str, list]:
    """Stream one request through the official client; returns the text it parsed and the timed writes."""
    transport = recorder(httpx2 if route == "messages" else httpx)
    http = (httpx2 if route == "messages" else httpx).Client(transport=transport, timeout=120)
    with http:
        return _parsed(route, base, model, text, http), transport.writes


def _parsed(route: str, base: str, model: str, text: str, http) -> str:
    if route == "messages":
        client = anthropic.Anthropic(base_url=base, api_key="x", http_client=http, max_retries=0)
        with client.messages.stream(model=model, max_tokens=3, messages=[{"role": "user", "content": text}]) as stream:
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 500
        return "".join(pieces)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", http_client=http, max_retries=0)
    if route == "chat":
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                     max_tokens=3, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        empty = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content is None and not c.choices[0].finish_reason]
        assert len(empty) >= 2, "the client yields the keep-alives (event-timed clients count them)"
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if route == "completions":
        chunks = list(client.completions.create(model=model, prompt=text, max_tokens=3, stream=True))
        assert sum(c.choices[0].text == "" and not c.choices[0].finish_reason for c in chunks) >= 2
        return "".join(c.choices[0].text for c in chunks)
    events = list(client.responses.create(model=model, input=text, max_output_tokens=16, stream=True))
    assert [e.type for e in events[:3]] == ["response.created", "response.in_progress", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))  # keep-alives take their numbers in order
    assert events[-1].type in ("response.completed", "response.incomplete")
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


@pytest.mark.parametrize("route", ROUTES)
def test_opening_events_at_once_then_keepalives_until_the_first_token(live, route):
    text, writes = _official_stream(route, live.base_url, live.model, _text())
    assert text, "the official client parsed no text"
    head = _before_output(route, writes)
    kinds = [k for _, k in head]
    openings = OPENINGS[route]
    assert kinds[:openings] == ["opening"] * openings, kinds  # the protocol's opening events come first
    assert kinds[openings:] == ["keepalive"] * (len(kinds) - openings)
    assert kinds.count("keepalive") >= 2, f"the prefill ended before two keep-alives: {head}"
    if openings:  # sent at admission, not after the first keep-alive interval
        assert head[openings - 1][0] < head[openings][0]
    gaps = [b - a for (a, _), (b, _) in zip(head, head[1:], strict=False)]
    assert max(gaps) < 10 * KEEPALIVE_S, gaps


def _body(route: str, model: str, text: str, stream: bool) -> tuple[str, dict]:
    if route == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": 1, "stream": stream}
    if route == "completions":
        return "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1, "stream": stream}
    if route == "messages":
        return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                                "stream": stream}
    return "/v1/responses", {"model": model, "input": text, "max_output_tokens": 16, "stream": stream}


def _cached(route: str, body: dict) -> int:
    usage = body["usage"]
    if route == "messages":
        return usage["cache_read_input_tokens"]
    if route == "responses":
        return usage["input_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def _aborts(base: str) -> float:
    found = ABORTS.search(httpx.get(base + "/metrics", timeout=30).text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("route", ROUTES)
def test_a_client_that_leaves_mid_prefill_is_aborted_and_its_retry_resumes(live, route):
    before, text = _aborts(live.base_url), _text()
    path, body = _body(route, live.model, text, stream=True)
    writes = []
    with httpx.Client(timeout=120) as http, http.stream("POST", live.base_url + path, json=body) as response:
        start = time.monotonic()
        for chunk in response.iter_raw():
            writes.append((time.monotonic() - start, chunk))
            kinds = [kind(route, b) for _, b in sse_blocks(writes)]
            assert "output" not in kinds, "the prefill ended before the client left"
            if kinds.count("keepalive") >= 5:  # some prompt blocks are computed by now
                break
    deadline = time.monotonic() + 20
    while _aborts(live.base_url) < before + 1:
        assert time.monotonic() < deadline, f"no abort counted:\n{live.log_tail()}"
        time.sleep(0.1)
    path, body = _body(route, live.model, text, stream=False)
    again = httpx.post(live.base_url + path, json=body, timeout=120)
    assert again.status_code == 200, again.text
    assert _cached(route, again.json()) > 0, again.json()  # the aborted prefill's blocks were kept


def test_head_probes_answer_200(live):
    assert httpx.head(live.base_url + "/", timeout=30).status_code == 200
    assert httpx.head(live.base_url + "/health", timeout=30).status_code == 200
    root = httpx.get(live.base_url + "/", timeout=30)  # Ollama's clients check that the server runs
    assert root.status_code == 200 and root.text == "quanta is running"


def test_the_stats_line_shows_prefill_progress(live):
    path, body = _body("chat", live.model, _text(), stream=False)
    assert httpx.post(live.base_url + path, json=body, timeout=120).status_code == 200
    assert re.search(r"prefill chatcmpl-\w+ \d+/\d+", live.log()), live.log_tail()


# ----------------------------------------------------------------- in process


class SlowStep(Executor):
    """Each step takes ``seconds``; emits token 7 when a chunk completes its sequence."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = threading.Event()

    def execute(self, plan, interrupt=None):
        self.started.set()
        time.sleep(self.seconds)
        return StepResult([7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None
                           for c in plan.chunks])


def test_submit_returns_at_once_while_a_long_step_runs_and_names_the_step():
    executor = SlowStep(1.0)
    eng = AsyncEngine(Engine(SchedulerConfig("batched", 2).build(), executor, max_model_len=64))
    live = LiveLog(lambda: eng.num_running, lambda: eng.num_waiting, 2, time.monotonic, engine=eng)
    eng.start()

    async def scenario():
        first = await eng.submit([1, 2], SamplingParams(max_tokens=1, temperature=0))
        await asyncio.to_thread(executor.started.wait, 5)
        t0 = time.monotonic()
        second = await eng.submit([3, 4], SamplingParams(max_tokens=1, temperature=0), wait=False)
        returned = time.monotonic() - t0
        await asyncio.sleep(0.3)
        named = live.stats_fields()["step_running_s"]
        tokens = [t async for out in first for t in out.token_ids] + [t async for out in second for t in out.token_ids]
        return returned, second.seq_id, named, tokens

    try:
        returned, seq_id, named, tokens = asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        eng.stop()
    assert returned < 0.2  # not after the running 1-s step
    assert seq_id is not None and tokens == [7, 7]
    assert named is None or named >= 0.3  # measured from the step's start (None: shorter than LONG_STEP_S)
    idle = live.stats_fields()
    assert idle is None or idle["step_running_s"] is None  # between steps nothing is said


def test_keepalives_fill_the_silence_without_cancelling_the_read():
    async def slow():
        await asyncio.sleep(0.35)
        yield "a"
        yield "b"

    async def scenario():
        return [e async for e in with_keepalive(slow(), 0.1, "k")]

    events = asyncio.run(scenario())
    assert events[-2:] == ["a", "b"] and 2 <= events.count("k") <= 4 and set(events[:-2]) == {"k"}


def test_leaving_the_stream_cancels_the_read_it_waits_for():
    cancelled = asyncio.Event()

    async def endless():
        try:
            await asyncio.sleep(60)
            yield "never"
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def scenario():
        wrapped = with_keepalive(endless(), 0.05, "k")
        assert await anext(wrapped) == "k"
        await wrapped.aclose()
        await asyncio.wait_for(cancelled.wait(), 2)

    asyncio.run(scenario())


def test_stats_line_names_aborts_and_prefill_progress():
    class Engine_:
        step_running_s = 2.5

        def prefills(self):
            return [(4, 512, 8000)]

    live = LiveLog(lambda: 1, lambda: 0, 2, lambda: 1.0, engine=Engine_())
    live.label(4, "msg_abc", "/v1/messages")
    live.observe_abort("disconnect", "prefill")
    fields = live.stats_fields()
    assert fields["prefills"] == [{"id": "msg_abc", "done": 512, "total": 8000}]
    assert fields["step_running_s"] == 2.5 and fields["aborts"] == {"disconnect/prefill": 1}
    assert live.stats_fields()["aborts"] is None  # counted per interval


class DiesInStep(SlowStep):
    """Sleeps, then stops the engine thread (an exception no step failure handler takes)."""

    def execute(self, plan, interrupt=None):
        super().execute(plan)
        raise SystemExit("engine thread stops")


def test_a_request_still_waiting_for_acceptance_fails_when_the_engine_stops():
    executor = DiesInStep(0.5)
    eng = AsyncEngine(Engine(SchedulerConfig("batched", 2).build(), executor, max_model_len=64))
    eng.start()

    async def scenario():
        first = await eng.submit([1, 2], SamplingParams(max_tokens=1, temperature=0))
        await asyncio.to_thread(executor.started.wait, 5)
        pending = await eng.submit([3, 4], SamplingParams(max_tokens=1, temperature=0), wait=False)
        failures = []
        for stream in (first, pending):
            with pytest.raises(RequestFailed, match="the engine stopped") as caught:
                await anext(stream)
            failures.append(caught.value)
        return failures

    try:
        assert len(asyncio.run(asyncio.wait_for(scenario(), 10))) == 2  # neither waits forever
    finally:
        eng.stop()


class LayeredStep(Executor):
    """A step of ``layers`` sleeps of ``seconds``, calling ``interrupt`` after each (as the real
    model does after each decoder block); records how many ran and whether the step was stopped."""

    def __init__(self, layers: int, seconds: float) -> None:
        self.layers, self.seconds = layers, seconds
        self.started = threading.Event()
        self.ran: list[int] = []
        self.stopped = 0

    def execute(self, plan, interrupt=None):
        self.started.set()
        for i in range(self.layers):
            time.sleep(self.seconds)
            if interrupt is not None:
                try:
                    interrupt()
                except StepInterrupted:
                    self.ran.append(i + 1)
                    self.stopped += 1
                    raise
        self.ran.append(self.layers)
        return StepResult([7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None
                           for c in plan.chunks])


def test_a_dropped_request_stops_its_running_step_at_the_next_layer():
    executor = LayeredStep(layers=40, seconds=0.05)
    eng = AsyncEngine(Engine(SchedulerConfig("batched", 2).build(), executor, max_model_len=64))
    eng.start()

    async def scenario():
        stream = await eng.submit([1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
        await asyncio.to_thread(executor.started.wait, 5)
        stream.abort()  # the client left during the prefill
        for _ in range(400):
            if eng.num_running == 0:
                break
            await asyncio.sleep(0.01)
        kept = await eng.submit([4, 5], SamplingParams(max_tokens=1, temperature=0))
        return [t async for out in kept for t in out.token_ids]

    try:
        tokens = asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        eng.stop()
    assert executor.stopped == 1 and executor.ran[0] < 40  # the first step ended early
    assert executor.ran[1:] == [40] and tokens == [7]  # the next request's step ran whole
