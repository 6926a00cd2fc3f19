"""The simulated engine's KV block pool: the budget ``quanta serve`` would give it, and what it did.

The scheduler, block tables and prefix cache are the engine's own
(:mod:`quanta.engine.kv_blocks`); this module only decides how many blocks
they get and reads back what happened.

Budget (:func:`pool_from_flags`), from the flags ``quanta serve`` takes:

- ``--kv-cache-tokens N``: ``ceil(N / block_size)`` blocks;
- ``--kv-cache-memory BYTES``: ``BYTES // bytes per block``, with the bytes per
  block from the cost profile's KV geometry (its ``kv`` block: layers, KV
  heads, head dim and the dtype ``--kv-cache-dtype auto`` chose on the
  measured machine; ``quanta profile-engine`` writes it) and
  ``--kv-cache-dtype``;
- neither, with ``--max-model-len``: ``max_num_seqs`` sequences of that
  length (``quanta serve``'s default; its cap at half the physical memory of
  the serving machine is not applied: give ``--kv-cache-memory`` to model it);
- neither: a pool that never runs short (every sequence fits).

As in the engine, a budget must hold one sequence of ``--max-model-len``
(:func:`quanta.engine.kv_budget.num_blocks`); without ``--max-model-len`` the
simulated engine's length limit is the pool's size, so any request it
accepts fits alone. A :func:`pool_from_applied` pool is exactly the one a
measured server reported (``/v1/config``).

:class:`PoolStats` is what a run reports under ``kv_pool``: the pool,
preemptions, the peak of blocks held by running sequences (and with the
prefix cache's blocks), prompt tokens served from the cache and tokens
computed again after a preemption.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from quanta.config import DEFAULT_BLOCK_SIZE
from quanta.engine.block_pool import BlockPool, blocks_for
from quanta.engine.kv_budget import num_blocks
from quanta.sim.profile import Profile, kv_geometry

#: the simulated engine's length limit when nothing bounds it (tokens)
UNBOUNDED_LEN = 1 << 20


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The simulated pool: ``num_blocks`` of ``block_size`` positions (None: never short), prefix
    sharing on or off, and the engine's ``max_model_len`` (None: :data:`UNBOUNDED_LEN`)."""

    num_blocks: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_cache: bool = True
    max_model_len: int | None = None

    @property
    def model_len(self) -> int:
        """The length limit of the simulated engine (prompt plus output tokens)."""
        return self.max_model_len or UNBOUNDED_LEN

    def build(self, max_num_seqs: int) -> BlockPool:
        """The engine's :class:`BlockPool` for this budget (unbounded: every slot holds a longest sequence)."""
        blocks = self.num_blocks or max_num_seqs * blocks_for(self.model_len, self.block_size)
        return BlockPool(blocks, self.block_size)


