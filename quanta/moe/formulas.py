"""Expert-activity arithmetic of a prefill chunk in an MoE layer.

Notation: E routed experts, K experts per token (top-k), a chunk of Q tokens.

- Tokens per expert (nominal, the seed study's x-axis): ``Q * K / E`` — the
  rows each expert would compute if all E were hit equally.
- Expected unique experts under random routing: each token picks K distinct
  experts uniformly, so an expert is missed by one token with probability
  ``1 - K/E`` and by all Q independent tokens with ``(1 - K/E)^Q``:
  ``E[unique] = E * (1 - (1 - K/E)^Q)`` (linearity of expectation over the E
  experts' indicator variables; the classic occupancy problem).
- Tokens per *active* expert: ``Q * K / unique`` — what the executor's
  statistics report; it tends to the nominal value once nearly every expert
  is hit.
- The quantum that reaches a target of T tokens per expert: ``Q = T * E / K``.
"""

from __future__ import annotations

import math


def tokens_per_expert(quantum: int, top_k: int, num_experts: int) -> float:
    """Nominal tokens per expert ``Q * K / E`` of a chunk of ``quantum`` tokens."""
    _check_shape(num_experts, top_k)
    return quantum * top_k / num_experts


def expected_unique_experts(quantum: int, top_k: int, num_experts: int) -> float:
    """``E * (1 - (1 - K/E)^Q)``: experts hit at least once by ``quantum`` randomly routed tokens."""
    _check_shape(num_experts, top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** quantum)


def quantum_for_target(target_tokens_per_expert: float, num_experts: int, top_k: int) -> float:
    """``T * E / K``: the (unrounded) chunk size that gives ``target`` tokens per expert."""
    _check_shape(num_experts, top_k)
    if target_tokens_per_expert <= 0:
        raise ValueError(f"the target tokens per expert must be positive, got {target_tokens_per_expert}")
    return target_tokens_per_expert * num_experts / top_k


def power_of_two_divisors(cap: int) -> list[int]:
    """Powers of two that divide ``cap``, ascending (4096 -> 1, 2, ..., 4096; 3072 -> 1, ..., 1024)."""
    if cap < 1:
        raise ValueError(f"the prefill cap must be a positive integer, got {cap}")
    largest = cap & -cap  # lowest set bit: the largest power of two dividing cap
    return [1 << j for j in range(largest.bit_length())]


def round_quantum(quantum: float, cap: int) -> int:
    """The power of two dividing ``cap`` nearest to ``quantum`` on a log2 scale (ties go up).

    A quantum that divides the cap never makes the batched scheduler split a
    chunk at a cap boundary. Values beyond the range clamp to its ends.
    """
    if quantum <= 0:
        raise ValueError(f"quantum must be positive, got {quantum}")
    candidates = power_of_two_divisors(cap)
    target = math.log2(quantum)
    return min(candidates, key=lambda c: (abs(math.log2(c) - target), -c))


def _check_shape(num_experts: int, top_k: int) -> None:
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
