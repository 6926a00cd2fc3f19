"""The server's front in the simulation: a request's way from the client to the engine, and a token's back.

A simulated request reaches the engine when the client sends it; a real one first crosses the HTTP
front (the connection, the body parsed, the prompt tokenized; behind a cluster front also the router
and the Ray hop), and each token it streams crosses it again. :class:`FrontModel` prices both, in the
front's two stages::

    loop       = request_s + e                  (client send -> the prompt ready to tokenize)
                 and loop_s after the request before it left the loop
    tokenizing = prompt_token_s * prompt tokens (on the first free of ``workers`` threads -> engine queue)
    delay out  = response_s                     (end of the emitting step -> client)

where ``e`` is drawn per request from ``noise`` (the quantiles of the fitted delays' residuals). The loop
stage is the event loop, one thread: it keeps the send order and takes one request at a time, so a
burst's requests leave it ``loop_s`` apart (the body read and parsed, the chat rendered); the tokenizing
stage is the server's prompt pool (``quanta.server.limits.PROMPT_WORKERS`` threads): a long prompt holds
one thread while shorter ones sent after it pass on the other, and a burst's requests queue for the
threads. A lone request's delay is the sum of the two (:meth:`FrontModel.delay`).

What the two stages reproduce of a real front, on the Mooncake windows of ``benchmarks/sim_holdout.sh``:
of the pairs of requests sent within 5 ms of each other (``fit.reordered_pairs``), a real front hands
10-25% over the other way round; its burst's requests reach the engine within a few milliseconds of each
other, tens of milliseconds after the send; and the longest prompt of a burst is often handed over last
whatever its place in the send order. The order decides which prompt the batched scheduler prefills
first, and so a window's tail time to first token. Independent noise alone would shuffle a burst (half the
pairs), a per-token term outside the send order would sort every burst shortest first, and the send order
alone never moves a long prompt back. Without ``loop_s`` a burst leaves the loop at one instant (behind its
slowest draw) and even a small per-token term sorts it shortest first; with it, prompts within
``loop_s / prompt_token_s`` tokens of each other keep their send order and only a much longer one falls back.

Fitted (:func:`fit_front`) from runs of ``quanta bench`` against a server on the same host: the run's
``clock_origin`` puts the client's times on the host's monotonic clock, which the server's trace is
written in; each trace record's ``arrivals`` (``[seq_id, submitted, accepted, prompt_tokens]``) says when
the front handed a request to the engine. Requests are paired with arrivals (:func:`paired`: in order,
by prompt size where the server reported it; a run that cannot be paired, as one with a server on
another host, is left out). ``loop_s`` and ``prompt_token_s`` are the non-negative least-squares slopes of
the delays on a request's place in its burst (how many requests, each sent within :data:`BURST_S` of the
one before, were sent ahead of it) and on its prompt size, fitted together: a burst's size and its prompts'
sizes go together in a trace, and a slope on the sizes alone takes the loop's queue for tokenizing.
``request_s`` is the median of what remains, ``noise`` 20 quantiles of the residuals, and
``response_s`` the median, over every streamed chunk, of its arrival at the client minus the end of the
latest step that emitted a token of its request before it: medians, so the simulated latency is the
typical crossing, not one pulled by a few queued ones. The per-token term is fitted under the measured
load, so it holds what tokenizing costs beside a running engine (whose threads take the cores), and the
body's transfer and parsing with it; the simulation charges all of it to the tokenizing stage.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from dataclasses import asdict, dataclass, field

from quanta.analysis.server_trace import emission_times

#: fewer paired requests than this: no front model
MIN_REQUESTS = 3
#: quantiles of the residuals kept as the delay's noise
NOISE_QUANTILES = 20
#: requests sent within this many seconds of each other are one burst (``fit.reordered_pairs``)
BURST_S = 0.005
#: a paired delay outside [0, this] seconds means the clocks are not one host's: the run is left out
MAX_DELAY_S = 60.0
#: threads of the front's tokenizing stage: the server's prompt pool (``quanta.server.limits.PROMPT_WORKERS``)
WORKERS = 2


class FrontModelError(ValueError):
    """A front block that is not valid."""


@dataclass
class FrontModel:
    """Seconds a request takes from the client's send to the engine's queue, and a token from its step to the client."""

    request_s: float = 0.0
    prompt_token_s: float = 0.0
    response_s: float = 0.0
    #: residuals of the fitted delays in (seconds, ascending quantiles): one is drawn for each request
    noise: list[float] = field(default_factory=list)
    #: how it was fitted: requests, chunks, runs left out, residuals
    fit: dict = field(default_factory=dict)
    #: threads of the tokenizing stage
    workers: int = WORKERS
    #: seconds the loop stage spends on each request: a burst's requests leave it this far apart
    loop_s: float = 0.0

    def loop_delay(self, rng: random.Random | None = None) -> float:
        """Seconds from the client's send to the prompt ready to tokenize, when nothing sent earlier is still
        in the loop stage: ``request_s`` plus a residual drawn from ``noise`` with ``rng`` (0 at least)."""
        e = rng.choice(self.noise) if rng is not None and self.noise else 0.0
        return max(0.0, self.request_s + e)

    def tokenize_s(self, prompt_tokens: int) -> float:
        """Seconds one tokenizing thread takes for a prompt of ``prompt_tokens``."""
        return self.prompt_token_s * prompt_tokens

    def delay(self, prompt_tokens: int, rng: random.Random | None = None) -> float:
        """Seconds from the client's send to the engine's queue for a prompt of ``prompt_tokens`` that finds
        the front idle: the fitted line, plus a residual drawn from ``noise`` with ``rng`` (0 at least)."""
        return self.loop_delay(rng) + self.tokenize_s(prompt_tokens)

    def to_dict(self) -> dict:
        return asdict(self)

    def stages(self, rng: random.Random | None = None) -> FrontStages:
        """A front of this model, empty, drawing its residuals with ``rng``."""
        return FrontStages(self, rng)

    @classmethod
    def from_dict(cls, d) -> FrontModel:
        """Raises:
            FrontModelError: not an object, or a coefficient missing, negative or not finite."""
        if not isinstance(d, dict):
            raise FrontModelError(f"front must be an object, got {type(d).__name__}")
        try:
            m = cls(float(d["request_s"]), float(d.get("prompt_token_s", 0.0)), float(d.get("response_s", 0.0)),
                    [float(e) for e in d.get("noise") or []], dict(d.get("fit") or {}), d.get("workers", WORKERS),
                    float(d.get("loop_s", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise FrontModelError(f"malformed front: {exc!r}") from exc
        if type(m.workers) is not int or m.workers < 1:
            raise FrontModelError(f"front: workers must be an integer >= 1, got {m.workers!r}")
        if not all(math.isfinite(x) and x >= 0 for x in (m.request_s, m.prompt_token_s, m.response_s, m.loop_s)):
            raise FrontModelError("front: request_s, prompt_token_s, response_s and loop_s must be finite and >= 0")
        if not all(math.isfinite(e) for e in m.noise):
            raise FrontModelError("front: noise must be finite residuals")
        return m


class FrontStages:
    """The front's two stages as requests cross them, in the order they are sent (module docstring)."""

    def __init__(self, model: FrontModel, rng: random.Random | None = None) -> None:
        self.model, self.rng = model, rng
        self._loop_free = -math.inf  # the loop lets no request go before one sent earlier, nor loop_s after it
        self._threads = [0.0] * model.workers  # when each tokenizing thread is free (a heap)

    def cross(self, sent: float, prompt_tokens: int) -> float:
        """When a request sent at ``sent`` (not before any earlier call's) reaches the engine."""
        self._loop_free = max(sent + self.model.loop_delay(self.rng), self._loop_free + self.model.loop_s)
        done = max(self._loop_free, heapq.heappop(self._threads)) + self.model.tokenize_s(prompt_tokens)
        heapq.heappush(self._threads, done)
        return done


