"""How many KV blocks the pool gets: one budget, in bytes (``--kv-cache-memory``)
or in tokens (``--kv-cache-tokens``), as vLLM and llama.cpp name it.

Without either, the pool holds what ``max_num_seqs`` sequences of
``max_model_len`` tokens need (what the slot cache reserved), capped at
:data:`DEFAULT_MEMORY_FRACTION` of the machine's memory. Either way it must
hold one sequence of ``max_model_len`` tokens. Torch-free: the CLI parses the
flags with :func:`parse_bytes` before any model loads.
"""

from __future__ import annotations

import os
import re

from quanta.engine.block_pool import blocks_for

#: the default pool's cap, a fraction of physical memory (the weights, torch and
#: the rest of the process need the remainder)
DEFAULT_MEMORY_FRACTION = 0.5

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1.5GB``, ``4G`` or a plain number of bytes -> bytes (K/M/G/T and
    kB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB powers of 2).

    Raises:
        ValueError: not a positive size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 4000000000)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"the size must be positive, got {text!r}")
    return value


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps the number at least 1: ``1.00 GiB``, ``32.0 KiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{n} B"


class KVBudgetError(ValueError):
    """The KV budget does not hold one sequence of ``max_model_len`` tokens."""


def physical_memory() -> int | None:
    """Bytes of physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def num_blocks(block_bytes: int, block_size: int, max_model_len: int, max_num_seqs: int,
               memory: int | None = None, tokens: int | None = None, memory_limit: int | None = None) -> int:
    """Blocks of the pool for a budget of ``memory`` bytes or ``tokens`` tokens (at most one
    given; neither: the default of the module docstring). ``memory_limit``: bytes the pool may
    not exceed (the machine's memory where the pool is allocated, of which the default pool takes
    at most :data:`DEFAULT_MEMORY_FRACTION`; None: no limit, as when a simulation sizes another
    machine's pool).

    Raises:
        KVBudgetError: the budget does not hold one sequence of ``max_model_len`` tokens, or
            exceeds ``memory_limit``.
    """
    one_sequence = blocks_for(max_model_len, block_size)
    if tokens is not None:
        blocks, what = blocks_for(tokens, block_size), f"--kv-cache-tokens {tokens}"
    elif memory is not None:
        blocks, what = memory // block_bytes, f"--kv-cache-memory {memory} bytes"
    else:
        blocks, what = max_num_seqs * one_sequence, f"one sequence of --max-model-len {max_model_len}"
        total = physical_memory() if memory_limit is None else memory_limit
        if total is not None:
            blocks = max(min(blocks, int(total * DEFAULT_MEMORY_FRACTION) // block_bytes), one_sequence)
    if blocks < one_sequence:
        raise KVBudgetError(f"{what} holds {blocks * block_size} tokens of KV cache; one sequence of --max-model-len "
                         f"{max_model_len} needs {one_sequence * block_size} ({one_sequence * block_bytes} bytes)")
    if memory_limit is not None and blocks * block_bytes > memory_limit:
        raise KVBudgetError(f"{what} needs {format_bytes(blocks * block_bytes)} of KV cache, more than this machine's "
                         f"memory ({format_bytes(memory_limit)})")
    return blocks
