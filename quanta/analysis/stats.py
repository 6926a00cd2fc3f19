"""Percentiles and spread.

Every figure of a run comes from one list of samples: the mean and the
percentiles of a metric are computed from the same list. Figures over repeats
are the median with the interquartile range (p25-p75), written as
``8.21 (7.51-11.30)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: percentiles reported for every latency distribution.
PERCENTILES = (50, 90, 99)


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between
    closest ranks (numpy's default). NaN for an empty list.

    Raises:
        ValueError: ``q`` outside 0..100.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not samples:
        return math.nan
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples: Sequence[float]) -> dict:
    """``{n, mean, p50, p90, p99, max}`` of one sample list (same unit as the
    samples; NaN figures when empty)."""
    n = len(samples)
    out = {"n": n, "mean": (math.fsum(samples) / n) if n else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(samples, q)
    out["max"] = max(samples) if n else math.nan
    return out


def known(values: Sequence[float]) -> int:
    """How many of ``values`` are numbers (not None, not NaN)."""
    return sum(1 for v in values if v is not None and not math.isnan(v))


def median_iqr(values: Sequence[float]) -> tuple[float, float, float]:
    """``(median, p25, p75)`` of per-repeat figures, NaNs left out; all NaN if none remain."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return (math.nan, math.nan, math.nan)
    return (percentile(xs, 50), percentile(xs, 25), percentile(xs, 75))


def fmt_spread(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    """``"median (p25-p75)"`` of ``values`` times ``scale``; the value alone when only one is known
    (one repeat has no spread); ``"n/a"`` if no value."""
    med, lo, hi = median_iqr(values)
    if math.isnan(med):
        return "n/a"
    if known(values) == 1:
        return f"{med * scale:.{digits}f}"
    return f"{med * scale:.{digits}f} ({lo * scale:.{digits}f}-{hi * scale:.{digits}f})"


def fmt_value(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    """One number times ``scale``; ``"n/a"`` for None or NaN."""
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value * scale:.{digits}f}"
