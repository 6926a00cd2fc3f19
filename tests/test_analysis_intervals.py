"""Union-of-intervals busy time, rates, occupancy and overlap on hand-made intervals."""

import math

import pytest

from quanta.analysis.intervals import busy_rate, intersection_length, occupancy, overlap_ratio, union, union_length


def test_union_merges_overlapping_and_touching_and_drops_empty():
    assert union([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7), (9, 8)]) == [(0, 4), (5, 6)]
    assert union_length([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)  # a plain sum would say 5
    assert union_length([]) == 0.0


def test_prefill_rate_counts_overlapping_time_once():
    # two requests, 100 prompt tokens each, prefilled over (0, 1) and (0.5, 1.5): 1.5 s busy
    intervals = [(0.0, 1.0), (0.5, 1.5)]
    assert busy_rate(200, intervals) == pytest.approx(200 / 1.5)
    assert busy_rate(200, intervals) != pytest.approx(200 / 2.0)  # what summing durations would give
    assert math.isnan(busy_rate(10, []))
    assert occupancy(intervals, 3.0) == pytest.approx(0.5)


def test_intersection_and_overlap_ratio():
    prefill = [(0, 2), (4, 6)]
    decode = [(1, 5)]
    assert intersection_length(prefill, decode) == pytest.approx(2.0)
    assert overlap_ratio(prefill, decode) == pytest.approx(0.5)
    assert overlap_ratio(prefill, []) == 0.0
    assert math.isnan(overlap_ratio([], decode))
    # several decode intervals that overlap each other are one union
    assert overlap_ratio([(0, 10)], [(1, 3), (2, 4), (8, 9)]) == pytest.approx(0.4)
