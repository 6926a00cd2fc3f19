"""``budget``: fused mixed batches under a per-step token budget (vLLM v1 / Sarathi-Serve).

Every step is one forward pass carrying, first, one token for every decoding
sequence (decodes are never starved), then prefill chunks in FCFS order:
resident sequences still prefilling (in admission order), then waiting
requests admitted into free slots, each taking ``min(prompt tokens left,
budget left)`` until ``max_num_batched_tokens`` tokens are planned. A step
never carries more than ``max_num_batched_tokens`` tokens. The step's kind is
``mixed`` when it carries both decodes and prefill chunks.

This is the "stall-free batching" of Sarathi-Serve (Agrawal et al., OSDI 2024)
and vLLM's chunked-prefill scheduler, whose budget knob has the same name;
512 tokens was vLLM's chunked-prefill default budget.

``max_num_batched_tokens >= max_num_seqs`` is required (checked by
:class:`~quanta.config.SchedulerConfig`), so all decodes always fit
and at least one token is left for each resident prefilling sequence.
"""

from __future__ import annotations

from quanta.engine.policies.knobs import Knob
from quanta.engine.scheduler import ScheduledChunk, Scheduler, StepPlan

MAX_NUM_BATCHED_TOKENS = Knob("max_num_batched_tokens", 512, "tokens per fused step, decodes first",
                              seqs_bound="at_least", seqs_reason="a step must fit one decode token per resident sequence")


class BudgetScheduler(Scheduler):
    """Decodes first, then FCFS prefill chunks, at most a token budget per step.

    Args:
        max_num_seqs: resident sequences (KV slots).
        max_num_batched_tokens: tokens per step at most, >= max_num_seqs.
    """

    name = "budget"
    knobs = (MAX_NUM_BATCHED_TOKENS,)

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        super().__init__(max_num_seqs)
        self.max_num_batched_tokens = max_num_batched_tokens

    def schedule(self) -> StepPlan | None:
        chunks = [ScheduledChunk(s, 1) for s in self.decoding()]
        budget = self.max_num_batched_tokens - len(chunks)
        queue = self.prefilling()  # admission order; all but the last were completed before
        while budget > 0 and (queue or self.can_admit()):
            seq = queue.pop(0) if queue else self.admit(1)[0]
            n = min(seq.num_prompt_tokens_left, budget)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return StepPlan(chunks) if chunks else None
