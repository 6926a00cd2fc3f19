"""A cost profile fitted to a running server's step trace (``quanta profile-engine --from-bench``).

``quanta profile-engine`` times the executor alone, in-process. A server also
runs an HTTP event loop, detokenizes and streams every token, and on a small
machine shares its cores with the benchmark client; all of that lengthens the
steps the scheduler actually waits for. Fitting the profile to the server's
own trace (``/v1/trace``, recorded by ``quanta bench`` in every run) measures
the steps as they ran under load.

Per step of the trace: ``t = end - start`` plus the median idle gap between
back-to-back steps (the engine loop's own per-step time, which the simulator
does not model separately), the prefill chunks ``(start position, tokens)``
and the decode positions, reconstructed by walking the trace in order (a
sequence's entries are prefill until it has emitted its first token, decode
after; positions accumulate ``num_new_tokens``: :func:`trace_entries`, the
rule of every trace figure).

Fit, in this order (each clamped at 0):

1. decode (steps without prefill): ``k_dec`` the median over batch sizes B
   (with >= 10 steps spanning >= 64 positions of mean context) of the slope of
   ``t`` against S, the sum of the sequences' positions; ``a`` the intercept
   of the least-squares line of ``t - k_dec S`` against B (clamped to [0, its
   minimum]).
2. prefill (steps without decode): steps binned by their token count N (bins
   a factor sqrt 2 wide, >= 3 steps each); ``k_pre`` the median, over bins
   whose context spread allows it, of the least-squares slope of
   ``(t - a) / N`` against the mean context per token C / N.
3. ``overhead_s`` = ``a`` lowered, if need be, to the cheapest prefill bin's
   median ``t - k_pre C`` (the decode intercept can hold more than what every
   call pays); the decode point at each batch size is the median of
   ``t - overhead - k_dec S``, the prefill per-token cost of a bin the median of
   ``(t - overhead - k_pre C) / N`` at the bin's median N.
4. fused steps: ``mixed_decode_factor`` the median of
   ``(t - a - prefill_cost) / decode_cost`` (clamped to [0, 2]); 1 without
   fused steps.
5. ``step_noise``: the 100 quantiles (at (i + 0.5) / 100) of measured /
   predicted time over every step, so the simulator draws step times with
   the measured spread (a p99 ITL made of step-time jitter, not of stalls,
   needs it; with fixed step times the simulated p99 of a steady decode
   is its median).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from quanta.analysis.server_trace import trace_entries
from quanta.sim.profile import Profile

#: back-to-back steps: the next step starts within this many seconds of the previous end
BUSY_GAP_S = 0.005
#: bins with fewer steps than this give no point (a single slow step would make one)
MIN_STEPS = 3


class FitError(ValueError):
    """The traces hold too few steps of a kind to fit a profile."""


@dataclass
class Step:
    """One forward call reconstructed from the trace (seconds, positions in tokens)."""

    t: float
    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)


def steps_from_trace(records: list[dict]) -> tuple[list[Step], list[float]]:
    """The steps of one run's trace, and the idle gaps between back-to-back steps (seconds)."""
    steps, gaps, prev_end = [], [], None
    for r, row in trace_entries(records):
        s = Step(r["end"] - r["start"])
        for _, pos, n, is_decode, _ in row:
            if is_decode:
                s.decode.append(pos)
            else:
                s.prefill.append((pos, n))
        if prev_end is not None and 0 <= r["start"] - prev_end <= BUSY_GAP_S:
            gaps.append(r["start"] - prev_end)
        prev_end = r["end"]
        steps.append(s)
    return steps, gaps


def _fit_decode(steps: list[Step]) -> tuple[float, float, dict[float, np.ndarray]]:
    """``(a, k_dec, {B: t - k_dec S of its steps})`` from the steps without prefill."""
    dec = [s for s in steps if s.decode and not s.prefill]
    if len(dec) < MIN_STEPS:
        raise FitError(f"{len(dec)} pure decode steps in the traces; need at least {MIN_STEPS}")
    t = np.array([s.t for s in dec])
    b = np.array([len(s.decode) for s in dec], dtype=float)
    ctx = np.array([sum(s.decode) for s in dec], dtype=float)
    # k_dec from the slope against context *within* each batch size (across batch sizes, context and
    # batch size move together and the slope would take the batch cost for a context cost)
    slopes = []
    for bs in set(b):
        sel = b == bs
        if sel.sum() >= 10 and np.ptp(ctx[sel] / bs) >= 64:
            slopes.append(float(np.polyfit(ctx[sel], t[sel], 1)[0]))
    k = max(statistics.median(slopes), 0.0) if slopes else 0.0
    net = t - k * ctx
    a = np.polyfit(b, net, 1)[1] if len(set(b)) >= 2 else 0.0
    by_batch = {float(bs): net[b == bs] for bs in sorted(set(b)) if (b == bs).sum() >= MIN_STEPS}
    if not by_batch:
        raise FitError(f"no batch size has {MIN_STEPS} pure decode steps")
    return min(max(float(a), 0.0), float(net.min())), k, by_batch


