"""``chunked``: ``continuous`` admission, prompts prefilled ``chunk`` tokens at a time.

Admission follows :class:`~quanta.engine.policies.continuous.ContinuousScheduler`
(``admit_k``), with one restriction: no request is admitted while a chunked
prefill group is in progress (any resident sequence still has prompt tokens
left). The admitted group is prefilled together: each prefill call is one
:class:`StepPlan` carrying, for every still-prefilling sequence of the group,
a chunk of ``min(chunk, prompt tokens left)`` tokens, shortened further so
that it never crosses a multiple of ``prefill_cap`` positions (the next chunk
starts at that boundary). A 64-token prompt with ``chunk = 8`` takes 8 calls.

Between two consecutive prefill calls there is exactly one decode step of the
decoding sequences (one token each) when any sequence is decoding, else none;
this also holds across groups, so decodes are never starved. Sequences of a
group whose prompt is done join those decode steps.
"""

from __future__ import annotations

from quanta.engine.policies.continuous import ADMIT_K, ContinuousScheduler
from quanta.engine.policies.knobs import PREFILL_CAP, Knob
from quanta.engine.scheduler import ScheduledChunk, StepPlan, decode_plan, tokens_to_boundary
from quanta.engine.sequence import Sequence

CHUNK = Knob("chunk", 512, "prompt tokens per sequence per prefill call", within_cap=True)


class ChunkedScheduler(ContinuousScheduler):
    """Group-wise chunked prefill alternating with decode steps.

    Args:
        max_num_seqs: resident sequences (KV slots).
        admit_k: free slots (sequences) needed before admitting, 1..max_num_seqs.
        chunk: prompt tokens per sequence per prefill call, <= prefill_cap.
        prefill_cap: executor graph boundary, in positions; chunks never cross
            a multiple of it.

    :class:`~quanta.config.SchedulerConfig` checks the values against :attr:`knobs`.
    """

    name = "chunked"
    knobs = (ADMIT_K, CHUNK, PREFILL_CAP)

    def __init__(self, max_num_seqs: int, admit_k: int, chunk: int, prefill_cap: int) -> None:
        super().__init__(max_num_seqs, admit_k)
        self.chunk = chunk
        self.prefill_cap = prefill_cap
        self._decode_due = False  # True right after a prefill call

    def schedule(self) -> StepPlan | None:
        decoding = self.decoding()
        if decoding and self._decode_due:
            self._decode_due = False
            return decode_plan(decoding)
        prefilling = self.prefilling()
        if not prefilling and self.should_admit():
            prefilling = self.admit(self.num_free_slots)
        if prefilling:
            self._decode_due = True
            return StepPlan([ScheduledChunk(s, self._chunk_size(s)) for s in prefilling])
        return decode_plan(decoding) if decoding else None

    def _chunk_size(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s prompt in its next chunk (1..chunk)."""
        to_cap = tokens_to_boundary(seq.num_computed_tokens, self.prefill_cap)
        return min(self.chunk, seq.num_prompt_tokens_left, to_cap)
