"""Scheduling policies behind the :class:`~quanta.engine.scheduler.Scheduler` interface.

Each policy class declares the knobs it takes besides ``max_num_seqs`` in its
``knobs`` (:class:`~quanta.engine.policies.knobs.Knob`). See docs/POLICIES.md
for each policy's semantics, knobs and defaults.
"""

from __future__ import annotations

from quanta.engine.policies.batched import BatchedScheduler
from quanta.engine.policies.budget import BudgetScheduler
from quanta.engine.policies.chunked import ChunkedScheduler
from quanta.engine.policies.continuous import ContinuousScheduler
from quanta.engine.policies.knobs import Knob
from quanta.engine.policies.static import StaticScheduler
from quanta.engine.scheduler import Scheduler

#: ``--scheduler`` name -> policy class (its ``knobs`` are the knobs it takes).
POLICIES: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (BatchedScheduler, StaticScheduler, ContinuousScheduler, ChunkedScheduler, BudgetScheduler)
}

#: Every knob of every policy by name, in flag order (first policy first).
KNOBS: dict[str, Knob] = {k.name: k for cls in POLICIES.values() for k in cls.knobs}


def takers(knob: Knob) -> list[str]:
    """Names of the policies that take ``knob``, in :data:`POLICIES` order."""
    return [name for name, cls in POLICIES.items() if knob in cls.knobs]
