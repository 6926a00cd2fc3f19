"""Interval arithmetic for busy time and overlap.

Summing the durations of overlapping intervals counts shared time twice: two
requests prefilled in the same second are one second of prefill, not two. So
busy time is the length of the *union* of the intervals, a rate is work /
busy time, and occupancy is busy time / wall time.
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the input's union (seconds).

    Empty or reversed intervals (``end <= start``) cover nothing and are dropped.
    Touching intervals are merged.
    """
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def union_length(intervals: Iterable[Interval]) -> float:
    """Length of the union (seconds): time in which at least one interval was open."""
    return sum(e - s for s, e in union(intervals))


def intersection_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of ``union(a) ∩ union(b)`` (seconds)."""
    ua, ub = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if hi > lo:
            total += hi - lo
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_ratio(prefill: Iterable[Interval], decode: Iterable[Interval]) -> float:
    """Share (0..1) of prefill time during which decoding was also under way:
    ``|∪prefill ∩ ∪decode| / |∪prefill|``. NaN when there was no prefill time."""
    prefill = list(prefill)
    total = union_length(prefill)
    if total <= 0:
        return float("nan")
    return intersection_length(prefill, decode) / total


def busy_rate(work: float, intervals: Iterable[Interval]) -> float:
    """``work`` (e.g. tokens) per second of union busy time; NaN without busy time."""
    busy = union_length(intervals)
    return work / busy if busy > 0 else float("nan")


def occupancy(intervals: Iterable[Interval], wall: float) -> float:
    """Union busy time / ``wall`` seconds (0..1); NaN for a non-positive wall."""
    return union_length(intervals) / wall if wall > 0 else float("nan")
