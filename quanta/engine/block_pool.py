"""The KV block pool's bookkeeping: which blocks are free, and how many holders each other block has.

The executor's :class:`~quanta.model.attention.KVCache` holds the blocks'
contents; this module only counts them, in pure Python (no torch), so the
schedulers and the simulator can use it. A block is *free* (on the free list,
no holder), or *held* by one or more sequences or cache entries (its reference
count). :meth:`BlockPool.allocate` takes blocks off the free list, oldest
freed first; :meth:`BlockPool.release` drops one reference from each block
and returns those left without holders to the free list.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` positions."""
    return -(-tokens // block_size)


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` positions.

    Raises:
        ValueError: no blocks, or a block size that is not a positive multiple of 8.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        if block_size < 8 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with at least one holder."""
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return blocks_for(tokens, self.block_size)

    def refs(self, block: int) -> int:
        """Holders of ``block`` (0: free)."""
        return self._refs[block]

    def allocate(self, count: int) -> list[int]:
        """``count`` free blocks, each with one holder.

        Raises:
            MemoryError: fewer than ``count`` blocks are free (nothing is taken).
        """
        if count > len(self._free):
            raise MemoryError(f"{count} KV blocks wanted, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, block: int) -> None:
        """One more holder of a held ``block``."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is free: it cannot be shared")
        self._refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one holder of each of ``blocks``; those left without holders become free."""
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"block {b} released more often than it was held")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