def paired(run: dict, trace: list[dict] | None = None) -> list[tuple[dict, list]] | None:
    """The run's requests that reached the engine, each with its trace ``arrivals`` entry (times made the
    client's: seconds since its ``clock_origin``); None when the run cannot be paired (no origin or
    arrivals, counts that differ, an arrival no request sent before it, a delay over ``MAX_DELAY_S``).

    Arrivals in submission order each take the earliest-sent request not yet taken that was sent before it
    and whose prompt size, where the server reported one, is the arrival's.
    """
    from quanta.bench.runner import run_trace

    origin, trace = run.get("clock_origin"), run_trace(run) if trace is None else trace
    if origin is None or not trace:
        return None
    arrivals = sorted(([a[0], a[1] - origin, a[2] - origin, a[3]] for rec in trace for a in rec.get("arrivals") or []
                       if len(a) >= 4), key=lambda a: a[1])
    waiting = sorted((s for s in run.get("samples") or [] if s.get("error") is None), key=lambda s: s["sent"])
    if not arrivals or len(arrivals) != len(waiting):
        return None
    pairs = []
    for a in arrivals:
        s = next((s for s in waiting if s["sent"] <= a[1] and s.get("prompt_tokens") in (None, a[3])), None)
        if s is None or a[1] - s["sent"] > MAX_DELAY_S:
            return None
        waiting.remove(s)
        pairs.append((s, a))
    return pairs


