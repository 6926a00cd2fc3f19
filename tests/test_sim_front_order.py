"""benchmarks/sim_front_order.py counts a burst's handover order as the front model sets it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.sim import Profile
from quanta.sim.front import FrontModel
from quanta.sim.run import simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sim_front_order  # noqa: E402

BASE = Profile(prefill_points=[(8, 3e-3), (256, 1e-3)], decode_points=[(1, 0.03), (8, 0.04)], overhead_s=0.005)
SCHED = SchedulerConfig("batched", 4, {"prefill_quantum": 256, "mixed_prefill_quantum": 64})


def burst_run(workers: int, lengths: list[int]) -> dict:
    """Four requests sent 1 ms apart, through a front of ``workers`` threads."""
    front = FrontModel(request_s=0.005, prompt_token_s=1e-5, workers=workers)
    w = Workload(kind="burst", num_requests=4, prompt_words=10, max_tokens=1)
    return simulate(Profile(**{**BASE.__dict__, "front": front}), SCHED, w, prompt_lengths=lengths,
                    send_delays=[0.0, 0.001, 0.002, 0.003])


@pytest.mark.parametrize("workers, expected", [
    # two threads: the long first-sent prompt is handed over last, behind the three sent after it
    (2, {"bursts": 1, "reversed": 0.5, "first_first": 0.0, "first_last": 1.0, "long_place": 1.0, "long_last": 1.0}),
    # one thread keeps the send order
    (1, {"bursts": 1, "reversed": 0.0, "first_first": 1.0, "first_last": 0.0, "long_place": 0.0, "long_last": 0.0}),
])
def test_the_counts_follow_the_handover_order(workers, expected):
    st = sim_front_order.tally([burst_run(workers, [2500, 50, 60, 70])], long_tokens=2000)
    got = sim_front_order.shares(st)
    assert {k: got[k] for k in expected} == pytest.approx(expected)
    assert got["long_bursts"] == 1


def test_a_burst_without_a_long_prompt_has_no_longest_place():
    got = sim_front_order.shares(sim_front_order.tally([burst_run(2, [500, 50, 60, 70])], long_tokens=2000))
    assert got["bursts"] == 1 and got["long_bursts"] == 0 and got["long_place"] != got["long_place"]  # NaN
