"""The scheduler's side of the KV block pool: each resident sequence's block
table, and the blocks a free slot keeps for the slot prefix cache.

A sequence is given the blocks of its whole prompt when it is admitted
(:meth:`SlotBlocks.can_hold` is the admission check) and one more block each
time its positions cross a block boundary (:meth:`SlotBlocks.grow`). When it
ends, the blocks of its prompt positions stay with its slot for the slot
prefix cache (:meth:`SlotBlocks.keep`) and the rest are freed; the next
sequence admitted into that slot takes over the blocks of the prefix it reuses
(:meth:`SlotBlocks.claim`). Blocks kept by free slots are *cached*: when the
free list runs short they are evicted, the least recently used slot first,
before anything running is touched.

Pure Python, no torch: the simulator can use it.
"""

from __future__ import annotations

from quanta.engine.block_pool import BlockPool
from quanta.engine.prefix_cache import SlotPrefixCache
from quanta.engine.sequence import Sequence


class SlotBlocks:
    """Block tables over ``pool`` for ``num_slots`` slots.

    Args:
        pool: the blocks.
        num_slots: the scheduler's slots (``max_num_seqs``).
        prefix_cache: the slot prefix cache whose slots keep blocks (None: a
            sequence's blocks are all freed when it ends).
    """

    def __init__(self, pool: BlockPool, num_slots: int, prefix_cache: SlotPrefixCache | None = None) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self._kept: list[list[int]] = [[] for _ in range(num_slots)]
        self._num_cached = 0

    @property
    def num_cached(self) -> int:
        """Blocks free slots keep for the prefix cache (evictable)."""
        return self._num_cached

    def can_hold(self, tokens: int) -> bool:
        """Whether ``tokens`` positions fit in the free and cached blocks together."""
        return self.pool.blocks_for(tokens) <= self.pool.num_free + self._num_cached

    def claim(self, seq: Sequence, slot: int, cached: int) -> None:
        """``seq`` enters ``slot`` reusing its first ``cached`` positions: it takes the slot's
        blocks that hold them; the slot's other blocks are freed."""
        kept = self._take(slot)
        n = self.pool.blocks_for(cached)
        seq.block_ids = kept[:n]
        self.pool.release(kept[n:])

    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Give ``seq`` blocks for ``tokens`` positions, evicting cached blocks if the free
        list is short. False (nothing taken) when even that is not enough."""
        need = self.pool.blocks_for(tokens) - len(seq.block_ids)
        if need <= 0:
            return True
        while self.pool.num_free < need and self._evict_one():
            pass
        if self.pool.num_free < need:
            return False
        seq.block_ids.extend(self.pool.allocate(need))
        return True

    def keep(self, seq: Sequence, slot: int, tokens: int) -> None:
        """``seq`` left ``slot``: the slot keeps the blocks of its first ``tokens`` positions
        (the prefix cache's), the others are freed."""
        n = self.pool.blocks_for(tokens)
        self._kept[slot] = seq.block_ids[:n]
        self._num_cached += len(self._kept[slot])
        self.pool.release(seq.block_ids[n:])
        seq.block_ids = []

    def drop(self, seq: Sequence) -> None:
        """Free every block of ``seq``."""
        self.pool.release(seq.block_ids)
        seq.block_ids = []

    def _take(self, slot: int) -> list[int]:
        kept, self._kept[slot] = self._kept[slot], []
        self._num_cached -= len(kept)
        return kept

    def _evict_one(self) -> bool:
        """Free the blocks of the least recently used slot that keeps any; False if none does."""
        slots = [s for s, kept in enumerate(self._kept) if kept]
        if not slots:
            return False
        slot = self.prefix_cache.least_recent(slots) if self.prefix_cache is not None else slots[0]
        self.pool.release(self._take(slot))
        if self.prefix_cache is not None:
            self.prefix_cache.forget(slot)
        return True