def block_bytes(kv: dict, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block (keys and values of every layer) for geometry ``kv``; ``auto``: the profile's dtype."""
    from quanta.model.attention import bytes_per_block  # torch: only for a budget in bytes

    dtype = kv["dtype"] if kv_cache_dtype == "auto" else kv_cache_dtype
    return bytes_per_block(kv["num_layers"], kv["num_kv_heads"], block_size, kv["head_dim"], dtype)


def pool_from_flags(profile: Profile, max_num_seqs: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
                    kv_cache_memory: int | None = None, kv_cache_tokens: int | None = None,
                    kv_cache_dtype: str = "auto", max_model_len: int | None = None,
                    prefix_cache: bool = True) -> PoolSpec:
    """The pool ``quanta serve`` would build from these flags (module docstring).

    Raises:
        ValueError: both budgets, ``--kv-cache-memory`` with a profile that has no KV geometry, or a
            budget that does not hold one ``max_model_len`` sequence
            (:class:`~quanta.engine.kv_budget.KVBudgetError`).
    """
    if kv_cache_memory is not None and kv_cache_tokens is not None:
        raise ValueError("give --kv-cache-memory or --kv-cache-tokens, not both")
    if kv_cache_memory is None and kv_cache_tokens is None:
        blocks = max_num_seqs * blocks_for(max_model_len, block_size) if max_model_len else None
        return PoolSpec(blocks, block_size, prefix_cache, max_model_len)
    size = 1
    if kv_cache_memory is not None:
        kv = kv_geometry(profile)
        if kv is None:
            raise ValueError("--kv-cache-memory needs the cost profile's KV geometry (its 'kv' block, which quanta "
                             "profile-engine writes); give --kv-cache-tokens instead")
        size = block_bytes(kv, block_size, kv_cache_dtype)
    blocks = num_blocks(size, block_size, max_model_len or block_size, max_num_seqs, kv_cache_memory, kv_cache_tokens)
    return PoolSpec(blocks, block_size, prefix_cache, max_model_len or blocks * block_size)


def pool_from_applied(applied: dict | None) -> PoolSpec | None:
    """The pool a quanta server reported running (``/v1/config`` as ``quanta bench`` records it), or None
    when it reported none (a server from before the block pool, or not quanta)."""
    if not applied or not isinstance(applied.get("kv_cache_blocks"), int):
        return None
    return PoolSpec(applied["kv_cache_blocks"], int(applied.get("block_size", DEFAULT_BLOCK_SIZE)),
                    bool(applied.get("prefix_cache", True)), applied.get("max_model_len"))


@dataclass(slots=True)
class PoolStats:
    """What the pool did in one run (a run dict's ``kv_pool``).

    Attributes:
        blocks / block_size / prefix_cache / max_model_len: the pool (``bounded``: a budget was given).
        preemptions: sequences preempted for blocks (and recomputed).
        peak_blocks: most blocks held by running sequences after any step.
        peak_blocks_with_cache: the same, plus cached prefix blocks no sequence held.
        prompt_tokens / cached_tokens: prompt tokens of the finished requests, and those of them served
            from the prefix cache (the ``cached_tokens`` of their usage).
        prefix_hit_share: ``cached_tokens / prompt_tokens`` (None without prompt tokens).
        computed_tokens: tokens the simulated executor computed (and the cost model charged).
        recomputed_tokens: of those, positions a sequence had computed before (after a preemption).
    """

    blocks: int
    block_size: int
    bounded: bool
    prefix_cache: bool
    max_model_len: int
    preemptions: int = 0
    peak_blocks: int = 0
    peak_blocks_with_cache: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefix_hit_share: float | None = None
    computed_tokens: int = 0
    recomputed_tokens: int = 0

    def observe(self, pool: BlockPool, num_cached: int) -> None:
        """Note the pool's occupancy after a step (``num_cached``: cached blocks no sequence holds)."""
        self.peak_blocks = max(self.peak_blocks, pool.num_used - num_cached)
        self.peak_blocks_with_cache = max(self.peak_blocks_with_cache, pool.num_used)

    def to_dict(self) -> dict:
        return asdict(self)


def markdown_section(doc: dict) -> str:
    """The simulate report's KV pool table: one row per condition, medians over repeats ('' without pools)."""
    from statistics import median

    rows = ["| condition | pool blocks x size | peak blocks held (with cache) | preemptions | recomputed tokens | "
            "prefix-hit share |", "|---|---|---|---|---|---|"]
    for c in doc.get("conditions", []):
        pools = [r["kv_pool"] for r in c.get("runs", []) if r.get("kv_pool")]
        if not pools:
            continue
        p = pools[0]
        med = lambda k, pools=pools: median(x[k] for x in pools)  # noqa: E731
        shares = [x["prefix_hit_share"] for x in pools if x["prefix_hit_share"] is not None]
        size = f"{p['blocks']} x {p['block_size']}" if p["bounded"] else "unbounded"
        share = f"{median(shares):.1%}" if shares and p["prefix_cache"] else "off" if not p["prefix_cache"] else "n/a"
        rows.append(f"| {c['name']} | {size} | {med('peak_blocks'):g} ({med('peak_blocks_with_cache'):g}) | "
                    f"{med('preemptions'):g} | {med('recomputed_tokens'):g} | {share} |")
    return "\n".join(rows) if len(rows) > 2 else ""
