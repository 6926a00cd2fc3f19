"""The scheduler's side of the KV block pool: each resident sequence's block
table, and prefix sharing across sequences (:mod:`quanta.engine.prefix_cache`).

A sequence is given its table when it is admitted (:meth:`BlockTables.can_hold`
is the admission check): the named blocks of the longest cached prefix of its
prompt, shared by reference, then new blocks for the rest of its tokens (its
prompt, and a preempted sequence's generated tokens too). Before each step
its chunk gets the blocks of its new positions (:meth:`BlockTables.grow`), and
the full prompt blocks its earlier steps computed are named
(:meth:`BlockTables.register`), so that later prompts share them. When it
ends or is preempted, its references are dropped (:meth:`BlockTables.release`);
named blocks stay cached. When the free list runs short, cached blocks no
sequence holds are evicted, least recently used first, before anything
running is touched.

Pure Python, no torch: the simulator can use it.
"""

from __future__ import annotations

from quanta.engine.block_pool import BlockPool
from quanta.engine.prefix_cache import PrefixCache, block_hashes
from quanta.engine.sequence import Sequence


class BlockTables:
    """Block tables over ``pool``, with prefix sharing when ``prefix_cache``."""

    def __init__(self, pool: BlockPool, prefix_cache: bool = True) -> None:
        self.pool = pool
        self.cache = PrefixCache(pool) if prefix_cache else None

    @property
    def num_cached(self) -> int:
        """Cached blocks no sequence holds (evictable)."""
        return self.cache.num_evictable if self.cache is not None else 0

    def can_hold(self, seq: Sequence) -> bool:
        """Whether a waiting ``seq``'s tokens fit: its cached prefix shared, the rest in free
        blocks and cached blocks that can be evicted."""
        hits = self._lookup(seq)
        spare = self.pool.num_free + self.num_cached - (self.cache.num_evictable_among(hits) if hits else 0)
        return self.pool.blocks_for(seq.num_tokens) - len(hits) <= spare

    def admit(self, seq: Sequence) -> None:
        """Give a waiting ``seq`` (that :meth:`can_hold`) its table; it starts past its cached prefix."""
        hits = self._lookup(seq)
        if self.cache is not None:
            self.cache.acquire(hits)
        seq.block_ids = list(hits)
        seq.num_named_blocks = len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.pool.block_size
        if not self.grow(seq, seq.num_tokens):
            raise AssertionError("admitted a sequence whose blocks do not fit (can_hold first)")

    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Give ``seq`` blocks for ``tokens`` positions, evicting cached blocks if the free
        list is short. False (nothing taken) when even that is not enough."""
        need = self.pool.blocks_for(tokens) - len(seq.block_ids)
        if need <= 0:
            return True
        while self.pool.num_free < need and self.cache is not None and self.cache.evict_one():
            pass
        if self.pool.num_free < need:
            return False
        seq.block_ids.extend(self.pool.allocate(need))
        return True

    def register(self, seq: Sequence) -> None:
        """Name the full prompt blocks ``seq`` has computed since the last call."""
        if self.cache is None:
            return
        full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.pool.block_size
        names = self._names(seq)
        for i in range(seq.num_named_blocks, full):
            self.cache.register(seq.block_ids[i], names[i])
        seq.num_named_blocks = max(seq.num_named_blocks, full)

    def release(self, seq: Sequence) -> None:
        """``seq`` leaves (ends, is cancelled or preempted): its computed prompt blocks are
        named, then its references dropped."""
        self.register(seq)
        blocks, seq.block_ids, seq.num_named_blocks = seq.block_ids, [], 0
        self.pool.release(blocks)
        if self.cache is not None:
            self.cache.released(blocks)

    def _names(self, seq: Sequence) -> list[bytes]:
        if seq.prompt_block_names is None:
            seq.prompt_block_names = block_hashes(seq.prompt_token_ids, self.pool.block_size, seq.params.cache_salt)
        return seq.prompt_block_names

    def _lookup(self, seq: Sequence) -> list[int]:
        return self.cache.lookup(self._names(seq), seq.num_prompt_tokens) if self.cache is not None else []
