"""The client-side timeout rule of benchmarks/agent_sessions_timeouts.py: when an agent drops a
streamed request (idle silence, late headers or first event, a whole-request limit), on synthetic
timelines, and the live watchdog that drops and re-sends a stream that goes silent."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
import time
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "agent_sessions_timeouts.py"
_spec = importlib.util.spec_from_file_location("agent_sessions_timeouts", _PATH)
ast_bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ast_bench  # dataclasses look their module up
_spec.loader.exec_module(ast_bench)
ClientRule, deadline, first_violation = ast_bench.ClientRule, ast_bench.deadline, ast_bench.first_violation

IDLE = ClientRule("idle", "events", idle_s=300.0)
ALL = ClientRule("all", "events", idle_s=300.0, header_s=600.0, first_event_s=180.0, total_s=1000.0)


def test_keepalives_every_ten_seconds_through_a_long_prefill_are_no_timeout():
    items = [0.1] + [0.1 + 10 * k for k in range(1, 120)] + [1200.0]  # 20 minutes, never 300 s silent
    assert first_violation(IDLE, 0.0, 0.05, items, 1201.0) is None


def test_the_first_gap_over_the_idle_limit_drops_at_its_limit():
    items = [0.1, 100.0, 350.0, 700.0]  # 100 -> 350 is 250 s; 350 -> 700 is 350 s
    assert first_violation(IDLE, 0.0, 0.05, items, 701.0) == pytest.approx(650.0)


def test_silence_from_the_headers_to_the_first_event_counts():
    assert first_violation(IDLE, 0.0, 2.0, [303.0], 304.0) == pytest.approx(302.0)
    assert first_violation(IDLE, 0.0, 2.0, [301.0], 304.0) is None


def test_silence_after_the_last_event_until_the_end_counts():
    assert first_violation(IDLE, 0.0, 0.05, [0.1, 50.0], 400.0) == pytest.approx(350.0)


def test_a_gap_of_exactly_the_limit_is_not_a_timeout():
    assert first_violation(IDLE, 0.0, 0.0, [300.0, 600.0], 600.0) is None


def test_headers_first_event_and_whole_request_limits():
    assert first_violation(ALL, 0.0, None, [], 700.0) == pytest.approx(600.0)  # no headers in 600 s
    assert first_violation(ALL, 0.0, 1.0, [200.0], 210.0) == pytest.approx(180.0)  # first event after 180 s
    steady = [1.0 + 5 * k for k in range(300)]  # an event every 5 s for 1,500 s
    assert first_violation(ALL, 0.0, 0.5, steady, 1500.0) == pytest.approx(1000.0)


def test_deadline_is_the_earliest_running_limit():
    assert deadline(IDLE, 0.0, None, []) == math.inf  # no header limit: waits for headers forever
    assert deadline(ALL, 10.0, None, []) == 610.0
    assert deadline(ALL, 10.0, 11.0, []) == 190.0  # the first-event limit comes before idle (311)
    assert deadline(ALL, 10.0, 11.0, [12.0, 900.0]) == 1010.0  # whole request (1010) before idle (1200)


def test_longest_gap_before_the_first_token_and_overall():
    assert ast_bench.longest_gap(0.0, [0.1, 10.1, 20.1, 20.2, 50.0], until=20.2) == pytest.approx(10.0)
    assert ast_bench.longest_gap(0.0, [0.1, 10.1, 20.1, 20.2, 50.0]) == pytest.approx(29.8)


def test_the_watchdog_drops_a_silent_stream_and_not_a_lively_one():
    start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - start

    rule = ClientRule("short", "events", idle_s=0.3)

    async def stream(attempt, gaps):
        attempt.headers = clock()
        for gap in gaps:
            await asyncio.sleep(gap)
            attempt.events.append(clock())

    async def one(gaps):
        attempt = ast_bench.Attempt(sent=clock())
        dropped = await ast_bench.supervise(rule, stream(attempt, gaps), attempt, clock, poll=0.02)
        return dropped, attempt

    dropped, attempt = asyncio.run(one([0.1] * 8))  # 0.8 s of events 0.1 s apart
    assert not dropped and len(attempt.events) == 8
    dropped, attempt = asyncio.run(one([0.1, 0.1, 1.0, 0.1]))  # silent 1 s after the second event
    assert dropped and len(attempt.events) == 2
    assert attempt.dropped - attempt.events[-1] == pytest.approx(0.3, abs=0.1)
