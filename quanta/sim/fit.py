"""A cost profile fitted to a running server's step trace (``quanta profile-engine --from-bench``).

``quanta profile-engine`` times the executor alone, in-process. A server also
runs an HTTP event loop, detokenizes and streams every token, and on a small
machine shares its cores with the benchmark client; all of that lengthens the
steps the scheduler actually waits for. Fitting the profile to the server's
own trace (``/v1/trace``, recorded by ``quanta bench`` in every run) measures
the steps as they ran under load, with the mix of prompt and decode rows,
contexts and prefix hits the workload had.

Per step of the trace (:func:`steps_from_trace`): ``t = end - start`` plus the
median idle gap between back-to-back steps (the engine loop's own per-step
time, which the simulator does not model separately), the prompt chunks
``(start position, tokens)``, the decode rows' positions and the prefix-hit
tokens. Positions are the record's ``positions`` (what each sequence had
computed before the step, a prefix-cache hit included) where the record has
them, else rebuilt by walking the trace (:func:`trace_entries`: positions
accumulate ``num_new_tokens`` from 0, so a prefix hit is not seen). A prompt
row is one of a sequence that has not emitted a token yet. Prefix-hit tokens:
the recorded position of a sequence's first prompt chunk in the trace.

The fit (:func:`fit_step_model`): the :class:`~quanta.sim.step_model.StepModel`
coefficients by non-negative least squares on relative error (every row of
features and its time divided by the time, so a 10 ms decode step weighs as
much as a 2 s prefill step), knots at quantiles of the steps' prompt rows and
decode rows unless given; then once more without the steps whose relative
error exceeds ``max(5%, 3 x p90)`` (stalls: a step the engine waited in for
something else). The residuals, ``|predicted / measured - 1|`` over every
step, are reported per step kind (median and p90).

``step_noise``: the 100 quantiles (at (i + 0.5) / 100) of measured /
predicted time over every step, so the simulator draws step times with the
measured spread (a p99 ITL made of step-time jitter, not of stalls, needs it;
with fixed step times the simulated p99 of a steady decode is its median);
and the same per bin of predicted cost (``by_cost``, :func:`noise_bins`): a
10 ms decode step jitters by tens of percent where a 4 s prefill step varies
by a few, so one pooled distribution would lengthen long steps on average
(their simulated prompt rate came out ~8% low on a Mooncake window).
``steady_decode``: the same quantiles over the steady decode steps alone
(decode rows only, each of a sequence that decoded before; :attr:`Step.steady`),
whose steps leave the bins: a sequence's first decode step now and then
waits 5-20 times its cost (on the Mooncake windows of
``benchmarks/sim_holdout.sh``: p99 8.2 against 1.8 for the other decode
steps), so drawn by cost alone a quiet decode's p99 gap came out 43-133% long
(a replayed codex session; the probe at quantum 2048).
The profile's ``prefill``/``decode`` points, overhead and context
coefficients are the step model's own (read by tools that know no step
model; they leave out interference and prefix hits).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

from quanta.analysis.server_trace import trace_entries
from quanta.sim.profile import Profile, Wake
from quanta.sim.step_model import SCALARS, StepModel, nnls

#: back-to-back steps: the next step starts within this many seconds of the previous end
BUSY_GAP_S = 0.005
#: fewer steps with prompt rows or with decode rows than this: no fit
MIN_STEPS = 3
#: a step that starts this long (seconds) or more after the previous one ended, or a run's first, follows an
#: idle engine (:class:`~quanta.sim.profile.Wake`); on the measured host such steps ran 1.10-1.22x their
#: prediction, none started 5-100 ms after another, and 23 prompt calls that did 100 ms - 1 s took 0.88-1.00x
WAKE_IDLE_S = 1.0
#: fewer steps after an idle engine, or fewer others, than this: no wake factor
MIN_WAKE_STEPS = 10
#: at most this many knots on each curve
MAX_KNOTS = 6
#: bounds (predicted seconds) of the step-noise bins: a decode step's relative jitter is not a 4 s prefill's
NOISE_BOUNDS_S = (0.05, 0.5)
#: a step-noise bin needs at least this many steps, else it joins its neighbour
MIN_NOISE_STEPS = 30
#: terms a fit may leave out (fixed at 0)
TERMS = SCALARS


class FitError(ValueError):
    """The traces hold too few steps of a kind to fit a profile."""


@dataclass
class Step:
    """One forward call reconstructed from the trace (seconds, positions in tokens)."""

    t: float
    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    hit: int = 0
    #: a decode row of the step is its sequence's first (the step after its prompt's last chunk)
    first_decode: bool = False
    #: seconds from the previous step's end to this one's start in its run (None: the run's first step)
    idle_before: float | None = None

    @property
    def kind(self) -> str:
        return "mixed" if self.prefill and self.decode else "prefill" if self.prefill else "decode"

    @property
    def steady(self) -> bool:
        """Decode rows only, each of a sequence that decoded before (:data:`~quanta.sim.profile.Profile.steady_noise`)."""
        return self.kind == "decode" and not self.first_decode


def steps_from_trace(records: list[dict]) -> tuple[list[Step], list[float]]:
    """The steps of one run's trace, and the idle gaps between back-to-back steps (seconds)."""
    steps, gaps, prev_end, seen, decoded = [], [], None, set(), set()
    for r, row in trace_entries(records):
        s = Step(r["end"] - r["start"], idle_before=None if prev_end is None else r["start"] - prev_end)
        recorded = r.get("positions")
        for i, (sid, pos, n, is_decode, _) in enumerate(row):
            if is_decode:
                s.first_decode |= sid not in decoded
                decoded.add(sid)
            if recorded is not None:
                pos = int(recorded[i])
                if not is_decode and sid not in seen:
                    s.hit += pos
            seen.add(sid)
            if is_decode:
                s.decode.append(pos)
            else:
                s.prefill.append((pos, n))
        if prev_end is not None and 0 <= r["start"] - prev_end <= BUSY_GAP_S:
            gaps.append(r["start"] - prev_end)
        prev_end = r["end"]
        steps.append(s)
    return steps, gaps


