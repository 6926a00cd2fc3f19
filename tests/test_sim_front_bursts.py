"""benchmarks/sim_front_bursts.py: burst pairs by prompt size, and the line of a burst's first-sent delay."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from quanta.sim.front import FrontModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sim_front_bursts  # noqa: E402


def test_pairs_are_counted_by_the_size_classes_of_first_and_second_sent():
    # (sent, prompt tokens, handed over): the long first-sent prompt handed over after both short ones
    burst = [(0.0, 2500, 0.010), (0.001, 50, 0.005), (0.002, 60, 0.006)]
    st = sim_front_bursts.pair_counts([burst])
    assert st[("L", "S")] == 2 and st[("rev", "L", "S")] == 2
    assert st[("S", "S")] == 1 and st[("rev", "S", "S")] == 0
    assert sim_front_bursts.size_class(499) == "S" and sim_front_bursts.size_class(500) == "M"
    assert sim_front_bursts.size_class(1500) == "L"


def test_the_first_sent_delay_line_recovers_what_a_burst_charges_its_first_request():
    rng = random.Random(0)
    groups = []
    for _ in range(40):
        sizes = [rng.randrange(20, 3000) for _ in range(rng.randrange(2, 8))]
        later = sum(sizes[1:])
        handed = 0.004 + 2e-6 * sizes[0] + 1.5e-6 * later + 1e-3 * (len(sizes) - 1)
        groups.append([(0.0, sizes[0], handed)] + [(0.0001 * i, n, handed + 1e-4 * i) for i, n in enumerate(sizes[1:], 1)])
    fit = sim_front_bursts.first_delay_fit(groups)
    assert fit["bursts"] == 40
    assert fit["intercept_s"] == pytest.approx(0.004, rel=1e-6)
    assert fit["own_s_per_token"] == pytest.approx(2e-6, rel=1e-6)
    assert fit["later_s_per_token"] == pytest.approx(1.5e-6, rel=1e-6)
    assert fit["later_s_per_request"] == pytest.approx(1e-3, rel=1e-6)


def test_too_few_bursts_give_no_line():
    assert sim_front_bursts.first_delay_fit([[(0.0, 10, 0.01), (0.0, 20, 0.01)]]) == {"bursts": 1}


def test_a_two_thread_front_hands_a_long_first_sent_prompt_over_after_a_short_one():
    front = FrontModel(request_s=0.005, prompt_token_s=1e-5, workers=2)
    burst = [(0.0, 2500, 0.0), (0.001, 50, 0.0)]
    (out,) = sim_front_bursts.through_front([burst], front, random.Random(0))
    assert out[1][2] < out[0][2]  # 25 ms of tokenizing against 0.5 ms
    one = FrontModel(request_s=0.005, prompt_token_s=1e-5, workers=1)
    (kept,) = sim_front_bursts.through_front([burst], one, random.Random(0))
    assert kept[0][2] < kept[1][2]  # one thread keeps the send order