def _bin(n: int) -> int:
    return round(2 * math.log2(n))


def _fit_prefill(steps: list[Step], a: float) -> tuple[float, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """``(k_pre, [(N, C, t) arrays per bin])`` from the steps without decode (C: summed context per token)."""
    bins: dict[int, list[tuple[int, float, float]]] = {}
    for s in steps:
        if s.prefill and not s.decode:
            n = sum(c for _, c in s.prefill)
            bins.setdefault(_bin(n), []).append((n, sum(c * (p + (c - 1) / 2) for p, c in s.prefill), s.t))
    groups = [tuple(np.array(col, dtype=float) for col in zip(*bins[k])) for k in sorted(bins) if len(bins[k]) >= MIN_STEPS]
    if not groups:
        raise FitError(f"no prefill size has {MIN_STEPS} pure prefill steps (steps without decode) in the traces")
    slopes = [float(np.polyfit(c / n, (t - a) / n, 1)[0]) for n, c, t in groups if np.ptp(c / n) > 64]
    return (max(statistics.median(slopes), 0.0) if slopes else 0.0), groups


def fit(traces: list[list[dict]], meta: dict | None = None) -> Profile:
    """A :class:`Profile` fitted to the step records of ``traces`` (one list per run; module docstring).

    Raises:
        FitError: too few pure decode or pure prefill steps to fit.
    """
    steps, gaps = [], []
    for records in traces:
        s, g = steps_from_trace(records)
        steps += [x for x in s if math.isfinite(x.t) and x.t > 0]  # a broken record (end <= start, NaN) says nothing
        gaps += g
    gap = statistics.median(gaps) if gaps else 0.0
    for s in steps:
        s.t += gap
    a, k_dec, by_batch = _fit_decode(steps)
    k_pre, groups = _fit_prefill(steps, a)
    # the decode intercept may hold more than the per-call cost every call pays: no prefill bin may cost less
    a = max(0.0, min([a] + [float(np.median(t - k_pre * c)) for _, c, t in groups]))
    decode_points = [(bs, max(float(np.median(net - a)), 0.0)) for bs, net in by_batch.items()]
    prefill_points = [(float(np.median(n)), max(float(np.median((t - a - k_pre * c) / n)), 0.0)) for n, c, t in groups]
    prof = Profile(prefill_points=prefill_points, decode_points=decode_points, overhead_s=a, prefill_ctx=k_pre,
                   decode_ctx=k_dec, mixed_decode_factor=1.0, meta=dict(meta or {}))
    ratios = [(s.t - a - prof.prefill_cost(s.prefill)) / prof.decode_cost(s.decode)
              for s in steps if s.prefill and s.decode and prof.decode_cost(s.decode) > 0]
    prof.mixed_decode_factor = min(max(statistics.median(ratios), 0.0), 2.0) if ratios else 1.0
    resid = np.array([s.t / c for s in steps if (c := prof.step_cost(s.prefill, s.decode)) > 0])
    if not len(resid):
        raise FitError("no step has a positive predicted cost to measure the step-time spread against")
    prof.step_noise = [float(x) for x in np.quantile(resid, (np.arange(100) + 0.5) / 100)]
    prof.step_noise_source = (f"quantiles (i + 0.5) / 100 of measured / predicted step time over the {len(resid)} "
                              "fitted steps")
    prof.meta.setdefault("created", datetime.now(UTC).isoformat(timespec="seconds"))
    prof.meta["fit"] = {"steps": len(steps), "decode_steps": sum(1 for s in steps if s.decode and not s.prefill),
                        "prefill_steps": sum(1 for s in steps if s.prefill and not s.decode),
                        "mixed_steps": len(ratios), "idle_gap_s": gap}
    return prof


def bench_traces(path: str) -> tuple[list[list[dict]], dict, dict]:
    """The server traces of every measured run of a bench result, its first applied config and machine.

    Raises:
        ValueError: not a readable, measured quanta bench result.
    """
    import json

    from quanta.sim.compare import CompareError, check_measured

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        check_measured(path, doc)
        conds = [c for c in doc["conditions"] if c.get("valid", True)]
        traces = [r["trace"] for c in conds for r in c.get("runs") or [] if r.get("trace")]
        applied = next((c.get("applied") for c in conds if c.get("applied")), None) or {}
    except CompareError as exc:
        raise ValueError(str(exc)) from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a readable quanta bench result ({type(exc).__name__}: {exc})") from exc
    return traces, applied, doc.get("machine", {})
