"""The thread-hosted engine: a failing step fails only its requests; closing a stream aborts;
requests being prepared hold a place in ``max_queue``."""

from __future__ import annotations

import asyncio
import time

import pytest

from quanta.config import SchedulerConfig
from quanta.engine.async_engine import AsyncEngine, QueueFullError, RequestFailed
from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepResult
from quanta.engine.sampling import SamplingParams

POISON = 13  # a prompt containing this token makes the executor raise


class FlakyExecutor(Executor):
    """Emits token 7 when a chunk completes; raises on any plan that carries a poisoned prompt."""

    def execute(self, plan, interrupt=None):
        if any(POISON in c.seq.prompt_token_ids for c in plan.chunks):
            raise RuntimeError("kernel failure")
        return StepResult([7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None for c in plan.chunks])


async def _collect(engine: AsyncEngine, prompt: list[int], max_tokens: int) -> list[int]:
    stream = await engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    tokens = []
    async for out in stream:
        tokens += out.token_ids
    return tokens


@pytest.fixture
def engine():
    eng = AsyncEngine(Engine(SchedulerConfig("batched", 1).build(), FlakyExecutor(), max_model_len=64))
    eng.start()
    yield eng
    eng.stop()


def test_failing_step_fails_its_request_and_the_engine_goes_on(engine):
    async def scenario():
        with pytest.raises(RequestFailed, match="engine step failed .error id [0-9a-f]+"):
            await asyncio.wait_for(_collect(engine, [1, POISON, 2], 4), 10)
        return await asyncio.wait_for(_collect(engine, [1, 2, 3], 4), 10)

    assert asyncio.run(scenario()) == [7, 7, 7, 7]
    assert engine.alive and not engine.engine.scheduler.has_work()


def test_closing_a_stream_early_frees_the_slot(engine):
    async def scenario():
        stream = await engine.submit([1, 2], SamplingParams(max_tokens=50, temperature=0))
        await stream.__anext__()
        stream.abort()
        # the only slot must come back: this request can run only after the abort
        return await asyncio.wait_for(_collect(engine, [3, 4], 3), 10)

    assert asyncio.run(scenario()) == [7, 7, 7]


class CountingEngine(Engine):
    """An :class:`Engine` that counts its length checks."""

    checks = 0

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.checks += 1
        super().check_length(num_prompt_tokens, max_tokens)


def test_the_length_check_runs_once_per_request():
    core = CountingEngine(SchedulerConfig("batched", 1).build(), FlakyExecutor(), max_model_len=64)
    eng = AsyncEngine(core)
    eng.start()

    async def scenario():
        # the server's way: check first (before any grammar is built), then tell the engine it passed
        eng.check_length(2, 3)
        stream = await eng.submit([1, 2], SamplingParams(max_tokens=3, temperature=0), length_checked=True)
        first = [t async for out in stream for t in out.token_ids]
        checks_after_first = core.checks
        # a library caller that checks nothing: the engine checks once, and refuses what cannot fit
        second = await _collect(eng, [3, 4], 2)
        with pytest.raises(ValueError, match=r"plus max_tokens \(10\) = 70 exceeds max_model_len \(64\)"):
            await eng.submit([5] * 60, SamplingParams(max_tokens=10, temperature=0))
        return first, checks_after_first, second

    try:
        first, checks_after_first, second = asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        eng.stop()
    assert (first, checks_after_first, second) == ([7, 7, 7], 1, [7, 7])
    assert core.checks == 3


class SlowExecutor(FlakyExecutor):
    """20 ms a step, so that a long request stays in its slot while the test looks."""

    def execute(self, plan, interrupt=None):
        time.sleep(0.02)
        return super().execute(plan)


def test_requests_being_prepared_count_against_max_queue_once():
    eng = AsyncEngine(Engine(SchedulerConfig("batched", 1).build(), SlowExecutor(), max_model_len=64), max_queue=1)
    eng.start()

    async def scenario():
        running = await eng.submit([1, 2], SamplingParams(max_tokens=60, temperature=0))
        await running.__anext__()  # it holds the only slot
        with eng.reserve() as preparing:  # the one place in the queue, taken while (say) a grammar compiles
            with pytest.raises(QueueFullError):
                eng.reserve()
            with pytest.raises(QueueFullError):
                await eng.submit([3], SamplingParams(max_tokens=1, temperature=0))  # no reservation: checked
            waiting = await eng.submit([4], SamplingParams(max_tokens=1, temperature=0), reservation=preparing)
            counts = (eng.num_preparing, eng.num_truly_waiting)  # moved from preparing to waiting, counted once
        after = eng.num_preparing  # leaving the block releases nothing twice
        with pytest.raises(QueueFullError):
            eng.reserve()
        running.abort()
        tokens = [t async for out in waiting for t in out.token_ids]
        with eng.reserve():
            return counts, after, tokens, eng.num_preparing

    try:
        counts, after, tokens, preparing_again = asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        eng.stop()
    assert counts == (0, 1) and after == 0 and tokens == [7] and preparing_again == 1


def test_on_idle_runs_once_each_time_the_engine_runs_out_of_work():
    calls = []
    eng = AsyncEngine(Engine(SchedulerConfig("batched", 1).build(), FlakyExecutor(), max_model_len=64),
                      on_idle=lambda: calls.append(time.monotonic()))
    eng.start()
    try:
        time.sleep(0.6)
        assert calls == []  # never busy yet
        for turn in (1, 2):
            assert asyncio.run(asyncio.wait_for(_collect(eng, [1, 2, 3], 3), 10)) == [7, 7, 7]
            deadline = time.monotonic() + 5
            while len(calls) < turn and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.6)  # an idle engine waits on its queue without calling again
            assert len(calls) == turn
    finally:
        eng.stop()
