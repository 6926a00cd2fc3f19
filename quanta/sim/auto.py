"""``quanta simulate --mixed-prefill-quantum auto``: the advisor's choice for a cost profile.

``quanta serve`` resolves ``auto`` from the model's config (E, K) and this
machine's ``quanta profile`` report (:mod:`quanta.moe.auto`). A simulated
machine has neither, so the same :func:`quanta.moe.advisor.advise` is given
what the cost profile says: E and K from its ``moe`` block (none for a
``chunk_tokens`` profile: the dense rule, the smallest power-of-two quantum
within 5% of the best per-token cost) and the cost per token of a pure prefill
call of each power of two dividing the prefill cap (overhead included), shown
beside each candidate.
"""

from __future__ import annotations

from quanta.config import SchedulerConfig
from quanta.moe.advisor import Advice, advise
from quanta.moe.formulas import power_of_two_divisors
from quanta.sim.profile import Profile


def advisor_report(profile: Profile, cap: int) -> dict:
    """The profile's costs in the shape of a ``quanta profile`` report: ms per token of a pure prefill call
    of q tokens, per-call overhead included, for every power of two q dividing the cap (for a
    ``chunk_tokens`` profile only from its smallest point up: below it the curve is not measured)."""
    moe = profile.moe or {}
    return {
        "model": {"name": profile.meta.get("name", "profile"), "num_experts": moe.get("num_experts"), "top_k": moe.get("top_k")},
        "machine": {"date": profile.meta.get("created", "undated")},
        "rows": [{"quantum": q, "ms_per_token": {"median": profile.step_cost([(0, q)], []) / q * 1e3}}
                 for q in _candidates(profile, cap)],
        "decode_step_ms": {"median": profile.step_cost([], [0]) * 1e3},
    }


def _candidates(profile: Profile, cap: int) -> list[int]:
    qs = power_of_two_divisors(cap)
    if profile.prefill_axis != "chunk_tokens":
        return qs
    lo, hi = profile.prefill_points[0][0], profile.prefill_points[-1][0]
    inside = [q for q in qs if lo <= q <= hi]
    return inside or [q for q in qs if q >= lo] or qs


def resolve_auto(profile: Profile, sched: SchedulerConfig) -> tuple[SchedulerConfig, Advice]:
    """A copy of ``sched`` whose ``mixed_prefill_quantum`` is the advisor's choice for ``profile``."""
    cap = sched.knobs["prefill_cap"]
    report = advisor_report(profile, cap)
    m = report["model"]
    advice = advise(m["num_experts"], m["top_k"], cap, cost_report=report, model_name=m["name"])
    return sched.with_knob("mixed_prefill_quantum", advice.quantum), advice
