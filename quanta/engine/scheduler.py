"""The scheduler interface: which sequences run next, and how many new tokens each gets.

A scheduler knows nothing about torch, HTTP or wall clocks. The engine calls
:meth:`Scheduler.next_plan` for a :class:`StepPlan` (the policy's
:meth:`Scheduler.schedule`, with KV blocks found for it), has an executor run
it, advances the sequences, then reports finished ones with
:meth:`Scheduler.finish`. The same classes drive the real model and the simulator.

KV blocks (:meth:`Scheduler.use_blocks`; the policy tests, and the simulator
without its prefix cache, run without): a waiting sequence is admitted only
when the blocks of its tokens (its prompt, and a preempted sequence's
generated tokens) are cached (a shared prefix, :mod:`quanta.engine.prefix_cache`),
free, or evictable, and a step's chunks get the blocks their new positions
need before it runs. When the pool cannot give them, the most
recently admitted running sequence is *preempted* (vLLM V1's recompute
policy): its blocks are freed, and it goes back to the front of the waiting
queue with its tokens so far, to be prefilled again when it is readmitted.
Its generated tokens are recomputed one a step, as decode rows that sample
nothing, so their keys and values come from the decode kernels as they did
the first time and its answer does not change by a bit. With blocks to
spare nothing of this runs and every policy plans exactly as without them.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from quanta.engine.block_pool import BlockPool
from quanta.engine.kv_blocks import BlockTables
from quanta.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``seq`` starting at ``seq.num_computed_tokens``.

    ``is_decode`` is fixed when the chunk is planned (the sequence was past its
    prompt), so it stays true to what ran after the engine advances the sequence.
    """

    seq: Sequence
    num_new_tokens: int
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_decode = not self.seq.is_prefilling


@dataclass(slots=True)
class StepPlan:
    """One forward pass: the chunks it carries, in token order."""

    chunks: list[ScheduledChunk]

    @property
    def kind(self) -> str:
        """``decode`` (all chunks decode), ``prefill`` (none) or ``mixed`` (fused)."""
        decodes = sum(c.is_decode for c in self.chunks)
        if decodes == len(self.chunks):
            return "decode"
        return "prefill" if decodes == 0 else "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler(ABC):
    """Waiting queue, resident sequences and KV slots; policies add :meth:`schedule`.

    Args:
        max_num_seqs: resident sequences at most (= KV cache slots).

    Attributes:
        blocks: the sequences' KV block tables and the prefix cache when set
            (see :meth:`use_blocks`): admission starts a prompt past its
            longest cached prefix; None: blocks are not accounted for (every
            admitted prompt fits, and is computed whole). A sequence takes the
            lowest free slot either way.
        num_preemptions: sequences preempted for blocks since start.
    """

    name: ClassVar[str]

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs))
        self.blocks: BlockTables | None = None
        self.num_preemptions = 0

    def use_blocks(self, pool: BlockPool, prefix_cache: bool = True) -> BlockTables:
        """Account for KV blocks of ``pool``, sharing cached prefixes across sequences when
        ``prefix_cache`` (before any request is added)."""
        self.blocks = BlockTables(pool, prefix_cache)
        return self.blocks

    def next_plan(self) -> StepPlan | None:
        """The policy's next step with the KV blocks of its chunks found (:meth:`schedule`, then
        preemptions where the pool is short; see the module docstring)."""
        if self.blocks is not None:  # name the prompt blocks the last step completed, before admission looks them up
            for seq in self.running:
                self.blocks.register(seq)
        plan = self.schedule()
        if plan is None or self.blocks is None:
            return plan
        chunks = list(plan.chunks)
        for chunk in plan.chunks:
            seq = chunk.seq
            while seq.status is SequenceStatus.RUNNING and not self.blocks.grow(seq, seq.num_computed_tokens + chunk.num_new_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                chunks = [c for c in chunks if c.seq is not victim]
        return StepPlan(chunks) if chunks else None

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and slot and queue it first, to be recomputed."""
        self.running.remove(seq)
        heapq.heappush(self._free_slots, seq.slot)
        self.blocks.release(seq)
        seq.slot = None
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @abstractmethod
    def schedule(self) -> StepPlan | None:
        """The next step, or None when there is nothing to run."""

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FIFO)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its slot."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            heapq.heappush(self._free_slots, seq.slot)
            if self.blocks is not None:  # its computed prompt blocks stay cached
                self.blocks.release(seq)
            seq.slot = None
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def can_admit(self) -> bool:
        """Whether :meth:`admit` would admit the first waiting sequence now (a free slot,
        and the blocks of its tokens free or cached: its prompt, and a preempted
        sequence's generated tokens too, which it recomputes before it samples again)."""
        if not (self.waiting and self._free_slots):
            return False
        return self.blocks is None or self.blocks.can_hold(self.waiting[0])

    def admit(self, count: int) -> list[Sequence]:
        """Move up to ``count`` waiting sequences (FIFO) into free slots, while
        :meth:`can_admit` (a first sequence whose prompt's blocks do not fit waits,
        and those behind it with it).

        Each takes the lowest free slot and, with blocks, its table; with the
        prefix cache it starts with its cached tokens computed (``num_cached_tokens``).
        """
        admitted = []
        while len(admitted) < count and self.can_admit():
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self._free_slots)
            if self.blocks is not None:
                self.blocks.admit(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def whole_prompts_or_decode(self) -> StepPlan | None:
        """Every prefilling sequence's whole remaining prompt in one call, else one decode step."""
        prefilling = self.prefilling()
        if prefilling:
            return StepPlan([ScheduledChunk(s, s.num_prompt_tokens_left) for s in prefilling])
        decoding = self.decoding()
        return decode_plan(decoding) if decoding else None

    def decoding(self) -> list[Sequence]:
        """Resident sequences past their prompt."""
        return [s for s in self.running if not s.is_prefilling]

    def prefilling(self) -> list[Sequence]:
        """Resident sequences with prompt tokens left."""
        return [s for s in self.running if s.is_prefilling]


def decode_plan(seqs: list[Sequence]) -> StepPlan:
    """One decode step: a token for each of ``seqs``."""
    return StepPlan([ScheduledChunk(s, 1) for s in seqs])


def tokens_to_boundary(position: int, cap: int) -> int:
    """Positions from ``position`` up to the next multiple of ``cap`` (1..cap)."""
    return cap - position % cap
