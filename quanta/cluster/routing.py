"""Routing policies: which of N replicas serves a request.

A :class:`Router` decides from the prompt's token ids and each replica's load
(:class:`ReplicaLoad`); the caller then dispatches and tells the router where
the prompt went (:meth:`Router.routed`). :meth:`Router.choose` changes no
state, so a caller may ask and then route elsewhere (say, when the chosen
replica is gone) and record that instead.

- ``prefix`` (:class:`PrefixRouter`): prefix affinity, as sglang-router's
  cache-aware policy. The router keeps, per replica, the names of the full
  ``block_size``-token blocks of the prompts routed to it: the chain hashes of
  :func:`quanta.engine.prefix_cache.block_hashes` (namespace None), so block
  ``i``'s name stands for every token up to its end, as the replicas' own
  prefix caches name blocks. A prompt goes to the replica of least cost:
  the prompt tokens it would compute (those past the run of the prompt's
  blocks it holds from the start) plus ``load_tokens`` for each request it
  has in flight (waiting or running; None, the default: the mean length of
  the prompts routed so far, so the price of a queued request follows the
  workload's own prompts), so a long shared prefix (a coding
  agent's system prompt and tools) draws sessions to the replica that holds
  it until that replica's queue outweighs computing the prefix again
  elsewhere; ties go to the least loaded of the tied. ``load_tokens = 0`` is
  pure affinity (the longest match wins whatever the load). Load bound: when
  the chosen replica has more than ``max_waiting`` requests waiting, the
  prompt goes to the least-loaded replica instead (sglang's balance
  threshold, in one number). Memory bound: at most ``max_blocks`` names per replica (default
  :data:`DEFAULT_MAX_BLOCKS`, about 2 million tokens of 32-token blocks, some
  20 MB of names per replica), least recently routed forgotten first; a
  prompt's blocks are touched last block first, so a prefix outlives its
  extensions and a match is always a run from block 0.
- ``least-loaded``: the replica with the fewest requests (waiting + running),
  then the fewest waiting, then the lowest index.
- ``round-robin``: the replica after the last one routed to (0 first).

The router sees what it routed, not what the replicas' caches still hold: a
replica that evicted a prefix still attracts it until the router forgets it
too. Pure Python; no Ray import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from quanta.engine.prefix_cache import block_hashes

#: names kept per replica by the prefix router (x 32 tokens a block: about 2M tokens)
DEFAULT_MAX_BLOCKS = 65_536
POLICIES = ("prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's queue: requests ``waiting`` to be scheduled and ``running`` (resident)."""

    waiting: int
    running: int


def front_loads(in_flight: Sequence[int], max_num_seqs: int) -> list[ReplicaLoad]:
    """Each replica's load as a front sees it: its requests in flight (routed, answer not yet ended),
    ``max_num_seqs`` of them running and the rest waiting. The front does not see a replica's scheduler,
    so a request queued behind a long prompt counts as running until ``max_num_seqs`` are in flight."""
    return [ReplicaLoad(waiting=max(0, n - max_num_seqs), running=min(n, max_num_seqs)) for n in in_flight]