def knots(values: list[float], log: bool) -> list[float]:
    """At most :data:`MAX_KNOTS` knots at quantiles of ``values`` (of log values with ``log``), rounded to
    integers, each at least 1.5x (``log``) or 1 above the previous."""
    v = np.log(np.asarray(values, dtype=float)) if log else np.asarray(values, dtype=float)
    out: list[float] = []
    for q in np.quantile(v, np.linspace(0, 1, MAX_KNOTS)):
        x = float(round(math.exp(q) if log else q))
        if not out or x >= (out[-1] * 1.5 if log else out[-1] + 1):
            out.append(x)
    return out


def design(model: StepModel, steps: list[Step], without: tuple[str, ...] = ()) -> np.ndarray:
    """The feature matrix of ``steps`` under ``model``'s knots, the ``without`` terms' columns zeroed."""
    a = np.array([model.features(s.prefill, s.decode, s.hit) for s in steps])
    names = model.names()
    for term in without:
        a[:, names.index(term)] = 0.0
    return a


def fit_step_model(steps: list[Step], prefill_knots: list[float] | None = None, decode_knots: list[float] | None = None,
                   without: tuple[str, ...] = ()) -> StepModel:
    """The :class:`StepModel` of ``steps`` (module docstring), its residuals in ``fit``.

    Raises:
        FitError: fewer than :data:`MIN_STEPS` steps with prompt rows or with decode rows, or an unknown term.
    """
    if unknown := [w for w in without if w not in TERMS]:
        raise FitError(f"unknown term {unknown[0]!r}: terms that can be left out are {', '.join(TERMS)}")
    pre = [sum(c for _, c in s.prefill) for s in steps if s.prefill]
    dec = [len(s.decode) for s in steps if s.decode]
    for name, xs in (("prompt", pre), ("decode", dec)):
        if len(xs) < MIN_STEPS:
            raise FitError(f"only {len(xs)} of the traces' steps have {name} rows; need at least {MIN_STEPS}")
    model = StepModel(prefill_knots=list(prefill_knots or knots(pre, log=True)),
                      decode_knots=list(decode_knots or knots(dec, log=False)))
    model.prefill_s_per_row, model.decode_s = [0.0] * len(model.prefill_knots), [0.0] * len(model.decode_knots)
    a, t = design(model, steps, without), np.array([s.t for s in steps])
    keep = np.ones(len(steps), dtype=bool)
    for _ in range(2):
        coef = nnls(a[keep] / t[keep, None], np.ones(int(keep.sum())))
        err = np.abs(a @ coef / t - 1)
        keep = err <= max(0.05, 3 * float(np.quantile(err, 0.9)))
    fitted = model.with_coefficients(coef)
    fitted.fit = {"steps": len(steps), "left_out_as_stalls": int((~keep).sum()), "without": list(without),
                  "residuals": residuals(fitted, steps)}
    return fitted


def residuals(model: StepModel, steps: list[Step]) -> dict:
    """Per step kind: ``steps``, ``median`` and ``p90`` of ``|predicted / measured - 1|``."""
    out = {}
    for kind in ("prefill", "decode", "mixed"):
        err = [abs(model.cost(s.prefill, s.decode, s.hit) / s.t - 1) for s in steps if s.kind == kind]
        if err:
            out[kind] = {"steps": len(err), "median": float(np.median(err)), "p90": float(np.quantile(err, 0.9))}
    return out


def trace_steps(traces: list[list[dict]]) -> tuple[list[Step], float]:
    """The steps of ``traces`` (one list of records per run) timed ``end - start`` plus the median idle gap
    between back-to-back steps, and that gap; broken records (end <= start, NaN) are left out."""
    steps, gaps = [], []
    for records in traces:
        s, g = steps_from_trace(records)
        steps += [x for x in s if math.isfinite(x.t) and x.t > 0]
        gaps += g
    gap = statistics.median(gaps) if gaps else 0.0
    for s in steps:
        s.t += gap
    return steps, gap


def check(model: StepModel, traces: list[list[dict]]) -> dict:
    """:func:`residuals` of ``model`` on the steps of ``traces`` (runs it was not fitted to, for an
    out-of-sample check)."""
    return residuals(model, trace_steps(traces)[0])


