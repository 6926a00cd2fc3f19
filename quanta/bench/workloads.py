"""Workloads: when requests are sent and what they carry.

- ``burst``: N requests scheduled at t=0.
- ``poisson`` / ``gamma``: N requests at ``rate`` per second, exponential or
  gamma(``burstiness``) inter-arrival gaps (open loop).
- ``concurrency``: N requests, ``concurrency`` in flight (closed loop; a
  request is scheduled when the one before it in that lane finishes).
- ``trace``: a window of a Mooncake request trace (:mod:`quanta.bench.mooncake`):
  its arrival times, exact lengths and shared prefix blocks, scaled.
- ``probe``: ``sessions`` streams decoding continuously, then one cold
  prompt of ``probe_words`` words starting with a per-run unique prefix
  (:mod:`quanta.bench.probe`, commands the bench client and the simulator
  both execute).
- ``replay``: ``sessions`` multi-turn agents started ``stagger`` seconds
  apart; every turn, sent when the one before ends, resends the whole
  conversation (with the server's reply; stand-in words of ``max_tokens`` if
  that turn failed) plus a tool output of ``tool_words`` words.
- ``sessions``: agent sessions recorded by ``quanta record`` (``sessions_file``).

The session-shaped kinds (replay, sessions) are laid out as replay steps by
:func:`session_steps` (which request after which one's end, sharing which
prompt parts; :class:`quanta.bench.sessions.ReplayStep`), which the bench
client and the simulator both execute.

The requests of burst, poisson, gamma, concurrency and trace are planned once
by :func:`plan` (send time, prompt size, output length, shared blocks), which
the bench client and the simulator (:mod:`quanta.sim.run`) both execute, so
the two send the same requests. Prompt and output lengths of the synthetic
kinds come from ``prompt_dist`` / ``output_dist`` (:mod:`quanta.bench.lengths`).

Every request's latency counts from its scheduled time, so waiting on the
client side is included. Every loop is bounded by the request count and the
run's ``max_duration`` (seconds).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from quanta.analysis.requests import RequestSample
from quanta.bench import lengths, mooncake, probe, prompts, sessions
from quanta.bench.client import Clock, Target, send

if TYPE_CHECKING:  # httpx loads when a request is sent: ``quanta --help`` and ``--version`` need none of it
    import httpx

KINDS = ("burst", "poisson", "gamma", "concurrency", "trace", "probe", "replay", "sessions")
#: kinds whose requests :func:`plan` lays out (the others react to responses)
PLANNED = ("burst", "poisson", "gamma", "concurrency", "trace")


@dataclass
class Workload:
    """One workload's parameters (sizes in words ~ tokens, times in seconds).

    ``prompt_dist`` / ``output_dist``: length distributions around ``prompt_words`` /
    ``max_tokens`` (see :mod:`quanta.bench.lengths`). ``trace`` .. ``trace_limit``: the
    ``trace`` kind's file, scaling and window (see :mod:`quanta.bench.mooncake`).
    """

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
    prompt_dist: str = "fixed"
    output_dist: str = "fixed"
    trace: str | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0
    trace_start: int = 0
    trace_limit: int | None = None
    sessions_file: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        """A workload from :meth:`to_dict` output; keys missing (older results) take their defaults.

        Raises:
            TypeError: a key no workload has.
        """
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown workload field(s) {', '.join(unknown)}")
        return cls(**d)

    def check(self) -> None:
        """Refuse flags that do not apply and unusable files, before any work.

        Raises:
            ValueError: (:class:`~quanta.bench.lengths.LengthError`, :class:`~quanta.bench.mooncake.TraceError`)
                with a one-line message naming the flag.
        """
        for flag, spec in (("--prompt-dist", self.prompt_dist), ("--output-dist", self.output_dist)):
            lengths.parse(spec, allow_eos=flag == "--output-dist")
            if spec != "fixed" and self.kind not in PLANNED[:4]:
                raise ValueError(f"{flag} applies to burst/poisson/gamma/concurrency, not --workload {self.kind}"
                                 + (" (the trace gives every length)" if self.kind == "trace" else ""))
        if (self.kind == "sessions") != bool(self.sessions_file):
            raise ValueError("--workload sessions needs --sessions-file FILE (written by quanta record)"
                             if self.kind == "sessions" else "--sessions-file needs --workload sessions")
        if self.sessions_file:
            sessions.load(self.sessions_file)  # SessionFileError: a bad file, before anything is sent
        if self.kind == "trace":
            if not self.trace:
                raise ValueError("--workload trace needs --trace FILE (Mooncake JSONL)")
            self.trace_requests()
        elif self.trace or self.trace_start or self.trace_limit is not None or (self.time_scale, self.length_scale) != (1.0, 1.0):
            raise ValueError("--trace, --start, --limit, --time-scale and --length-scale need --workload trace")

    def trace_requests(self) -> tuple[mooncake.TraceRequest, ...]:
        """The replayed trace window (``trace`` kind); raises :class:`~quanta.bench.mooncake.TraceError`."""
        return mooncake.load(self.trace, self.trace_start, self.trace_limit, self.time_scale, self.length_scale)

    def block_tokens(self) -> int:
        return mooncake.block_tokens(self.length_scale)

    def _lengths(self) -> str:
        p = lengths.describe(self.prompt_dist, self.prompt_words, "words")
        o = lengths.describe(self.output_dist, self.max_tokens, "tokens")
        return f"prompts {p}, outputs {o}"

    def describe(self) -> str:
        """One line saying what was sent (with the scaling of a trace)."""
        k = self.kind
        if k == "burst":
            return f"burst: {self.num_requests} requests at once, {self._lengths()}"
        if k in ("poisson", "gamma"):
            shape = f", burstiness {self.burstiness}" if k == "gamma" else ""
            return f"{k}: {self.num_requests} requests at {self.rate}/s{shape}, {self._lengths()}"
        if k == "concurrency":
            return f"concurrency: {self.num_requests} requests, {self.concurrency} in flight, {self._lengths()}"
        if k == "trace":
            reqs = self.trace_requests()
            end = reqs[-1].index + 1
            return (f"trace: {len(reqs)} requests of {self.trace} (lines {reqs[0].index + 1}-{end}), arrival gaps x{self.time_scale:g} "
                    f"(window {reqs[-1].t:.1f} s), prompt and output lengths x{self.length_scale:g} "
                    f"({self.block_tokens()}-token blocks for the trace's 512), exact outputs (ignore_eos)")
        if k == "sessions":
            return sessions.describe(self.sessions_file)
        common = f"max_tokens={self.max_tokens}"
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
        if self.kind == "trace":
            return len(self.trace_requests())
        if self.kind == "sessions":
            return len(sessions.replayed(self.sessions_file))
        return self.num_requests


@dataclass(frozen=True)
class RequestSpec:
    """One planned request.

    Attributes:
        scheduled: send time (s into the run); None in a closed loop (sent when a lane frees).
        prompt_size: words (synthetic kinds) or tokens (``trace``: ``trace_request`` is set).
        max_tokens: output tokens (exact with ``ignore_eos``, else a cap).
        ignore_eos: the output length is exact.
        trace_request: the trace entry this request replays, or None.
    """

    scheduled: float | None
    prompt_size: int
    max_tokens: int
    ignore_eos: bool = True
    trace_request: mooncake.TraceRequest | None = None

    @property
    def tag(self) -> str:
        return f"trace#{self.trace_request.index}" if self.trace_request else ""


def plan(w: Workload) -> list[RequestSpec]:
    """The requests of a planned kind (:data:`PLANNED`), in request-id order.

    Raises:
        ValueError: ``w.kind`` is not planned (probe and replay react to responses).
    """
    if w.kind == "trace":
        return [RequestSpec(r.t, r.prompt_tokens, r.output_tokens, True, r) for r in w.trace_requests()]
    if w.kind not in PLANNED:
        raise ValueError(f"{w.kind} is not a planned workload")
    n = w.num_requests
    times = [None] * n if w.kind == "concurrency" else arrival_times(w.kind, n, w.rate, w.burstiness, random.Random(w.seed))
    sizes = lengths.draw(w.prompt_dist, w.prompt_words, n, w.seed, "prompt")
    outs = lengths.draw(w.output_dist, w.max_tokens, n, w.seed, "output")
    eos = w.output_dist != "eos"
    return [RequestSpec(t, p, o, eos) for t, p, o in zip(times, sizes, outs)]


#: kinds whose requests :func:`session_steps` lays out (each reacts to its parent's end)
SESSION_SHAPED = ("replay", "sessions")


def session_steps(w: Workload) -> list[sessions.ReplayStep]:
    """The replay steps of a session-shaped kind (:data:`SESSION_SHAPED`), in request-id order.

    ``sessions``: the recorded file's (:func:`quanta.bench.sessions.replay_plan`). ``replay``: agent ``i``'s
    turn 0 (``prompt_words`` words) at ``i * stagger`` s, each next turn as soon as the previous one ends,
    sharing its prompt and reply and adding ``tool_words`` words; ``max_tokens`` outputs. Segment sizes are
    words here (the recorded file's are tokens).

    Raises:
        ValueError: ``w.kind`` is not session-shaped; :class:`~quanta.bench.sessions.SessionFileError`.
    """
    if w.kind == "sessions":
        return sessions.replay_plan(w.sessions_file)
    if w.kind != "replay":
        raise ValueError(f"{w.kind} is not a session-shaped workload")
    reqs = []
    for i in range(w.sessions):
        for k in range(w.turns):
            seg = sessions.Segment("user", w.tool_words if k else w.prompt_words)
            reqs.append(sessions.SessionRequest(len(reqs), i * w.stagger, None, i, k, len(reqs) - 1 if k else None, k > 0,
                                                2 * k, 0, (seg,), None, w.max_tokens, 200, True))
    return sessions.plan_steps(reqs)


def arrival_times(kind: str, n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Scheduled send times (s) of ``n`` open-loop requests; the first at 0.

    ``burst``: all 0. ``poisson``: exponential gaps of mean 1/rate. ``gamma``:
    gamma gaps with shape ``burstiness`` and the same mean (shape 1 is Poisson;
    below 1 burstier).
    """
    if kind == "burst":
        return [0.0] * n
    t, out = 0.0, []
    for _i in range(n):
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

    def text(self, spec: RequestSpec, salt: str) -> str:
        """The prompt text of a planned request (a trace request's blocks salted by ``salt``)."""
        if spec.trace_request is not None:
            return mooncake.prompt_text(spec.trace_request, self.w.block_tokens(), salt)
        return prompts.prompt(spec.prompt_size, self.rng)

    async def request(self, sample: RequestSample, prompt, max_tokens: int, keep_text=None, ignore_eos: bool = True,
                      prompt_size: int | None = None) -> RequestSample:
        sample.prompt_size = prompt_size
        await send(self.client, self.target, sample, prompt, max_tokens, self.clock, keep_text, ignore_eos)
        self.on_done(sample)
        return sample

    async def at(self, t: float) -> None:
        """Sleep until run time ``t``."""
        delay = t - self.clock.now()
        if delay > 0:
            await asyncio.sleep(delay)


async def _planned(run: Run) -> None:
    """Every planned kind: open loop at the planned times, or ``concurrency`` lanes in a closed loop."""
    w = run.w
    specs = plan(w)
    salt = prompts.unique_prefix()  # one run's trace blocks never hit an earlier run's cache
    texts = iter([(s, run.text(s, salt)) for s in specs])

    async def one(spec: RequestSpec, text: str) -> None:
        sample = run.new_sample(spec.scheduled, spec.tag)
        await run.at(spec.scheduled)
        await run.request(sample, text, spec.max_tokens, ignore_eos=spec.ignore_eos, prompt_size=spec.prompt_size)

    async def lane() -> None:
        for spec, text in texts:  # shared iterator: each request is taken by exactly one lane
            sample = run.new_sample(run.clock.now(), spec.tag)
            await run.request(sample, text, spec.max_tokens, ignore_eos=spec.ignore_eos, prompt_size=spec.prompt_size)

    if w.kind == "concurrency":
        await asyncio.gather(*(lane() for _ in range(min(w.concurrency, w.num_requests))))
    else:
        await asyncio.gather(*(one(s, t) for s, t in texts))


async def _session_shaped(run: Run) -> None:
    await sessions.replay(run, session_steps(run.w))


_RUNNERS = {**{k: _planned for k in PLANNED}, "probe": probe.run_http, **{k: _session_shaped for k in SESSION_SHAPED}}


async def execute(client: httpx.AsyncClient, target: Target, w: Workload, max_duration: float, on_done=None,
                  clock: Clock | None = None) -> Run:
    """Run workload ``w``; after ``max_duration`` seconds every request still
    running is cancelled and counted as ``deadline``."""
    run = Run(client, target, w, on_done, clock)
    task = asyncio.ensure_future(_RUNNERS[w.kind](run))
    try:
        await asyncio.wait_for(task, timeout=max_duration)
    except TimeoutError:
        pass
    for s in run.samples:  # requests never sent before the deadline
        if s.sent is None and s.error is None:
            s.error, s.error_detail, s.done = "deadline", "not sent before --max-duration", run.clock.now()
    while len(run.samples) < w.total_requests():
        s = run.new_sample(run.clock.now())  # never even scheduled: still one failed request
        s.error, s.error_detail, s.done = "deadline", "not scheduled before --max-duration", s.scheduled
    return run
