"""``batched``: ds4-server's resident-session schedule (the default).

Every free slot is filled at once. Each cycle runs one batched decode step
for every decoding sequence, then one prefill quantum for the next prefilling
sequence in round-robin order, so concurrent prompts progress fairly and
finish together. The quantum is ``mixed_prefill_quantum`` while any sequence
is decoding, ``prefill_quantum`` while none is. A quantum that crosses a
multiple of ``prefill_cap`` positions runs as two chunks split at that
boundary, back to back (from position 1539 with quantum 2048 and cap 4096:
2048, 509, 1539, 2048, 509, 1539, ...).
"""

from __future__ import annotations

import itertools

from quanta.engine.policies.knobs import PREFILL_CAP, Knob
from quanta.engine.scheduler import ScheduledChunk, Scheduler, StepPlan, decode_plan, tokens_to_boundary
from quanta.engine.sequence import Sequence, SequenceStatus

PREFILL_QUANTUM = Knob("prefill_quantum", 2048, "tokens per prefill cycle while no sequence decodes", within_cap=True)
MIXED_PREFILL_QUANTUM = Knob("mixed_prefill_quantum", 2048, "tokens per prefill cycle while a sequence decodes",
                             within_cap=True, auto=True)


class BatchedScheduler(Scheduler):
    """Decode-first interleaving with a prefill quantum per cycle.

    Args:
        max_num_seqs: resident sessions (slots).
        prefill_quantum: tokens per cycle while nothing decodes.
        mixed_prefill_quantum: tokens per cycle while something decodes.
        prefill_cap: executor graph boundary, in positions; chunks never cross
            a multiple of it.

    Both quanta are at most ``prefill_cap``; :class:`~quanta.config.SchedulerConfig`
    checks the values against :attr:`knobs`.
    """

    name = "batched"
    knobs = (PREFILL_QUANTUM, MIXED_PREFILL_QUANTUM, PREFILL_CAP)

    def __init__(self, max_num_seqs: int, prefill_quantum: int, mixed_prefill_quantum: int, prefill_cap: int) -> None:
        super().__init__(max_num_seqs)
        self.prefill_quantum = prefill_quantum
        self.mixed_prefill_quantum = mixed_prefill_quantum
        self.prefill_cap = prefill_cap
        self._decode_due = True  # a cycle opens with its decode step
        self._split_rest: tuple[Sequence, int] | None = None
        self._admitted_at: dict[Sequence, int] = {}  # admission ordinal of each resident sequence
        self._ordinals = itertools.count()
        self._last_prefilled = -1  # admission ordinal of the sequence prefilled last

    def admit(self, count: int) -> list[Sequence]:
        admitted = super().admit(count)
        for seq in admitted:
            self._admitted_at[seq] = next(self._ordinals)
        return admitted

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        self._admitted_at.pop(seq, None)

    def schedule(self) -> StepPlan | None:
        self.admit(self.num_free_slots)
        if self._split_rest is not None:
            seq, rest = self._split_rest
            self._split_rest = None
            if seq.status is SequenceStatus.RUNNING:
                return StepPlan([ScheduledChunk(seq, rest)])
        decoding = self.decoding()
        if decoding and self._decode_due:
            self._decode_due = False
            return decode_plan(decoding)
        self._decode_due = True
        prefilling = self.prefilling()
        if prefilling:
            return self._prefill_quantum(prefilling, mixed=bool(decoding))
        return decode_plan(decoding) if decoding else None

    def _next_round_robin(self, prefilling: list[Sequence]) -> Sequence:
        """The prefilling sequence admitted after the one served last (even if
        that one has left since), wrapping around to the first."""
        later = [s for s in prefilling if self._admitted_at[s] > self._last_prefilled]
        return later[0] if later else prefilling[0]

    def _prefill_quantum(self, prefilling: list[Sequence], mixed: bool) -> StepPlan:
        seq = self._next_round_robin(prefilling)
        self._last_prefilled = self._admitted_at[seq]
        quantum = self.mixed_prefill_quantum if mixed else self.prefill_quantum
        size = min(quantum, seq.num_prompt_tokens_left)
        first = min(size, tokens_to_boundary(seq.num_computed_tokens, self.prefill_cap))
        if first < size:
            self._split_rest = (seq, size - first)
        return StepPlan([ScheduledChunk(seq, first)])