def response_lags(run: dict, trace: list[dict], pairs: list[tuple[dict, list]]) -> list[float]:
    """Each streamed chunk's arrival at the client minus the end of the latest step before it that emitted
    a token of its request (seconds); ``trace``: the run's (:func:`~quanta.bench.runner.run_trace`)."""
    origin, ends = run["clock_origin"], emission_times(trace)
    lags = []
    for s, a in pairs:
        times = [t - origin for t in ends.get(a[0], [])]  # ascending: in step order
        for t, _ in s.get("chunks") or []:
            i = bisect.bisect_right(times, t)
            if i:
                lags.append(t - times[i - 1])
    return lags


def observations(runs: list[dict], lags: bool = True) -> tuple[list[tuple[int, float, int]], list[float], int, list[list]]:
    """``(prompt tokens, delay in, place in its burst)`` of every paired request (:func:`burst_places`),
    every chunk's response lag (none without ``lags``), how many runs with a clock origin could not be
    paired, and each paired run's pairs."""
    from quanta.bench.runner import run_trace

    ins, outs, left_out, runs_pairs = [], [], 0, []
    for run in runs:
        trace = run_trace(run)
        pairs = paired(run, trace)
        if pairs is None:
            left_out += run.get("clock_origin") is not None
            continue
        runs_pairs.append(pairs)
        places = burst_places([s["sent"] for s, _ in pairs])
        ins += [(a[3], a[1] - s["sent"], k) for (s, a), k in zip(pairs, places)]
        if lags:
            outs += response_lags(run, trace, pairs)
    return ins, outs, left_out, runs_pairs


def burst_places(sent: list[float], within_s: float = BURST_S) -> list[int]:
    """For each send time, how many requests were sent ahead of it in its burst (requests each sent within
    ``within_s`` of the one before): 0 for a burst's first."""
    order = sorted(range(len(sent)), key=sent.__getitem__)
    places = [0] * len(sent)
    for prev, i in zip(order, order[1:]):
        places[i] = places[prev] + 1 if sent[i] - sent[prev] <= within_s else 0
    return places


def fit_front(runs: list[dict], loop: bool = True) -> FrontModel | None:
    """The front model of ``runs`` (module docstring); None with fewer than :data:`MIN_REQUESTS` paired requests.
    ``loop=False``: no ``loop_s`` (the delays' slope on the prompt sizes alone, a burst leaving the loop at once)."""
    import numpy as np

    from quanta.sim.step_model import nnls

    ins, outs, left_out, runs_pairs = observations(runs)
    if len(ins) < MIN_REQUESTS:
        return None
    tokens, delays, places = (np.array(col, dtype=float) for col in zip(*ins))
    _, loop_s, slope = (float(c) for c in nnls(np.column_stack([np.ones_like(tokens), places * loop, tokens]), delays))
    rest = delays - loop_s * places - slope * tokens
    request_s = max(0.0, float(np.median(rest)))
    m = FrontModel(request_s, slope, float(statistics.median(outs)) if outs else 0.0, loop_s=loop_s)
    m.noise = [float(e) for e in np.quantile(rest - request_s, (np.arange(NOISE_QUANTILES) + 0.5) / NOISE_QUANTILES)]
    m.fit = {"requests": len(ins), "chunks": len(outs), "runs_left_out": left_out,
             "reordered_pairs": _reordered(runs_pairs), **residuals(m, ins)}
    return m


def reordered_share(runs: list[dict], within_s: float = BURST_S) -> float | None:
    """Of the pairs of paired requests sent within ``within_s`` of each other, the share the front handed to
    the engine in the other order than they were sent (None: no such pair)."""
    return _reordered([paired(run) or [] for run in runs], within_s)


def _reordered(runs_pairs: list[list[tuple[dict, list]]], within_s: float = BURST_S) -> float | None:
    """:func:`reordered_share` of runs already paired (:func:`paired`)."""
    pairs = reversed_ = 0
    for run_pairs in runs_pairs:
        sent = sorted((s["sent"], a[1]) for s, a in run_pairs)
        for i, (t, sub) in enumerate(sent):
            for t2, sub2 in sent[i + 1:]:
                if t2 - t > within_s:
                    break
                pairs += 1
                reversed_ += sub2 < sub
    return reversed_ / pairs if pairs else None


def residuals(m: FrontModel, ins: list[tuple[int, float, int]]) -> dict:
    """Median and p90 of ``|predicted - measured|`` delay in, seconds (a request ``k`` places into its burst
    predicted ``k * loop_s`` later than a lone one)."""
    err = sorted(abs(m.delay(n) + k * m.loop_s - d) for n, d, k in ins)
    return {"residual_median_s": statistics.median(err), "residual_p90_s": err[min(len(err) - 1, int(0.9 * len(err)))]}


def front_check(m: FrontModel, runs: list[dict]) -> dict:
    """The delay-in residuals of ``m`` on other runs (e.g. ``--check-bench``), with their request count."""
    ins = observations(runs, lags=False)[0]
    return {"requests": len(ins), **(residuals(m, ins) if ins else {})}
