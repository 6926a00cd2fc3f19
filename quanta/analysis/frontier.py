"""Pareto frontier of (throughput, p99 ITL): higher throughput and lower p99 are better."""

from __future__ import annotations

import math
from collections.abc import Sequence


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """``a = (throughput, p99)`` is at least as good as ``b`` in both and better in one."""
    return a[0] >= b[0] and a[1] <= b[1] and (a[0] > b[0] or a[1] < b[1])


def pareto_frontier(points: Sequence[tuple[str, float, float]]) -> list[str]:
    """Names of the non-dominated points among ``(name, throughput tok/s, p99 s)``,
    ordered by throughput (descending). Points with a NaN figure are left out;
    equal points are all kept."""
    valid = [(n, t, p) for n, t, p in points if not (math.isnan(t) or math.isnan(p))]
    keep = [(n, t, p) for n, t, p in valid if not any(dominates((t2, p2), (t, p)) for _, t2, p2 in valid)]
    return [n for n, _, _ in sorted(keep, key=lambda x: (-x[1], x[2], x[0]))]
