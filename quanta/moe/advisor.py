"""``quanta advise``: the mixed prefill quantum from the model's expert shape.

Rule (the seed study's finding): the cost per prompt token of an MoE prefill
chunk falls while tokens per expert ``Q * K / E`` grows, until a saturation
point T (48 on the seed's hardware; measured on this machine by
``quanta profile moe``). The smallest chunk that reaches it is

    quantum = T * E / K

rounded to the power of two nearest on a log2 scale among those dividing the
prefill cap (so the batched scheduler never splits a quantum at a cap
boundary; :func:`quanta.moe.formulas.round_quantum`). A larger quantum buys
little prefill throughput and lengthens the decode gap of the other
sessions: in the batched schedule a decoding session waits one decode step
plus one mixed prefill quantum, ``gap(Q) ~ t_decode + Q * c(Q)`` with c(Q)
the measured cost per prompt token.

Dense models have no experts: the tokens-per-expert argument does not apply,
and the advisor falls back to a measured prefill cost curve (the smallest
measured quantum within 5 % of the best cost per token) or, without one, the
default quantum.

The KV block pool (:func:`advise_pool`): ``max_num_seqs`` sequences of
``context`` tokens that share a ``shared_prefix`` (held once, as whole blocks,
by the prefix cache) need ``shared + max_num_seqs x own`` blocks, ``shared``
the prefix's full blocks and ``own`` the blocks of the rest of a sequence.
A budget smaller than that cannot hold every slot at full context: the
engine preempts the most recently admitted sequence and recomputes it when
it is readmitted, which at every slot's full context recurs at every
admission (a preemption storm). The advice is the budget that holds them,
and the most sequences (``max_num_seqs`` at most) a given budget holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from quanta.engine.block_pool import blocks_for
from quanta.moe import formulas
from quanta.moe.prefill_cost import SATURATION_TOLERANCE
from quanta.moe.report import cost_report_cache_path

#: The seed study's saturation point, used when no profile of this machine is available.
DEFAULT_TARGET_TOKENS_PER_EXPERT = 48.0
DEFAULT_DENSE_QUANTUM = 2048


@dataclass(slots=True)
class Candidate:
    """One quantum of the neighbourhood table (None where not applicable or not measured)."""

    quantum: int
    tokens_per_expert: float | None
    unique_experts_expected: float | None
    ms_per_token: float | None
    decode_gap_ms: float | None
    moe_ms_per_token: float | None = None


@dataclass(slots=True)
class Advice:
    """The recommendation and why.

    Attributes:
        quantum: recommended mixed prefill quantum (tokens).
        reason: one-paragraph explanation (logged by ``serve ... auto``).
        candidates: the recommendation and its power-of-two neighbours.
        dense: the model has no routed experts.
        target / target_source: tokens per expert aimed at and where it came from.
    """

    quantum: int
    reason: str
    candidates: list[Candidate] = field(default_factory=list)
    dense: bool = False
    target: float | None = None
    target_source: str | None = None


def load_cost_report(path: str | Path) -> dict:
    """A prefill cost report (JSON) written by ``quanta profile``.

    Raises:
        ValueError: the file is not such a report.
    """
    data = json.loads(Path(path).read_text())
    if data.get("kind") != "quanta-prefill-profile":
        raise ValueError(f"{path} is not a quanta profile (kind {data.get('kind')!r})")
    return data


def cached_cost_report(model_name: str) -> dict | None:
    """The report ``quanta profile`` last cached for ``model_name`` on this machine, if any."""
    path = cost_report_cache_path(model_name)
    try:
        return load_cost_report(path) if path.is_file() else None
    except (ValueError, OSError, json.JSONDecodeError):
        return None


def advise(num_experts: int | None, top_k: int | None, prefill_cap: int, target: float | None = None,
           cost_report: dict | None = None, model_name: str | None = None, neighbours: int = 2) -> Advice:
    """Recommend the mixed prefill quantum.

    Args:
        num_experts / top_k: E and K; None (or 0) for a dense model.
        prefill_cap: the scheduler's cap; the quantum is a power of two dividing it.
        target: tokens per expert to reach; None takes the report's saturation
            point, else :data:`DEFAULT_TARGET_TOKENS_PER_EXPERT`.
        cost_report: a ``quanta profile`` report; its costs are shown when it
            measured the same model (name and E, K), its saturation point is
            used as the target either way.
        model_name: for matching the report.
        neighbours: powers of two shown on each side of the recommendation.
    """
    measured = _measured_costs(cost_report, num_experts, top_k, model_name)
    moe_costs = _measured_costs(cost_report, num_experts, top_k, model_name, "moe_ms_per_token")
    decode_ms = cost_report["decode_step_ms"]["median"] if cost_report and measured else None
    if not num_experts:
        return _advise_dense(prefill_cap, measured, decode_ms, neighbours)
    if target is not None:
        source = "given"
    elif cost_report and cost_report.get("saturation_tokens_per_expert"):
        target = float(cost_report["saturation_tokens_per_expert"])
        source = f"saturation point measured by quanta profile ({cost_report['model']['name']}, {cost_report['machine']['date']})"
    else:
        target, source = DEFAULT_TARGET_TOKENS_PER_EXPERT, "the seed study's saturation point (no profile of this machine)"
    exact = formulas.quantum_for_target(target, num_experts, top_k)
    quantum = formulas.round_quantum(exact, prefill_cap)
    reason = (f"E={num_experts} routed experts, K={top_k} per token: quantum = target x E / K = {target:g} x {num_experts} / {top_k} "
              f"= {exact:.0f}, rounded to the power of two dividing the prefill cap {prefill_cap}: {quantum} "
              f"({formulas.tokens_per_expert(quantum, top_k, num_experts):.1f} tokens per expert; "
              f"a chunk of {quantum} tokens hits ~{formulas.expected_unique_experts(quantum, top_k, num_experts):.0f} "
              f"of {num_experts} experts under random routing). Target {target:g} tokens per expert: {source}.")
    if exact > quantum * 1.5:
        reason += f" The cap limits the quantum: {exact:.0f} would need a larger --prefill-cap."
    rows = [_candidate(q, num_experts, top_k, measured, decode_ms) for q in _neighbourhood(quantum, prefill_cap, neighbours)]
    for c in rows:
        c.moe_ms_per_token = moe_costs.get(c.quantum)
    return Advice(quantum, reason, rows, False, target, source)


def _advise_dense(prefill_cap: int, measured: dict[int, float], decode_ms: float | None, neighbours: int) -> Advice:
    note = "Dense model: the tokens-per-expert argument does not apply (no routed experts)."
    usable = {q: c for q, c in measured.items() if q <= prefill_cap and prefill_cap % q == 0}
    if usable:
        best = min(usable.values())
        quantum = min(q for q, c in usable.items() if c <= best * (1 + SATURATION_TOLERANCE))
        reason = (f"{note} From the measured prefill cost curve: the smallest measured quantum dividing the cap {prefill_cap} "
                  f"within {SATURATION_TOLERANCE:.0%} of the best cost per token ({best:.3f} ms): {quantum}.")
    else:
        quantum = formulas.round_quantum(min(DEFAULT_DENSE_QUANTUM, prefill_cap), prefill_cap)
        reason = (f"{note} No measured prefill cost curve for this model (run quanta profile prefill); "
                  f"keeping the default quantum {quantum}.")
    rows = [_candidate(q, None, None, measured, decode_ms) for q in _neighbourhood(quantum, prefill_cap, neighbours)]
    return Advice(quantum, reason, rows, True)


def _measured_costs(report: dict | None, num_experts: int | None, top_k: int | None, model_name: str | None,
                    key: str = "ms_per_token") -> dict[int, float]:
    """quantum -> median ``key`` (ms/token), when ``report`` measured this model (same name, E and K)."""
    if not report:
        return {}
    m = report["model"]
    if (m.get("num_experts") or None) != (num_experts or None) or (m.get("top_k") or None) != (top_k or None):
        return {}
    if model_name is not None and m.get("name") != model_name:
        return {}
    return {r["quantum"]: r[key]["median"] for r in report["rows"] if key in r}


def _neighbourhood(quantum: int, cap: int, n: int) -> list[int]:
    options = formulas.power_of_two_divisors(cap)
    i = options.index(quantum)
    return options[max(0, i - n): i + n + 1]


def _candidate(q: int, e: int | None, k: int | None, measured: dict[int, float], decode_ms: float | None) -> Candidate:
    cost = measured.get(q)
    gap = decode_ms + q * cost if cost is not None and decode_ms is not None else None
    if not e:
        return Candidate(q, None, None, cost, gap)
    return Candidate(q, formulas.tokens_per_expert(q, k, e), formulas.expected_unique_experts(q, k, e), cost, gap)


def format_advice(advice: Advice, chosen_label: str = "recommended") -> str:
    """The recommendation, its reason and the neighbourhood table (plain text)."""
    lines = [f"mixed prefill quantum: {advice.quantum}", "", advice.reason, "",
             f"{'quantum':>8}  {'tokens/expert':>13}  {'unique experts':>14}  {'ms/token':>9}  {'MoE ms/token':>12}  {'decode gap ms':>13}"]
    for c in advice.candidates:
        def cell(v, fmt, w):
            return f"{v:{w}{fmt}}" if v is not None else f"{'n/a' if advice.dense and fmt == '.1f' else '-':>{w}}"
        mark = f"  <- {chosen_label}" if c.quantum == advice.quantum else ""
        lines.append(f"{c.quantum:>8}  {cell(c.tokens_per_expert, '.1f', 13)}  {cell(c.unique_experts_expected, '.1f', 14)}  "
                     f"{cell(c.ms_per_token, '.3f', 9)}  {cell(c.moe_ms_per_token, '.3f', 12)}  {cell(c.decode_gap_ms, '.0f', 13)}{mark}")
    lines += ["", "unique experts: random-routing expectation E(1-(1-K/E)^Q); ms/token: measured pure prefill cost "
              "of whole steps, MoE ms/token: of the MoE blocks alone (quanta profile, this model only); "
              "decode gap: what a decoding session waits per token while another "
              "prefills, one decode step + Q x ms/token ('-': not measured)."]
    return "\n".join(lines)


@dataclass(slots=True)
class PoolAdvice:
    """What a KV budget holds (module docstring; counts in blocks of ``block_size`` tokens).

    Attributes:
        needed_blocks: the budget that holds ``max_num_seqs`` sequences of ``context`` tokens.
        budget_blocks: the budget given (None: none given).
        max_num_seqs: the most sequences at full context the budget holds, at most the one given
            (the given one without a budget).
    """

    max_num_seqs: int
    context: int
    shared_prefix: int
    block_size: int
    needed_blocks: int
    budget_blocks: int | None

    @property
    def fits(self) -> bool:
        return self.budget_blocks is None or self.budget_blocks >= self.needed_blocks


def advise_pool(max_num_seqs: int, context: int, block_size: int, budget_tokens: int | None = None,
                shared_prefix: int = 0) -> PoolAdvice:
    """The KV budget ``max_num_seqs`` sequences of ``context`` tokens need, sharing a ``shared_prefix``, and
    the most of them a budget of ``budget_tokens`` holds (module docstring).

    Raises:
        ValueError: a context of less than one token, or a shared prefix longer than the context.
    """
    if context < 1 or not 0 <= shared_prefix <= context:
        raise ValueError(f"need 1 <= context and 0 <= shared prefix <= context, got {context} and {shared_prefix}")
    shared = shared_prefix // block_size  # full blocks only: the prefix cache shares no partial block
    own = blocks_for(context - shared * block_size, block_size)
    budget = blocks_for(budget_tokens, block_size) if budget_tokens is not None else None
    seqs = max_num_seqs if budget is None else min(max_num_seqs, max(budget - shared, 0) // own)
    return PoolAdvice(seqs, context, shared_prefix, block_size, shared + max_num_seqs * own, budget)


def format_pool_advice(a: PoolAdvice, asked: int, bytes_per_token: int | None = None) -> str:
    """The pool advice as text (``asked``: the ``--max-num-seqs`` it was asked about)."""
    need = a.needed_blocks * a.block_size
    size = f" ({need * bytes_per_token / 2**20:,.0f} MiB at 2 bytes per element)" if bytes_per_token else ""
    prefix = f", sharing a {a.shared_prefix}-token prefix" if a.shared_prefix else ""
    lines = [f"KV pool: {asked} sequences of {a.context} tokens{prefix} need {a.needed_blocks} blocks of {a.block_size}: "
             f"--kv-cache-tokens {need}{size}."]
    if a.budget_blocks is not None and a.max_num_seqs == 0:
        lines.append(f"The budget of {a.budget_blocks * a.block_size} tokens does not hold one sequence of {a.context} "
                     "tokens (quanta serve refuses it).")
    elif a.budget_blocks is not None and a.fits:
        lines.append(f"The budget of {a.budget_blocks * a.block_size} tokens holds them: no preemption at full context.")
    elif a.budget_blocks is not None:
        lines.append(f"The budget of {a.budget_blocks * a.block_size} tokens holds {a.max_num_seqs} of them at full context; "
                     f"past that the engine preempts and recomputes. Use --max-num-seqs {a.max_num_seqs}"
                     f" or --kv-cache-tokens {need}.")
    return "\n".join(lines)
