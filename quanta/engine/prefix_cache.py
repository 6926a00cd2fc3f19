"""Prefix reuse over the slot KV cache: route a new prompt to the free slot
that already holds the longest common prefix of it (ds4-server, llama.cpp).

A slot's keys/values stay in the cache after its sequence leaves (they are
only overwritten by the next sequence admitted there), so a free slot still
holds the K/V of the tokens its last sequence computed. :class:`SlotPrefixCache`
remembers those token ids per slot. On admission the scheduler asks
:meth:`SlotPrefixCache.choose` for a slot among the free ones and starts the
sequence at the returned number of cached tokens: only the uncached tail is
prefilled, and every policy's chunking starts from there.

Slot choice, among the free slots:

1. A slot is *cheap* when reusing it throws away no more cached tokens than
   it reuses (``held - common <= common``); an empty slot is cheap. The
   continuation of a session (its previous context is a prefix of the new
   prompt) is cheap; a new session that only shares a system prompt with a
   long cached session is not, so that session's context survives.
2. Among cheap slots: the longest common prefix wins; ties go to the least
   recently used slot, then the lowest index.
3. With no cheap slot: the least recently used slot (its common prefix, if
   any, is still reused).

Reuse is salted: a slot remembers the ``cache_salt`` of the sequence whose
K/V it holds, and a prompt with another salt sees that slot as holding
nothing reusable (None matches only None, as vLLM's salted block hashes). A
client that cannot guess another's salt learns nothing about that client's
prompts from ``cached_tokens``; requests with different salts never share a
prefix, even a common system prompt (the price of isolation).

A slot remembers only the prompt positions of its last sequence. Generated
tokens' K/V come from the decode kernels (:mod:`quanta.model.linear`), which
differ from the prompt kernels in the last bits; a continuation that reused
them would see other numbers than the same prompt sent cold, and a greedy
answer could change with a cache hit. So a continuation recomputes the
previous answer as prompt (usually short beside the context it extends).

At least one prompt token is always left to compute, because the step that
computes a prompt's last token is the one that samples the first output
token: the reusable length is capped at ``len(prompt) - 1``.

Pure Python, no torch: schedulers stay torch-free and the simulator can use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq


def common_prefix_len(a: Seq[int], b: Seq[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    # compare in blocks first: contexts are long and mostly equal
    block = 256
    while i + block <= n and a[i:i + block] == b[i:i + block]:
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPrefixCache:
    """Token ids whose keys/values each slot holds, and the slot choice for a prompt.

    Args:
        num_slots: KV cache slots (= the scheduler's ``max_num_seqs``).

    Attributes:
        queries: prompt tokens looked up since start (tokens).
        hits: prompt tokens served from the cache since start (tokens).
    """

    def __init__(self, num_slots: int) -> None:
        self._held: list[list[int]] = [[] for _ in range(num_slots)]
        self._salt: list[str | None] = [None] * num_slots  # cache_salt of the held tokens
        self._last_used: list[int] = [0] * num_slots  # tick of the last admission/release
        self._ticks = itertools.count(1)
        self.queries = 0
        self.hits = 0

    def held(self, slot: int) -> list[int]:
        """Token ids whose K/V ``slot`` holds at positions ``0..len-1`` (a copy)."""
        return list(self._held[slot])

    def choose(self, free_slots: Seq[int], prompt: Seq[int], salt: str | None = None) -> tuple[int, int]:
        """The free slot for ``prompt`` and how many of its tokens are cached there.

        Counts the lookup in :attr:`queries` / :attr:`hits`.

        Args:
            free_slots: candidate slots (non-empty).
            prompt: the new sequence's prompt token ids (non-empty).
            salt: the request's ``cache_salt``; only slots holding tokens of the
                same salt can be reused.

        Returns:
            ``(slot, cached)`` with ``0 <= cached <= len(prompt) - 1`` tokens.
        """
        limit = len(prompt) - 1
        best: tuple | None = None
        lru: tuple | None = None
        for slot in free_slots:
            held = self._held[slot]
            common = min(common_prefix_len(held, prompt), limit) if self._salt[slot] == salt else 0
            age = (self._last_used[slot], slot)
            if lru is None or age < lru[0]:
                lru = (age, slot, common)
            if len(held) - common <= common:  # cheap: keeps at least as much as it throws away
                key = (-common, age)
                if best is None or key < best[0]:
                    best = (key, slot, common)
        _, slot, common = best if best is not None else lru
        self.queries += len(prompt)
        self.hits += common
        return slot, common

    def claim(self, slot: int, cached: int, salt: str | None = None) -> None:
        """``slot`` was given to a sequence (of ``cache_salt`` ``salt``) that keeps
        its first ``cached`` tokens; the rest will be overwritten."""
        del self._held[slot][cached:]
        self._salt[slot] = salt
        self._last_used[slot] = next(self._ticks)

    def forget(self, slot: int) -> None:
        """``slot``'s K/V were given up (its blocks evicted, or its sequence preempted)."""
        self._held[slot] = []

    def least_recent(self, slots: Seq[int]) -> int:
        """The least recently admitted-into or released of ``slots`` (ties: the lowest)."""
        return min(slots, key=lambda s: (self._last_used[s], s))

    def release(self, slot: int, computed: Seq[int]) -> None:
        """``slot`` was freed holding the K/V of ``computed`` (token ids from position 0)."""
        self._held[slot] = list(computed)
        self._last_used[slot] = next(self._ticks)
