"""Client-side request samples and the latency figures computed from them.

A :class:`RequestSample` is what the load generator saw of one request, in
seconds since the start of the run on the client's clock:

- ``scheduled``: when the workload meant to send it (burst: all at 0; open
  loop: the arrival drawn from the rate; closed loop: when a slot in flight
  freed). Every latency counts from here, so time a request spent queued on
  the client side is included (no coordinated omission).
- ``sent``: when the request was actually written.
- ``chunks``: ``[arrival, characters]`` of each streamed chunk that carried text.
- ``completion_tokens`` / ``prompt_tokens``: from the server's ``usage``;
  ``cached_tokens`` from its ``prompt_tokens_details`` (prefix-cache hits; None
  when the server does not report them).
- ``max_tokens``, ``ignore_eos``, ``prompt_size``: what was asked (the output
  length, exact when ``ignore_eos``; the prompt size in words, or in tokens
  for a trace request).

Tokens are counted from ``usage``, not from chunks; a stream that ended
without ``usage`` (one the client stopped reading, such as the probe
workload's sessions) counts its text chunks, at least one token each
(:func:`output_tokens`). When the number of text
chunks equals the token count each chunk is one token; otherwise (a chunk
carried several tokens, or text was held back) token ``i`` of ``n`` is placed
at the first chunk whose cumulative text reaches ``i/n`` of the whole, so the
tokens of one chunk arrive together (gaps of 0) and the request is marked
``estimated``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from quanta.analysis.intervals import Interval
from quanta.analysis.stats import summarize


@dataclass
class RequestSample:
    """One request as seen by the client (times in seconds since run start)."""

    id: int
    scheduled: float
    sent: float | None = None
    chunks: list[list[float]] = field(default_factory=list)
    done: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_detail: str | None = None
    tag: str = ""
    max_tokens: int | None = None
    ignore_eos: bool | None = None
    prompt_size: int | None = None
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestSample:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def token_times(sample: RequestSample) -> tuple[list[float], bool]:
    """Arrival time of every output token and whether it had to be estimated.

    The count comes from ``completion_tokens`` (or, when the server sent no
    usage, from the number of text chunks, marked estimated).
    """
    chunks = [(t, c) for t, c in sample.chunks]
    n = sample.completion_tokens
    if n is None:
        return [t for t, _ in chunks], True
    if n <= 0 or not chunks:
        return [], n > 0
    if n == len(chunks):
        return [t for t, _ in chunks], False
    total = sum(c for _, c in chunks)
    if total <= 0:  # no text at all: spread tokens evenly over the chunks
        return [chunks[min(len(chunks) - 1, (i * len(chunks)) // n)][0] for i in range(n)], True
    times, cum, j = [], 0.0, 0
    for i in range(1, n + 1):
        share = total * i / n
        while j < len(chunks) and cum + chunks[j][1] < share - 1e-9:
            cum += chunks[j][1]
            j += 1
        times.append(chunks[min(j, len(chunks) - 1)][0])
    return times, True


def request_latencies(sample: RequestSample) -> dict:
    """``ttft``, ``e2e``, ``tpot`` (seconds, NaN when undefined), ``itl`` (list of
    gaps between consecutive tokens, seconds), ``queue`` (sent - scheduled)
    and ``estimated``."""
    times, estimated = token_times(sample)
    nan = math.nan
    ttft = times[0] - sample.scheduled if times else nan
    end = sample.done if sample.done is not None else (times[-1] if times else nan)
    e2e = end - sample.scheduled
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else nan
    itl = [b - a for a, b in zip(times, times[1:])]
    queue = (sample.sent - sample.scheduled) if sample.sent is not None else nan
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "itl": itl, "queue": queue, "estimated": estimated}


def error_counts(samples: list[RequestSample]) -> dict[str, int]:
    """Failed requests per condition (``unreachable``, ``http_500``, ``truncated``, ...)."""
    counts: dict[str, int] = {}
    for s in samples:
        if s.error:
            counts[s.error] = counts.get(s.error, 0) + 1
    return dict(sorted(counts.items()))


def client_metrics(samples: list[RequestSample]) -> dict:
    """Pooled client-side figures of one run.

    Latency distributions (``ttft``, ``e2e``, ``tpot``, ``itl``, ``queue``;
    summaries as :func:`quanta.analysis.stats.summarize`) come from the
    successful requests; failed ones are counted per condition in
    ``errors`` and ``num_failed``, never silently dropped. ``throughput`` is
    output tokens (usage) of successful requests per second of the run (first
    scheduled send to last response end), every streamed token counted (:func:`output_tokens`), so the
    sessions a probe workload cancels count as well as the probe. ``prefix_hit_share`` is cached / prompt tokens of the
    successful requests whose server reported cached tokens (NaN when none did).
    """
    ok = [s for s in samples if s.ok]
    per = [request_latencies(s) for s in ok]
    pooled = {k: [p[k] for p in per if not math.isnan(p[k])] for k in ("ttft", "e2e", "tpot", "queue")}
    pooled["itl"] = [g for p in per for g in p["itl"]]
    tokens = sum(output_tokens(s) for s in ok)
    wall = run_wall(samples)
    cached = [s for s in ok if s.cached_tokens is not None and s.prompt_tokens]
    return {
        "num_requests": len(samples),
        "num_ok": len(ok),
        "num_failed": len(samples) - len(ok),
        "errors": error_counts(samples),
        "num_estimated": sum(1 for p in per if p["estimated"]),
        "num_missing_usage": sum(1 for s in ok if s.completion_tokens is None),
        "output_tokens": tokens,
        "prompt_tokens": sum(s.prompt_tokens or 0 for s in ok),
        "cached_tokens": sum(s.cached_tokens for s in cached) if cached else None,
        "prefix_hit_share": sum(s.cached_tokens for s in cached) / sum(s.prompt_tokens for s in cached) if cached else math.nan,
        "wall": wall,
        "throughput": tokens / wall if wall > 0 else math.nan,
        **{k: summarize(v) for k, v in pooled.items()},
    }


def output_tokens(sample: RequestSample) -> int:
    """Output tokens of one request: its ``usage`` count, else (no usage: a stream stopped before its
    last event, or a server that sends none) its text chunks, each at least one token."""
    return sample.completion_tokens if sample.completion_tokens is not None else len(sample.chunks)


def run_wall(samples: list[RequestSample]) -> float:
    """Seconds from the first scheduled request to the last response end (0 if none ended)."""
    ends = [s.done for s in samples if s.done is not None]
    if not samples or not ends:
        return 0.0
    return max(ends) - min(s.scheduled for s in samples)


def client_intervals(samples: list[RequestSample]) -> tuple[list[Interval], list[Interval]]:
    """Client-side approximations of busy intervals of successful requests:
    prefill ``[sent, first token]`` (includes server queueing, so rates from it
    are lower bounds) and decode ``[first token, last token]``."""
    prefill, decode = [], []
    for s in samples:
        times, _ = token_times(s)
        if not s.ok or not times or s.sent is None:
            continue
        prefill.append((s.sent, times[0]))
        decode.append((times[0], times[-1]))
    return prefill, decode


def gaps_overlapping(times: list[float], window: Interval) -> list[float]:
    """Gaps between consecutive ``times`` whose span ``(prev, cur]`` overlaps ``window``."""
    lo, hi = window
    return [b - a for a, b in zip(times, times[1:]) if b > lo and a < hi]


def probe_metrics(probe: RequestSample, others: list[RequestSample]) -> dict:
    """Probe figures: ``prefill_tok_s`` = probe prompt tokens / TTFT (TTFT from
    the moment it was sent); ``itl_during`` = gaps of the other sessions that
    overlap ``[probe sent, probe first token]`` (summary); ``itl_outside`` =
    their other gaps, for comparison."""
    times, _ = token_times(probe)
    nan = math.nan
    if not probe.ok or not times or probe.sent is None:
        return {"ok": False, "ttft": nan, "prompt_tokens": probe.prompt_tokens, "prefill_tok_s": nan,
                "itl_during": summarize([]), "itl_outside": summarize([])}
    window = (probe.sent, times[0])
    ttft = times[0] - probe.sent
    during, outside = [], []
    for s in others:
        t, _ = token_times(s)
        inside = gaps_overlapping(t, window)
        during += inside
        all_gaps = [b - a for a, b in zip(t, t[1:])]
        outside += [g for g, (a, b) in zip(all_gaps, zip(t, t[1:])) if not (b > window[0] and a < window[1])]
    rate = (probe.prompt_tokens / ttft) if probe.prompt_tokens and ttft > 0 else nan
    return {"ok": True, "ttft": ttft, "prompt_tokens": probe.prompt_tokens, "prefill_tok_s": rate,
            "itl_during": summarize(during), "itl_outside": summarize(outside)}
