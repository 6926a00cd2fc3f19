"""Workloads: when requests are sent and what they carry.

- ``burst``: N requests scheduled at t=0.
- ``poisson`` / ``gamma``: N requests at ``rate`` per second, exponential or
  gamma(``burstiness``) inter-arrival gaps (open loop).
- ``concurrency``: N requests, ``concurrency`` in flight (closed loop; a
  request is scheduled when the one before it in that lane finishes).
- ``probe``: ``sessions`` streams decoding continuously, then one cold
  prompt of ``probe_words`` words starting with a per-run unique prefix.
- ``replay``: ``sessions`` multi-turn agents started ``stagger`` seconds
  apart; every turn resends the whole conversation plus a tool output of
  ``tool_words`` words.

Every request's latency counts from its scheduled time, so waiting on the
client side is included. Every loop is bounded by the request count and the
run's ``max_duration`` (seconds).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import asdict, dataclass

import httpx

from quanta.analysis.requests import RequestSample
from quanta.bench import prompts
from quanta.bench.client import Clock, Target, send

KINDS = ("burst", "poisson", "gamma", "concurrency", "probe", "replay")


@dataclass
class Workload:
    """One workload's parameters (sizes in words ~ tokens, times in seconds)."""

    kind: str = "burst"
    num_requests: int = 64
    prompt_words: int = 32
    max_tokens: int = 64
    rate: float = 4.0
    burstiness: float = 1.0
    concurrency: int = 8
    sessions: int = 4
    session_tokens: int = 256
    probe_words: int = 1024
    probe_delay: float = 1.0
    turns: int = 3
    tool_words: int = 128
    stagger: float = 15.0
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line saying what was sent."""
        k = self.kind
        common = f"max_tokens={self.max_tokens}"
        if k == "burst":
            return f"burst: {self.num_requests} requests at once, {self.prompt_words}-word prompts, {common}"
        if k in ("poisson", "gamma"):
            shape = f", burstiness {self.burstiness}" if k == "gamma" else ""
            return f"{k}: {self.num_requests} requests at {self.rate}/s{shape}, {self.prompt_words}-word prompts, {common}"
        if k == "concurrency":
            return f"concurrency: {self.num_requests} requests, {self.concurrency} in flight, {self.prompt_words}-word prompts, {common}"
        if k == "probe":
            return (f"probe: {self.sessions} sessions decoding (max {self.session_tokens} tokens), then one unique "
                    f"{self.probe_words}-word prompt after {self.probe_delay} s, {common}")
        return (f"replay: {self.sessions} sessions x {self.turns} turns, +{self.tool_words}-word tool output per turn, "
                f"{self.stagger} s apart, {common}")

    def total_requests(self) -> int:
        """Requests this workload sends (for the progress bar)."""
        if self.kind == "probe":
            return self.sessions + 1
        if self.kind == "replay":
            return self.sessions * self.turns
        return self.num_requests


def arrival_times(kind: str, n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Scheduled send times (s) of ``n`` open-loop requests; the first at 0.

    ``burst``: all 0. ``poisson``: exponential gaps of mean 1/rate. ``gamma``:
    gamma gaps with shape ``burstiness`` and the same mean (shape 1 is Poisson;
    below 1 burstier).
    """
    if kind == "burst":
        return [0.0] * n
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        if kind == "poisson":
            t += rng.expovariate(rate)
        elif kind == "gamma":
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        else:
            raise ValueError(f"no arrival process for {kind!r}")
    return out


class Run:
    """Shared state of one workload execution."""

    def __init__(self, client: httpx.AsyncClient, target: Target, w: Workload, on_done=None, clock: Clock | None = None) -> None:
        self.client, self.target, self.w = client, target, w
        self.clock = clock or Clock()
        self.samples: list[RequestSample] = []
        self.rng = random.Random(w.seed)
        self.on_done = on_done or (lambda s: None)

    def new_sample(self, scheduled: float, tag: str = "") -> RequestSample:
        s = RequestSample(id=len(self.samples), scheduled=scheduled, tag=tag)
        self.samples.append(s)
        return s

    async def request(self, sample: RequestSample, prompt, max_tokens: int, keep_text=None) -> RequestSample:
        await send(self.client, self.target, sample, prompt, max_tokens, self.clock, keep_text)
        self.on_done(sample)
        return sample

    async def at(self, t: float) -> None:
        """Sleep until run time ``t``."""
        delay = t - self.clock.now()
        if delay > 0:
            await asyncio.sleep(delay)


