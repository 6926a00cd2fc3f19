""":class:`CostModelExecutor`: runs a :class:`StepPlan` by advancing a virtual clock."""

from __future__ import annotations

import random
from collections.abc import Callable

from quanta.engine.executor import Executor, StepResult
from quanta.engine.scheduler import StepPlan
from quanta.sim.profile import Profile

#: the token every simulated sequence emits (the engine is built without EOS ids)
SIM_TOKEN = 7


class VirtualClock:
    """Seconds of simulated time; the engine's ``clock`` callable."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


class CostModelExecutor(Executor):
    """Same contract as :class:`~quanta.engine.model_executor.ModelExecutor`: one token per
    chunk, :data:`SIM_TOKEN` for a chunk that reaches the end of its sequence
    (prompt done or a decode), else None; the step takes
    :meth:`Profile.step_cost` seconds of the virtual ``clock`` (prefix-hit tokens of the
    sequences it runs for the first time included), times a factor
    drawn from ``profile.noise_factors(cost, steady)`` (seeded by ``seed``) when the profile has step noise;
    ``steady``: every chunk is a decode of a sequence past its first (its computed tokens beyond its prompt);
    and times ``profile.wake.factor`` when it starts after the engine idled (:class:`~quanta.sim.profile.Wake`).

    It charges exactly the plan's chunks: a prompt admitted past its cached
    prefix starts there, and a preempted sequence's tokens come back as chunks
    again. ``computed_tokens`` counts every token run, ``recomputed_tokens``
    those at positions the sequence had computed before (after a preemption).
    """

    def __init__(self, profile: Profile, clock: VirtualClock, seed: int = 0) -> None:
        self.profile, self.clock = profile, clock
        self.rng = random.Random(seed)
        self.computed_tokens = self.recomputed_tokens = 0
        self._reached: dict[int, int] = {}  # seq_id -> positions computed at least once
        self._last_end: float | None = None  # when the previous step ended (None: no step yet)

    def cost(self, plan: StepPlan) -> float:
        """Predicted seconds of ``plan`` (sequences not yet advanced)."""
        prefill = [(c.seq.num_computed_tokens, c.num_new_tokens) for c in plan.chunks if not c.is_decode]
        decode = [c.seq.num_computed_tokens for c in plan.chunks if c.is_decode]
        return self.profile.step_cost(prefill, decode, self.prefix_hit(plan))

    def prefix_hit(self, plan: StepPlan) -> int:
        """Prompt tokens taken from the prefix cache by the plan's sequences that run for the first time
        (a first prompt chunk that starts past 0)."""
        return sum(c.seq.num_computed_tokens for c in plan.chunks
                   if not c.is_decode and c.seq.seq_id not in self._reached)

    def execute(self, plan: StepPlan, interrupt: Callable[[], None] | None = None) -> StepResult:
        """Advance the virtual clock by the plan's predicted cost (``interrupt``: never called,
        a simulated step has no point inside it)."""
        cost = self.cost(plan)
        steady = all(c.is_decode and c.seq.num_computed_tokens > c.seq.num_prompt_tokens for c in plan.chunks)
        factors = self.profile.noise_factors(cost, steady)
        wake = self.profile.wake
        if wake is not None and wake.applies(None if self._last_end is None else self.clock.t - self._last_end):
            cost *= wake.factor
        self.clock.t += cost * (self.rng.choice(factors) if factors else 1.0)
        self._last_end = self.clock.t
        for c in plan.chunks:
            start, end = c.seq.num_computed_tokens, c.seq.num_computed_tokens + c.num_new_tokens
            reached = self._reached.get(c.seq.seq_id, 0)
            self.recomputed_tokens += max(0, min(reached, end) - start)
            self.computed_tokens += c.num_new_tokens
            self._reached[c.seq.seq_id] = max(reached, end)
        return StepResult([SIM_TOKEN if c.seq.num_computed_tokens + c.num_new_tokens >= c.seq.num_tokens else None
                           for c in plan.chunks])

    def release(self, seq_id: int) -> None:
        self._reached.pop(seq_id, None)