def fit_wake(costed: list[tuple[Step, float]]) -> Wake | None:
    """The :class:`~quanta.sim.profile.Wake` of steps, each with its predicted cost (> 0): the median measured /
    predicted time of the steps after an idle engine (:data:`WAKE_IDLE_S`, :meth:`Wake.applies`) over that of
    the others; None with fewer than :data:`MIN_WAKE_STEPS` of either."""
    idle = Wake(WAKE_IDLE_S, 1.0)
    woke, busy = [], []
    for s, c in costed:
        (woke if idle.applies(s.idle_before) else busy).append(s.t / c)
    if len(woke) < MIN_WAKE_STEPS or len(busy) < MIN_WAKE_STEPS:
        return None
    return Wake(WAKE_IDLE_S, float(np.median(woke) / np.median(busy)), len(woke))


def _wake_factor(prof: Profile, s: Step) -> float:
    return prof.wake.factor if prof.wake is not None and prof.wake.applies(s.idle_before) else 1.0


def _quantiles(ratios: list[float]) -> list[float]:
    return [float(x) for x in np.quantile(ratios, (np.arange(100) + 0.5) / 100)]


def noise_bins(priced: list[tuple[float, float]]) -> list[tuple[float, list[float]]]:
    """Step-noise factors per bin of predicted cost: ``priced`` holds ``(predicted s, measured / predicted)``
    per step; bins are bounded by :data:`NOISE_BOUNDS_S` (the last unbounded), and a bin of fewer than
    :data:`MIN_NOISE_STEPS` steps is merged into the one above it (the top one into the one below)."""
    bounds = [*NOISE_BOUNDS_S, math.inf]
    groups: list[list[float]] = [[] for _ in bounds]
    for cost, ratio in priced:
        groups[next(i for i, b in enumerate(bounds) if cost <= b)].append(ratio)
    bins: list[tuple[float, list[float]]] = []
    for bound, ratios in zip(bounds, groups, strict=True):
        if bins and len(bins[-1][1]) < MIN_NOISE_STEPS:  # the bin below is too small: it reaches up to this bound
            bins[-1] = (bound, bins[-1][1] + ratios)
        else:
            bins.append((bound, ratios))
    if len(bins) > 1 and len(bins[-1][1]) < MIN_NOISE_STEPS:  # the top bin is too small: the one below takes it
        top = bins.pop()
        bins[-1] = (top[0], bins[-1][1] + top[1])
    return [(bound, _quantiles(ratios)) for bound, ratios in bins]


def fit(traces: list[list[dict]], meta: dict | None = None, threads: dict | None = None,
        without: tuple[str, ...] = ()) -> Profile:
    """A :class:`Profile` with a step model fitted to the step records of ``traces`` (one list per run;
    module docstring); ``threads``: the server's thread counts, kept as the model's metadata.

    Raises:
        FitError: too few steps with prompt or decode rows to fit.
    """
    steps, gap = trace_steps(traces)
    model = fit_step_model(steps, without=without)
    model.threads = dict(threads or {})
    prof = Profile(prefill_points=list(zip(model.prefill_knots, model.prefill_s_per_row)),
                   decode_points=list(zip(model.decode_knots, model.decode_s)), overhead_s=model.overhead_s,
                   prefill_ctx=model.prefill_ctx_s, decode_ctx=model.decode_ctx_s, meta=dict(meta or {}), step_model=model)
    costed = [(s, c) for s in steps if (c := prof.step_cost(s.prefill, s.decode, s.hit)) > 0]
    prof.wake = fit_wake(costed)
    priced = [(c, s.t / c / _wake_factor(prof, s), s.steady) for s, c in costed]
    if not priced:
        raise FitError("no step has a positive predicted cost to measure the step-time spread against")
    steady = [r for _, r, st in priced if st]
    if len(steady) < MIN_NOISE_STEPS or len(steady) == len(priced):
        steady = []  # too few steady steps to stand alone, or no other step: one set of bins for all
    prof.step_noise = _quantiles([r for _, r, _ in priced])
    prof.step_noise_bins = noise_bins([(c, r) for c, r, st in priced if not (st and steady)])
    prof.steady_noise = _quantiles(steady) if steady else None
    prof.step_noise_source = (f"quantiles (i + 0.5) / 100 of measured / predicted step time over the {len(priced)} "
                              f"fitted steps; steady_decode: the same over the {len(steady)} steps of decode rows "
                              f"that all decoded before; by_cost: over the other steps, per bin of predicted cost "
                              f"(bounds {NOISE_BOUNDS_S} s, a bin of fewer than {MIN_NOISE_STEPS} steps joins its "
                              f"neighbour)")
    prof.meta.setdefault("created", datetime.now(UTC).isoformat(timespec="seconds"))
    kinds = [s.kind for s in steps]
    prof.meta["fit"] = {"steps": len(steps), "decode_steps": kinds.count("decode"), "prefill_steps": kinds.count("prefill"),
                        "mixed_steps": kinds.count("mixed"), "idle_gap_s": gap}
    return prof
