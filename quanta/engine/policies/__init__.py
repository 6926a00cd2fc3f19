"""Scheduling policies behind the :class:`~quanta.engine.scheduler.Scheduler` interface."""

from __future__ import annotations

from quanta.engine.policies.batched import BatchedScheduler
from quanta.engine.scheduler import Scheduler

#: ``--scheduler`` name -> (class, knobs it takes besides ``max_num_seqs``).
POLICIES: dict[str, tuple[type[Scheduler], tuple[str, ...]]] = {
    "batched": (BatchedScheduler, ("prefill_quantum", "mixed_prefill_quantum", "prefill_cap")),
}
