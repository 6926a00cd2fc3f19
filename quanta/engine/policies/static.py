"""``static``: fixed batches (the seed study's baseline, no continuous batching).

A batch is admitted only when every slot is empty: up to ``max_num_seqs``
waiting requests, prefilled together in one call (one :class:`StepPlan`
carrying every admitted prompt whole). The batch then decodes, one token per
sequence per step, until all of its sequences have finished; slots freed
early stay empty meanwhile. No knobs.
"""

from __future__ import annotations

from quanta.engine.scheduler import Scheduler, StepPlan


class StaticScheduler(Scheduler):
    """Admit a whole batch into an empty engine, prefill it in one call, drain it.

    Args:
        max_num_seqs: batch size at most (sequences = KV slots).
    """

    name = "static"
    knobs = ()

    def schedule(self) -> StepPlan | None:
        if not self.running:
            self.admit(self.num_free_slots)
        return self.whole_prompts_or_decode()
