"""Prefix sharing over the KV block pool: full blocks of prompt tokens, found
by a chain hash, shared by reference across sequences (vLLM's automatic
prefix caching).

Block ``i`` of a prompt is named by ``hash(name of block i - 1, its tokens)``,
block 0's parent being the *namespace*: the request's ``cache_salt``, which
the server rewrites as ``tenant:<sha256 of the API key>[/<cache_salt>]``
with ``--api-key`` (:func:`quanta.server.serving.tenant_salt`). A name
therefore stands for the block's tokens, every token before them and the
namespace: two prompts share block ``i`` only if they agree on everything up
to its end and come from the same namespace (None is a namespace of its own,
distinct from every string). SHA-256, so that no client can craft a collision
with another's prompt.

Only *full* blocks of *prompt* positions are named (:meth:`PrefixCache.register`,
as a sequence's prefill completes them): generated tokens' K/V come from the
decode kernels, which differ from the prompt kernels in the last bits, and a
continuation that reused them would see other numbers than the same prompt
sent cold. A continuation recomputes the previous answer as prompt (usually
short beside the context it extends), then its blocks are named too.

A named block stays after its sequences end: the cache holds a reference on
it. Blocks whose only holder is the cache are *evictable*, least recently
used first (:meth:`PrefixCache.evict_one`), when a sequence needs a block
and none is free. A new prompt (:meth:`PrefixCache.lookup`) reuses the
longest run of named blocks from its start, at most ``(len - 1) //
block_size`` of them: the step that computes a prompt's last token samples
the first output token, so one token at least is computed.

Pure Python, no torch: schedulers stay torch-free and the simulator can use it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

from quanta.engine.block_pool import BlockPool


def namespace_hash(salt: str | None) -> bytes:
    """The parent name of a prompt's first block in namespace ``salt``."""
    return hashlib.sha256(b"\x00" if salt is None else b"\x01" + salt.encode()).digest()


def block_hashes(tokens: Seq[int], block_size: int, salt: str | None) -> list[bytes]:
    """The chain names of the full blocks of ``tokens`` in namespace ``salt``."""
    names, parent = [], namespace_hash(salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", tokens[start:start + block_size]).tobytes()).digest()
        names.append(parent)
    return names


class PrefixCache:
    """Named blocks of ``pool`` and their least-recently-used order."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named blocks only the cache holds, LRU first

    @property
    def num_evictable(self) -> int:
        """Named blocks no sequence holds (evictable)."""
        return len(self._evictable)

    def lookup(self, names: Seq[bytes], prompt_len: int) -> list[int]:
        """The named blocks of the longest reusable prefix of a prompt of ``prompt_len`` tokens
        whose full blocks are ``names`` (at most ``(prompt_len - 1) // block_size``)."""
        found = []
        for name in names[:(prompt_len - 1) // self.pool.block_size]:
            block = self._block_of.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def num_evictable_among(self, blocks: Seq[int]) -> int:
        """How many of ``blocks`` are evictable now."""
        return sum(b in self._evictable for b in blocks)

    def acquire(self, blocks: Seq[int]) -> None:
        """A sequence takes ``blocks`` (from :meth:`lookup`) by reference."""
        for b in blocks:
            self.pool.share(b)
            self._evictable.pop(b, None)

    def register(self, block: int, name: bytes) -> None:
        """``block`` (held by a sequence) now holds the prompt block named ``name``. A name
        already given to another block keeps that block (this one stays private)."""
        if name not in self._block_of:
            self.pool.share(block)
            self._block_of[name] = block
            self._name_of[block] = name

    def released(self, blocks: Seq[int]) -> None:
        """A sequence gave up its references to ``blocks``: those named and now held by the
        cache alone become evictable, as the most recently used."""
        for b in blocks:
            if b in self._name_of and self.pool.refs(b) == 1:
                self._evictable[b] = None
                self._evictable.move_to_end(b)

    def evict_one(self) -> bool:
        """Forget the least recently used evictable block and free it; False if there is none."""
        if not self._evictable:
            return False
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._name_of.pop(block)]
        self.pool.release([block])
        return True
