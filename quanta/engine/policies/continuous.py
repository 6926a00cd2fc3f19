"""``continuous``: refill free slots in whole-prompt prefill calls, gated by ``admit_k``.

Waiting requests are admitted when ``free_slots >= admit_k``, or when fewer
than ``admit_k`` requests wait (``0 < waiting < admit_k``) and there are free
slots for all of them. Admission fills every free slot it can (FIFO) and the
step prefills all admitted prompts whole, in one call; running sequences do
not decode in that step. Every other step decodes every running sequence.

``admit_k = 1`` refills as soon as one slot frees (Orca-style iteration-level
batching without fusion). ``admit_k = max_num_seqs`` with all requests
arriving at once reproduces ``static``: the batch drains completely before
the next one is admitted.
"""

from __future__ import annotations

from quanta.engine.policies.knobs import Knob
from quanta.engine.scheduler import Scheduler, StepPlan

ADMIT_K = Knob("admit_k", 1, "admit only when at least K slots are free",
               seqs_bound="at_most", seqs_reason="nothing would ever be admitted")


class ContinuousScheduler(Scheduler):
    """Whole-prompt prefill calls between decode steps, admission gated by free slots.

    Args:
        max_num_seqs: resident sequences (KV slots).
        admit_k: free slots (sequences) needed before admitting, 1..max_num_seqs
            (above it admission could never happen; :class:`~quanta.config.SchedulerConfig`
            checks the values against :attr:`knobs`).
    """

    name = "continuous"
    knobs = (ADMIT_K,)

    def __init__(self, max_num_seqs: int, admit_k: int) -> None:
        super().__init__(max_num_seqs)
        self.admit_k = admit_k

    def should_admit(self) -> bool:
        """True when waiting requests may be admitted now (see the module docstring)."""
        waiting, free = len(self.waiting), self.num_free_slots
        if waiting == 0:
            return False
        return free >= self.admit_k or (waiting < self.admit_k and free >= waiting)

    def schedule(self) -> StepPlan | None:
        if self.should_admit():
            self.admit(self.num_free_slots)
        return self.whole_prompts_or_decode()
