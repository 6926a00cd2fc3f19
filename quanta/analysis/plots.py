"""PNG figures of a sweep (matplotlib, Agg backend): the frontier with IQR
bars, the ITL CDF per condition, and the prefill rate against the chunk or
quantum knob."""

from __future__ import annotations

import math
import re

from quanta.analysis.frontier import pareto_frontier
from quanta.analysis.report import frontier_points
from quanta.analysis.stats import median_iqr

#: knobs that set how many prompt tokens one prefill call carries.
QUANTUM_KNOBS = ("mixed_prefill_quantum", "prefill_quantum", "chunk", "max_num_batched_tokens")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(ax, text: str) -> None:
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(text, 80)), fontsize=9)


def _vals(c: dict, k: str) -> list[float]:
    return [f.get(k) for f in c.get("figures", []) if f.get(k) is not None]


def frontier_line(conditions: list[dict]) -> list[tuple[float, float]]:
    """``(throughput, p99 ITL)`` of the Pareto frontier's conditions in throughput order, where
    there are two or more of them; one point is no line (and gets no legend entry): []."""
    points = frontier_points(conditions)
    front = pareto_frontier(points)
    line = sorted((t, p) for n, t, p in points if n in front)
    return line if len(line) > 1 else []


def frontier_plot(conditions: list[dict], path: str, title: str = "") -> None:
    """Throughput (x, tok/s) against p99 ITL (y, ms), median with IQR bars per
    condition; the Pareto frontier drawn as a line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    front = pareto_frontier(frontier_points(conditions))
    for c in conditions:
        if not c.get("valid", True) or not c.get("figures"):
            continue
        t, p = median_iqr(_vals(c, "throughput")), median_iqr(_vals(c, "itl_p99"))
        if math.isnan(t[0]) or math.isnan(p[0]):
            continue
        on = c["name"] in front
        ax.errorbar(t[0], p[0] * 1e3, xerr=[[t[0] - t[1]], [t[2] - t[0]]], yerr=[[(p[0] - p[1]) * 1e3], [(p[2] - p[0]) * 1e3]],
                    fmt="o" if on else "s", color="C3" if on else "C0", capsize=3, alpha=0.9)
        ax.annotate(c["name"], (t[0], p[0] * 1e3), textcoords="offset points", xytext=(5, 5), fontsize=8)
    line = frontier_line(conditions)
    if line:  # with its legend entry only where a line is drawn
        ax.plot([x for x, _ in line], [y * 1e3 for _, y in line], "--", color="C3", label="Pareto frontier")
        ax.legend()
    ax.set_xlabel("output throughput (tok/s, median over repeats, IQR bars)")
    ax.set_ylabel("p99 ITL (ms, median over repeats, IQR bars)")
    _title(ax, title or "throughput vs p99 ITL")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def itl_cdf_plot(itl_by_condition: dict[str, list[float]], path: str, title: str = "") -> bool:
    """Empirical CDF of pooled ITL samples (seconds, plotted in ms, log x) per condition, one
    line and legend entry per condition with a positive gap. False (nothing written) when no
    condition has one: gaps of 0 (tokens that arrived together) draw nothing on a log axis."""
    drawn = {name: sorted(x for x in xs if x > 0) for name, xs in itl_by_condition.items()}
    if not any(drawn.values()):
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, (name, xs) in enumerate(drawn.items()):
        if not xs:
            continue
        ys = [(j + 1) / len(xs) for j in range(len(xs))]
        ax.step([x * 1e3 for x in xs], ys, where="post", label=name, color=f"C{i % 10}", linestyle="-" if i < 10 else "--")
    ax.set_xscale("log")
    ax.set_xlabel("ITL (ms, log scale)")
    ax.set_ylabel("fraction of gaps <= x")
    ax.axhline(0.99, color="grey", lw=0.6, ls=":")
    _title(ax, title or "ITL CDF (all repeats pooled)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def quantum_of(flags: list[str] | None) -> tuple[str, int] | None:
    """``(knob, value)`` of the first prefill-size knob in serve ``flags``, or None."""
    flags = flags or []
    for knob in QUANTUM_KNOBS:
        flag = "--" + knob.replace("_", "-")
        if flag in flags and flags.index(flag) + 1 < len(flags) and re.fullmatch(r"\d+", flags[flags.index(flag) + 1]):
            return knob, int(flags[flags.index(flag) + 1])
    return None


def prefill_rate_plot(conditions: list[dict], path: str, title: str = "") -> bool:
    """Prefill rate (prompt tokens per union busy second, median with IQR)
    against the chunk/quantum knob, one line per knob. False (nothing
    written) when no condition varies such a knob or has a trace."""
    series: dict[str, list[tuple[int, tuple[float, float, float]]]] = {}
    for c in conditions:
        q = quantum_of(c.get("flags"))
        rate = median_iqr(_vals(c, "prefill_rate"))
        if q and c.get("valid", True) and not math.isnan(rate[0]):
            series.setdefault(q[0], []).append((q[1], rate))
    if not series:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, (knob, pts) in enumerate(sorted(series.items())):
        pts.sort()
        xs = [x for x, _ in pts]
        ax.errorbar(xs, [r[0] for _, r in pts], yerr=[[r[0] - r[1] for _, r in pts], [r[2] - r[0] for _, r in pts]],
                    fmt="o-", capsize=3, color=f"C{i}", label=knob)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens per prefill call (knob value, log2)")
    ax.set_ylabel("prefill tok/s (union of prefill steps, median, IQR bars)")
    _title(ax, title or "prefill rate vs quantum")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