class Router(Protocol):
    def choose(self, prompt_tokens: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        """The replica index for a prompt, given every replica's load (one entry per replica)."""
        ...

    def routed(self, replica: int, prompt_tokens: Sequence[int]) -> None:
        """Record that ``replica`` now serves (and will cache) this prompt."""
        ...


def least_loaded(loads: Sequence[ReplicaLoad], among: Sequence[int] | None = None) -> int:
    """The index (of ``among``, default all) with the fewest requests, then fewest waiting, then lowest."""
    candidates = range(len(loads)) if among is None else among
    return min(candidates, key=lambda i: (loads[i].waiting + loads[i].running, loads[i].waiting, i))


class LeastLoadedRouter:
    """The least-loaded replica, whatever the prompt."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def choose(self, prompt_tokens: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        _check_loads(loads, self.replicas)
        return least_loaded(loads)

    def routed(self, replica: int, prompt_tokens: Sequence[int]) -> None:
        pass


class RoundRobinRouter:
    """The replica after the last one routed to, whatever the prompt and the loads."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self._next = 0

    def choose(self, prompt_tokens: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        _check_loads(loads, self.replicas)
        return self._next

    def routed(self, replica: int, prompt_tokens: Sequence[int]) -> None:
        self._next = (replica + 1) % self.replicas


class PrefixRouter:
    """Prefix affinity with a load bound and a memory bound (see the module's docstring)."""

    def __init__(self, replicas: int, *, block_size: int = 32, max_waiting: int = 4,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, load_tokens: int | None = None) -> None:
        if block_size < 1 or max_waiting < 0 or max_blocks < 1 or (load_tokens is not None and load_tokens < 0):
            raise ValueError(f"need block_size >= 1, max_waiting >= 0, max_blocks >= 1, load_tokens >= 0; got "
                             f"{block_size}, {max_waiting}, {max_blocks}, {load_tokens}")
        self.replicas, self.block_size = replicas, block_size
        self.max_waiting, self.max_blocks, self.load_tokens = max_waiting, max_blocks, load_tokens
        self._held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]  # LRU first
        self._holders: dict[bytes, set[int]] = {}
        self._routed_tokens = self._routed_prompts = 0

    def held_blocks(self, replica: int) -> int:
        """Block names the router keeps for ``replica`` (at most ``max_blocks``)."""
        return len(self._held[replica])

    def depths(self, prompt_tokens: Sequence[int]) -> tuple[int, list[int]]:
        """The prompt's full blocks, and how many of them from its start each replica holds."""
        names = block_hashes(prompt_tokens, self.block_size, None)
        depth, alive = [0] * self.replicas, set(range(self.replicas))
        for k, name in enumerate(names):
            alive &= self._holders.get(name, set())
            if not alive:
                break
            for i in alive:
                depth[i] = k + 1
        return len(names), depth

    def choose(self, prompt_tokens: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        _check_loads(loads, self.replicas)
        blocks, depth = self.depths(prompt_tokens)
        price = self.load_price(prompt_tokens)
        cost = [(blocks - depth[i]) * self.block_size + price * (load.waiting + load.running)
                for i, load in enumerate(loads)]
        preferred = least_loaded(loads, [i for i, c in enumerate(cost) if c == min(cost)])
        if loads[preferred].waiting > self.max_waiting:
            return least_loaded(loads)
        return preferred

    def load_price(self, prompt_tokens: Sequence[int]) -> int:
        """Prompt tokens one request in flight is worth: ``load_tokens``, else the mean length of the
        prompts routed so far (this prompt's own length before any)."""
        if self.load_tokens is not None:
            return self.load_tokens
        if not self._routed_prompts:
            return len(prompt_tokens)
        return self._routed_tokens // self._routed_prompts

    def routed(self, replica: int, prompt_tokens: Sequence[int]) -> None:
        self._routed_tokens += len(prompt_tokens)
        self._routed_prompts += 1
        held = self._held[replica]
        for name in reversed(block_hashes(prompt_tokens, self.block_size, None)):
            if name in held:
                held.move_to_end(name)
            else:
                held[name] = None
                self._holders.setdefault(name, set()).add(replica)
        while len(held) > self.max_blocks:
            self._forget(replica, held.popitem(last=False)[0])

    def _forget(self, replica: int, name: bytes) -> None:
        holders = self._holders[name]
        holders.discard(replica)
        if not holders:
            del self._holders[name]


def _check_loads(loads: Sequence[ReplicaLoad], replicas: int) -> None:
    if len(loads) != replicas:
        raise ValueError(f"expected the loads of {replicas} replicas, got {len(loads)}")


def make_router(name: str, replicas: int, *, block_size: int = 32, max_waiting: int = 4,
                load_tokens: int | None = None) -> Router:
    """The router of policy ``name`` (one of :data:`POLICIES`) over ``replicas`` replicas.

    Raises:
        ValueError: an unknown policy name or fewer than one replica.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if name == "prefix":
        return PrefixRouter(replicas, block_size=block_size, max_waiting=max_waiting, load_tokens=load_tokens)
    if name == "least-loaded":
        return LeastLoadedRouter(replicas)
    if name == "round-robin":
        return RoundRobinRouter(replicas)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
