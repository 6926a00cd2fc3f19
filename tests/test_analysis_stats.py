"""Percentiles, summaries, spread, Pareto frontier: hand-made samples with known answers."""

import math

import pytest

from quanta.analysis.frontier import dominates, pareto_frontier
from quanta.analysis.stats import fmt_spread, fmt_value, median_iqr, percentile, summarize


def test_percentile_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 25) == pytest.approx(1.75)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summary_mean_and_percentiles_come_from_the_same_samples():
    xs = [0.010] * 98 + [0.500, 1.000]
    s = summarize(xs)
    assert s["n"] == 100
    assert s["mean"] == pytest.approx(sum(xs) / 100)
    assert s["p50"] == pytest.approx(0.010)
    assert s["p99"] == pytest.approx(0.500 + 0.01 * (1.000 - 0.500))
    assert s["max"] == 1.0
    empty = summarize([])
    assert empty["n"] == 0 and math.isnan(empty["mean"]) and math.isnan(empty["p99"])


def test_median_iqr_and_format():
    assert median_iqr([5.0, 1.0, 3.0, 2.0, 4.0]) == (3.0, 2.0, 4.0)
    assert median_iqr([1.0, math.nan, 3.0]) == (2.0, 1.5, 2.5)
    assert all(math.isnan(v) for v in median_iqr([math.nan, None]))
    # seconds -> ms, "median (p25-p75)"
    assert fmt_spread([0.00751, 0.00821, 0.01130, 0.00790, 0.00900], 1e3) == "8.21 (7.90-9.00)"
    assert fmt_spread([]) == "n/a"
    assert fmt_spread([0.0082], 1e3) == "8.20" and fmt_spread([0.0082, math.nan], 1e3) == "8.20"  # one repeat: no range
    assert fmt_value(math.nan) == "n/a" and fmt_value(0.5, 1e3, 0) == "500"


def test_pareto_frontier_keeps_only_non_dominated_conditions():
    pts = [("A", 100.0, 0.05), ("B", 200.0, 0.10), ("C", 150.0, 0.12), ("D", 90.0, 0.04),
           ("E", 100.0, 0.05), ("F", 80.0, 0.06), ("G", math.nan, 0.01)]
    # C is dominated by B (more throughput, lower p99); F by A; G has no throughput
    assert pareto_frontier(pts) == ["B", "A", "E", "D"]
    assert dominates((200, 0.1), (150, 0.12)) and not dominates((100, 0.05), (100, 0.05))
    assert pareto_frontier([]) == []
