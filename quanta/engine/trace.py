"""The step trace: one record per executed step, the source of every latency figure.

Recording costs one small object per step (not per token), appended to a
bounded deque, so tracing stays on in production.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StepRecord:
    """One executed forward pass.

    Attributes:
        step: index of the step since the engine started (0-based).
        kind: ``prefill``, ``decode`` or ``mixed`` (a fused forward carrying both).
        start / end: engine-clock seconds (``time.monotonic`` on the real engine).
        seq_ids: sequences served, in token order.
        num_new_tokens: new tokens per sequence (same order).
        num_emitted: output tokens each sequence emitted (0 for a prefill chunk
            that leaves prompt tokens to compute, else 1).
        experts: MoE models only: expert activity of the step's forward pass
            (all its tokens are routed together), averaged over MoE layers:
            ``num_tokens``, ``unique_experts`` (experts hit at least once),
            ``tokens_per_expert`` (``num_tokens * top_k / unique_experts``),
            ``num_layers``, ``seconds`` (wall time of the MoE blocks, summed).
            None for dense models and fake executors.
        positions: tokens each sequence had computed before the step (same order): the
            context its rows attend over, a prompt's prefix-cache hit included. None in
            records written without it.
        arrivals: the requests the engine accepted since the previous record, each
            ``[seq_id, submitted, accepted, prompt_tokens]``: when the front handed it over
            (the HTTP request parsed, its prompt tokenized) and when the engine took it in,
            between steps (engine-clock seconds). None in records written without it.
    """

    step: int
    kind: str
    start: float
    end: float
    seq_ids: list[int]
    num_new_tokens: list[int]
    num_emitted: list[int]
    experts: dict | None = None
    positions: list[int] | None = None
    arrivals: list[list] | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


class Trace:
    """The last ``max_records`` step records plus running counters.

    Attributes:
        num_prefill_steps / num_decode_steps / num_mixed_steps: steps of each
            kind since the engine started (not bounded by ``max_records``).
    """

    def __init__(self, max_records: int = 100_000) -> None:
        self.records: deque[StepRecord] = deque(maxlen=max_records)
        self.counts = {"prefill": 0, "decode": 0, "mixed": 0}
        self._next_step = 0

    def record(self, kind: str, start: float, end: float, seq_ids: list[int], num_new_tokens: list[int],
               num_emitted: list[int], experts: dict | None = None, positions: list[int] | None = None,
               arrivals: list[list] | None = None) -> StepRecord:
        rec = StepRecord(self._next_step, kind, start, end, seq_ids, num_new_tokens, num_emitted, experts, positions,
                         arrivals)
        self._next_step += 1
        self.counts[kind] += 1
        self.records.append(rec)
        return rec

    @property
    def num_prefill_steps(self) -> int:
        return self.counts["prefill"]

    @property
    def num_decode_steps(self) -> int:
        return self.counts["decode"]

    @property
    def num_mixed_steps(self) -> int:
        return self.counts["mixed"]

    @property
    def next_step(self) -> int:
        """Index of the next step to be recorded."""
        return self._next_step

    def to_dicts(self, since_step: int = 0) -> list[dict]:
        """Records with ``step >= since_step`` as plain dicts (JSON-ready)."""
        return [asdict(r) for r in self.page(since_step, len(self.records))]

    def page(self, since_step: int, limit: int) -> list[StepRecord]:
        """At most ``limit`` records with ``step >= since_step``, oldest first; cost ~``limit``,
        not the trace's length (steps are consecutive, so the first one's index is computed).
        Safe from any thread: the deque is copied in one call."""
        records = list(self.records)
        if not records:
            return []
        start = max(0, since_step - records[0].step)
        return records[start:start + max(limit, 0)]