async def _open_loop(run: Run) -> None:
    w = run.w
    times = arrival_times(w.kind, w.num_requests, w.rate, w.burstiness, run.rng)
    texts = [prompts.prompt(w.prompt_words, run.rng) for _ in times]

    async def one(t: float, text: str) -> None:
        sample = run.new_sample(t)
        await run.at(t)
        await run.request(sample, text, w.max_tokens)

    await asyncio.gather(*(one(t, p) for t, p in zip(times, texts)))


async def _closed_loop(run: Run) -> None:
    w = run.w
    texts = iter([prompts.prompt(w.prompt_words, run.rng) for _ in range(w.num_requests)])

    async def lane() -> None:
        for text in texts:  # shared iterator: each request is taken by exactly one lane
            await run.request(run.new_sample(run.clock.now()), text, w.max_tokens)

    await asyncio.gather(*(lane() for _ in range(min(w.concurrency, w.num_requests))))


async def _probe(run: Run) -> None:
    w = run.w
    sessions = [run.new_sample(0.0, "session") for _ in range(w.sessions)]
    tasks = [asyncio.ensure_future(run.request(s, prompts.prompt(w.prompt_words, run.rng), w.session_tokens)) for s in sessions]
    # wait (bounded by session_tokens' worth of time) until every session streams
    while not all(s.chunks or s.done is not None for s in sessions):
        await asyncio.sleep(0.01)
    await asyncio.sleep(w.probe_delay)
    probe = run.new_sample(run.clock.now(), "probe")
    await run.request(probe, prompts.prompt(w.probe_words, run.rng, nonce_chars=32), w.max_tokens)
    await asyncio.sleep(w.probe_delay)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in sessions:  # stopping the sessions is the workload's doing, not a failure
        if s.error == "deadline":
            s.error, s.error_detail, s.finish_reason = None, None, "client_cancel"


async def _replay(run: Run) -> None:
    w = run.w

    async def agent(i: int) -> None:
        await run.at(i * w.stagger)
        context = [{"role": "user", "content": prompts.prompt(w.prompt_words, run.rng)}]
        for turn in range(w.turns):
            pieces: list[str] = []
            sample = run.new_sample(run.clock.now(), f"session{i}/turn{turn}")
            await run.request(sample, list(context), w.max_tokens, pieces)
            if not sample.ok:
                return
            context.append({"role": "assistant", "content": "".join(pieces)})
            context.append({"role": "user", "content": "Tool output:\n" + prompts.text(w.tool_words, run.rng)})

    await asyncio.gather(*(agent(i) for i in range(w.sessions)))


_RUNNERS = {"burst": _open_loop, "poisson": _open_loop, "gamma": _open_loop,
            "concurrency": _closed_loop, "probe": _probe, "replay": _replay}


async def execute(client: httpx.AsyncClient, target: Target, w: Workload, max_duration: float, on_done=None,
                  clock: Clock | None = None) -> Run:
    """Run workload ``w``; after ``max_duration`` seconds every request still
    running is cancelled and counted as ``deadline``."""
    run = Run(client, target, w, on_done, clock)
    task = asyncio.ensure_future(_RUNNERS[w.kind](run))
    try:
        await asyncio.wait_for(task, timeout=max_duration)
    except asyncio.TimeoutError:
        pass
    for s in run.samples:  # requests never sent before the deadline
        if s.sent is None and s.error is None:
            s.error, s.error_detail, s.done = "deadline", "not sent before --max-duration", run.clock.now()
    while len(run.samples) < w.total_requests() and not (w.kind == "replay" and task.done() and not task.cancelled()):
        s = run.new_sample(run.clock.now())  # never even scheduled: still one failed request
        s.error, s.error_detail, s.done = "deadline", "not scheduled before --max-duration", s.scheduled
    return run
