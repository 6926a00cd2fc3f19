"""Scheduling policies behind the :class:`~quanta.engine.scheduler.Scheduler` interface.

See docs/POLICIES.md for each policy's semantics, knobs and defaults.
"""

from __future__ import annotations

from quanta.engine.policies.batched import BatchedScheduler
from quanta.engine.policies.budget import BudgetScheduler
from quanta.engine.policies.chunked import ChunkedScheduler
from quanta.engine.policies.continuous import ContinuousScheduler
from quanta.engine.policies.static import StaticScheduler
from quanta.engine.scheduler import Scheduler

#: ``--scheduler`` name -> (class, knobs it takes besides ``max_num_seqs``).
POLICIES: dict[str, tuple[type[Scheduler], tuple[str, ...]]] = {
    "batched": (BatchedScheduler, ("prefill_quantum", "mixed_prefill_quantum", "prefill_cap")),
    "static": (StaticScheduler, ()),
    "continuous": (ContinuousScheduler, ("admit_k",)),
    "chunked": (ChunkedScheduler, ("admit_k", "chunk", "prefill_cap")),
    "budget": (BudgetScheduler, ("max_num_batched_tokens",)),
}
