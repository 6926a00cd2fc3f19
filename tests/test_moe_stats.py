"""Expert-activity formulas and the per-step expert statistics.

Formulas are checked against exact enumeration and Monte Carlo; the
statistics the MoE blocks record are checked against a brute-force count on a
fixed routing, and end to end through the executor, the trace and /metrics.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from quanta.model.config import ModelConfig
from quanta.model.moe import MoEBlock, expert_stats
from quanta.moe import formulas


def routing_stats(expert_ids: list[list[int]]) -> tuple[int, float]:
    """Brute-force ``(unique experts, tokens per active expert)`` of one layer's routing.

    Args:
        expert_ids: for each token, the K expert ids it was routed to.
    """
    unique = len({e for ids in expert_ids for e in ids})
    routed = sum(len(ids) for ids in expert_ids)
    return unique, (routed / unique if unique else 0.0)


def test_tokens_per_expert_and_quantum_for_target_are_inverse():
    assert formulas.tokens_per_expert(2048, 6, 256) == 48.0
    assert formulas.quantum_for_target(48, 256, 6) == 2048.0
    assert formulas.tokens_per_expert(256, 2, 8) == 64.0
    for q in (1, 100, 4096):
        assert formulas.quantum_for_target(formulas.tokens_per_expert(q, 8, 128), 128, 8) == pytest.approx(q)


def _exact_expected_unique(e: int, k: int, q: int) -> float:
    """Mean number of distinct experts over every equally likely routing (each token: a K-subset of E)."""
    subsets = list(itertools.combinations(range(e), k))
    total = sum(len(set().union(*choice)) for choice in itertools.product(subsets, repeat=q))
    return total / len(subsets) ** q


@pytest.mark.parametrize("e,k,q", [(5, 2, 3), (4, 1, 4), (6, 3, 2), (3, 3, 2)])
def test_expected_unique_experts_equals_exact_enumeration(e, k, q):
    assert formulas.expected_unique_experts(q, k, e) == pytest.approx(_exact_expected_unique(e, k, q), rel=1e-12)


def test_expected_unique_experts_edges_and_seed_shape():
    assert formulas.expected_unique_experts(0, 6, 256) == 0
    assert formulas.expected_unique_experts(1, 6, 256) == pytest.approx(6)
    assert formulas.expected_unique_experts(128, 6, 256) == pytest.approx(256 * (1 - (250 / 256) ** 128))
    assert formulas.expected_unique_experts(128, 6, 256) > 240  # a small chunk already wakes ~95% of experts
    assert formulas.expected_unique_experts(100_000, 6, 256) == pytest.approx(256)
    with pytest.raises(ValueError):
        formulas.expected_unique_experts(10, 7, 6)


def test_monte_carlo_random_routing_matches_the_formula():
    gen = torch.Generator().manual_seed(0)
    e, k = 256, 6
    for q in (16, 128, 512):
        counts = []
        for _ in range(40):
            ids = torch.rand(q, e, generator=gen).topk(k, dim=1).indices
            counts.append(routing_stats(ids.tolist())[0])
        assert sum(counts) / len(counts) == pytest.approx(formulas.expected_unique_experts(q, k, e), rel=0.02)


def test_power_of_two_divisors_and_rounding():
    assert formulas.power_of_two_divisors(4096) == [2**i for i in range(13)]
    assert formulas.power_of_two_divisors(3072) == [2**i for i in range(11)]
    assert formulas.power_of_two_divisors(1) == [1]
    assert formulas.round_quantum(2048, 4096) == 2048
    assert formulas.round_quantum(192, 4096) == 256  # log2 7.58 -> 8
    assert formulas.round_quantum(768, 4096) == 1024  # log2 9.58 -> 10
    assert formulas.round_quantum(700, 4096) == 512  # log2 9.45 -> 9
    assert formulas.round_quantum(2 ** 8.5, 4096) == 512  # a tie goes up
    assert formulas.round_quantum(8192, 4096) == 4096  # clamped to the cap
    assert formulas.round_quantum(3000, 3072) == 1024  # 2048 does not divide 3072
    assert formulas.round_quantum(0.3, 4096) == 1
    with pytest.raises(ValueError):
        formulas.round_quantum(100, 0)


def test_routing_stats_brute_force():
    assert routing_stats([[0, 1], [1, 2], [1, 0]]) == (3, 2.0)
    assert routing_stats([[5]]) == (1, 1.0)
    assert routing_stats([]) == (0, 0.0)


def _block(num_experts=8, top_k=2, shared=0) -> MoEBlock:
    cfg = ModelConfig("qwen2_moe", 32, 16, 32, 1, 2, 2, 8, num_experts=num_experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=12, shared_expert_intermediate_size=shared, shared_expert_gate=bool(shared))
    block = MoEBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return block


def _fixed_router(block: MoEBlock, ids: list[list[int]]) -> None:
    fixed = torch.tensor(ids)
    block.gate.forward = lambda x: (fixed, torch.full(fixed.shape, 1.0 / fixed.shape[1]))


ROUTINGS = [
    [[0, 1], [1, 2], [1, 0], [7, 3]],  # 5 unique, 8 rows
    [[4, 4 + 1], [5, 6], [4, 6], [5, 4]],  # 3 unique
    [[2, 3], [2, 3], [2, 3], [2, 3]],  # 2 unique
]


@pytest.mark.parametrize("ids", ROUTINGS)
def test_block_statistics_match_brute_force_on_a_fixed_routing(ids):
    block = _block()
    _fixed_router(block, ids)
    out = block(torch.randn(len(ids), 16))
    unique, per_expert = routing_stats(ids)
    assert block.last_unique_experts == unique
    assert block.last_routed_rows / block.last_unique_experts == per_expert
    assert out.shape == (len(ids), 16)


def test_grouped_execution_equals_a_per_token_loop_on_a_fixed_routing():
    block = _block(shared=10)
    ids = ROUTINGS[0]
    _fixed_router(block, ids)
    x = torch.randn(4, 16)
    got = block(x)
    ex = block.experts
    expected = torch.zeros(4, 16)
    for t, row in enumerate(ids):
        for e in row:
            gate, up = (ex.gate_up_proj[e] @ x[t]).split(12)
            expected[t] += 0.5 * (ex.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    expected += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_expert_stats_average_over_layers():
    blocks = [_block(), _block()]
    for block, ids in zip(blocks, ROUTINGS[:2]):
        _fixed_router(block, ids)
        block(torch.randn(4, 16))
    stats = expert_stats(blocks, 4)
    assert stats.num_layers == 2 and stats.num_tokens == 4
    assert stats.unique_experts == (5 + 3) / 2
    assert stats.tokens_per_expert == pytest.approx((8 / 5 + 8 / 3) / 2)
    assert expert_stats([], 4) is None
    assert set(stats.to_dict()) == {"num_tokens", "unique_experts", "tokens_per_expert", "num_layers", "seconds"}
    assert stats.seconds > 0
    assert math.isclose(stats.to_dict()["unique_experts"], 4.0)
