"""The decode pool's thread count found by trying (:mod:`quanta.model.thread_tuner`), on step
times made up for each case: the tuner sees only times, as it does in a server."""

from __future__ import annotations

import random

import pytest

from quanta.model.thread_tuner import MAX_EVERY, ThreadTuner


def _run(tuner: ThreadTuner, cost: dict[int, float], steps: int, rows: int = 8, noise: float = 0.0,
         rng: random.Random | None = None) -> list[int]:
    """The threads of ``steps`` decode steps whose time on n threads is ``cost[n]`` (times 1 +- noise)."""
    rng = rng or random.Random(0)
    picked = []
    for _ in range(steps):
        threads = tuner.pick()
        picked.append(threads)
        tuner.record(threads, rows, cost[threads] * (1 + rng.uniform(-noise, noise)))
    return picked


def test_on_idle_cores_two_threads_stay_and_tries_grow_rare():
    tuner = ThreadTuner(2)
    picked = _run(tuner, {1: 0.015, 2: 0.010}, 2000, noise=0.1)
    assert tuner.current == 2 and tuner.switches == 0
    assert tuner.every == MAX_EVERY
    assert picked[-1000:].count(1) <= 1000 // MAX_EVERY + 1


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_where_one_thread_is_faster_the_tuner_moves_to_it(noise):
    tuner = ThreadTuner(2)
    picked = _run(tuner, {1: 0.027, 2: 0.034}, 400, noise=noise)
    assert tuner.current == 1
    assert picked[-200:].count(1) >= 180


def test_it_follows_the_cores_when_they_free_up_again():
    tuner = ThreadTuner(2)
    _run(tuner, {1: 0.027, 2: 0.034}, 200)
    assert tuner.current == 1
    picked = _run(tuner, {1: 0.025, 2: 0.016}, 400)
    assert tuner.current == 2 and picked[-200:].count(2) >= 190


def test_steps_of_other_row_counts_are_not_compared():
    tuner = ThreadTuner(2)
    rng = random.Random(1)
    for _ in range(400):  # one thread alternates between 1 row (cheap) and 8 rows (dear): never compared across
        threads = tuner.pick()
        rows = rng.choice((1, 8))
        tuner.record(threads, rows, (0.005 if rows == 1 else 0.05) * (1.4 if threads == 1 else 1.0))
    assert tuner.current == 2 and tuner.switches == 0


@pytest.mark.parametrize("threads,fixed", [(2, True), (1, False), (1, True)])
def test_a_count_set_by_hand_or_one_core_is_kept(threads, fixed):
    tuner = ThreadTuner(threads, fixed=fixed)
    picked = _run(tuner, {1: 0.05, 2: 0.01} if threads == 1 else {1: 0.01, 2: 0.05}, 300)
    assert set(picked) == {threads} and tuner.tries == 0


def test_when_other_work_starts_the_next_step_tries_the_other_count():
    tuner = ThreadTuner(2)
    _run(tuner, {1: 0.015, 2: 0.010}, 2000)
    assert tuner.every == MAX_EVERY
    picked = _run(tuner, {1: 0.027, 2: 0.034}, 40)  # a busy process started: two threads now slower
    assert tuner.current == 1 and tuner.switches == 1
    assert picked.index(1) <= 12  # tried within a few steps, not after up to MAX_EVERY
