"""Aggregation over repeats and the markdown report of a sweep or a run.

Each repeat yields one ``figures`` dict (see :func:`repeat_figures`); a
condition's figure is the median over its repeats with the IQR (p25-p75).
"""

from __future__ import annotations

import math

from quanta.analysis.frontier import pareto_frontier
from quanta.analysis.stats import fmt_spread, fmt_value, known, median_iqr

#: figure name -> (header, scale, digits) for the client-side table.
CLIENT_COLUMNS = {
    "ttft_p50": ("TTFT p50 ms", 1e3, 0), "ttft_p99": ("TTFT p99 ms", 1e3, 0),
    "e2e_p99": ("E2E p99 s", 1.0, 2), "client_itl_p50": ("ITL p50 ms (client)", 1e3, 1),
    "client_itl_p99": ("ITL p99 ms (client)", 1e3, 1), "queue_p99": ("client queue p99 ms", 1e3, 0),
}


def repeat_figures(metrics: dict) -> dict:
    """Flat figures (seconds, tokens/s, counts) of one repeat from its ``client``,
    ``trace`` (may be None) and ``scrape_overlap`` metrics. ITL prefers the
    server trace; ``itl_source`` says which was used."""
    c, t = metrics["client"], metrics.get("trace")
    f = {
        "throughput": c["throughput"], "ttft_p50": c["ttft"]["p50"], "ttft_p99": c["ttft"]["p99"],
        "e2e_p99": c["e2e"]["p99"], "client_itl_p50": c["itl"]["p50"], "client_itl_p99": c["itl"]["p99"],
        "client_itl_mean": c["itl"]["mean"], "queue_p99": c["queue"]["p99"], "num_failed": c["num_failed"],
        "scrape_overlap": metrics.get("scrape_overlap", math.nan),
        "prefix_hit_share": c.get("prefix_hit_share", math.nan),
    }
    if t:
        f.update({
            "prefill_calls": t["steps"]["prefill"], "decode_steps": t["steps"]["decode"], "mixed_steps": t["steps"]["mixed"],
            "itl_p50": t["itl"]["p50"], "itl_p99": t["itl"]["p99"], "itl_mean": t["itl"]["mean"], "itl_max": t["itl"]["max"],
            "prefill_rate": t["prefill_rate"], "decode_rate": t["decode_rate"], "occupancy": t["occupancy"],
            "overlap": t["overlap"], "itl_source": "server trace",
        })
    else:
        f.update({"itl_p50": c["itl"]["p50"], "itl_p99": c["itl"]["p99"], "itl_mean": c["itl"]["mean"],
                  "itl_max": c["itl"]["max"], "itl_source": "client"})
    return f


def aggregate(figures: list[dict]) -> dict:
    """Figure name -> ``(median, p25, p75)`` over repeats (numeric figures only)."""
    keys = {k for f in figures for k, v in f.items() if isinstance(v, (int, float))}
    return {k: median_iqr([f.get(k, math.nan) for f in figures]) for k in sorted(keys)}


def frontier_points(conditions: list[dict]) -> list[tuple[str, float, float]]:
    """``(name, median throughput, median p99 ITL)`` of the valid conditions."""
    return [(c["name"], median_iqr(_vals(c, "throughput"))[0], median_iqr(_vals(c, "itl_p99"))[0])
            for c in conditions if c.get("valid", True) and c.get("figures")]


def _vals(cond: dict, key: str) -> list[float]:
    return [math.nan if f.get(key) is None else f[key] for f in cond.get("figures", [])]


def _count(cond: dict, key: str) -> str:
    vals = [v for v in _vals(cond, key) if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "n/a"
    med, lo, hi = median_iqr(vals)
    return f"{med:g}" if lo == hi or len(vals) == 1 else f"{med:g} ({lo:g}-{hi:g})"


def throughput_ratios(cond: dict, base: dict | None, paired: bool = False) -> list[float]:
    """Per-repeat throughput of ``cond`` over the baseline's: over the
    baseline's median, or, when ``paired`` (interleaved rounds) and both have
    the same number of repeats, over the baseline's repeat of the same round."""
    thr = _vals(cond, "throughput")
    if base is None:
        return []
    base_thr = _vals(base, "throughput")
    if paired and len(base_thr) == len(thr):
        return [t / b if b and b > 0 else math.nan for t, b in zip(thr, base_thr)]
    med = median_iqr(base_thr)[0]
    return [t / med for t in thr] if med > 0 else []


def main_table(conditions: list[dict], baseline: str | None, paired: bool = False) -> str:
    """The seeds' table: condition, prefill calls, decode steps, ITL p50, p99,
    p99 IQR, throughput (median (IQR)), throughput / baseline (see
    :func:`throughput_ratios`), failed requests, frontier mark."""
    base = next((c for c in conditions if c["name"] == baseline and c.get("figures")), None)
    on_front = set(pareto_frontier(frontier_points(conditions)))
    mixed = any(any(f.get("mixed_steps") for f in c.get("figures", [])) for c in conditions)
    head = ["condition", "prefill calls", "decode steps"] + (["mixed steps"] if mixed else [])
    head += ["ITL p50 ms", "ITL p99 ms", "p99 IQR ms", "throughput tok/s", f"vs {baseline or 'baseline'}", "failed", "frontier"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in conditions:
        if not c.get("valid", True) or not c.get("figures"):
            cells = ["invalid: " + c.get("invalid_reason", "no data")] + [""] * (len(head) - 2)
            lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
            continue
        p99_vals = _vals(c, "itl_p99")
        p99 = median_iqr(p99_vals)
        spread = "n/a" if math.isnan(p99[0]) else "n/a (1 repeat)" if known(p99_vals) == 1 else f"{p99[1] * 1e3:.2f}-{p99[2] * 1e3:.2f}"
        thr = _vals(c, "throughput")
        row = [c["name"], _count(c, "prefill_calls"), _count(c, "decode_steps")] + ([_count(c, "mixed_steps")] if mixed else [])
        row += [fmt_value(median_iqr(_vals(c, "itl_p50"))[0], 1e3), fmt_value(p99[0], 1e3),
                spread,
                fmt_spread(thr, 1.0, 1), fmt_spread(throughput_ratios(c, base, paired), 1.0, 2),
                _count(c, "num_failed"), "yes" if c["name"] in on_front else ""]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def client_table(conditions: list[dict], simulated: bool = False) -> str:
    """Client-side latency figures, median (IQR) over repeats, per condition (a simulation has no
    client queueing: that column is left out)."""
    cols = {k: v for k, v in CLIENT_COLUMNS.items() if not (simulated and k == "queue_p99")}
    head = ["condition"] + [h for h, _, _ in cols.values()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in conditions:
        if c.get("figures"):
            lines.append("| " + " | ".join([c["name"]] + [fmt_spread(_vals(c, k), s, d) for k, (_, s, d) in cols.items()]) + " |")
    return "\n".join(lines)


def rates_table(conditions: list[dict], simulated: bool = False) -> str:
    """Union-of-intervals rates and overlap per condition (server trace, else n/a; a simulation has
    no scraped overlap column)."""
    cols = [("prefill_rate", "prefill tok/s (union busy)", 1.0, 0), ("decode_rate", "decode tok/s (union busy)", 1.0, 0),
            ("occupancy", "occupancy", 1.0, 2), ("overlap", "overlap (trace)", 1.0, 2), ("scrape_overlap", "overlap (/metrics)", 1.0, 2)]
    cols = cols[:-1] if simulated else cols
    head = ["condition"] + [h for _, h, _, _ in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in conditions:
        if c.get("figures"):
            lines.append("| " + " | ".join([c["name"]] + [fmt_spread(_vals(c, k), s, d) for k, _, s, d in cols]) + " |")
    return "\n".join(lines)


def frontier_lines(conditions: list[dict]) -> str:
    """The Pareto frontier as markdown bullets with spread."""
    names = pareto_frontier(frontier_points(conditions))
    by_name = {c["name"]: c for c in conditions}
    out = []
    for n in names:
        c = by_name[n]
        out.append(f"- **{n}**: throughput {fmt_spread(_vals(c, 'throughput'), 1.0, 1)} tok/s, "
                   f"p99 ITL {fmt_spread(_vals(c, 'itl_p99'), 1e3, 2)} ms")
    return "\n".join(out) if out else "- (no valid condition)"


def trace_text(figures: dict) -> str:
    """:func:`~quanta.analysis.server_trace.trace_metrics` figures as aligned plain-text tables, the unit
    in each header: ITL in ms (2 decimals), busy time and wall in s (3), rates in tok/s (1), shares (2)."""
    steps, itl = figures["steps"], figures["itl"]
    lines = ["steps: " + ", ".join(f"{k} {v}" for k, v in steps.items()) + f" (total {sum(steps.values())})", ""]
    keys = ("mean", "p50", "p90", "p99", "max")
    lines += _aligned([["ITL ms", "n", *keys], ["", str(itl["n"]), *(fmt_value(itl[k], 1e3) for k in keys)]])
    lines += [""] + _aligned([["phase", "tokens", "busy s", "rate tok/s", "occupancy"]] + [
        [p, str(figures[f"{p}_tokens"]), fmt_value(figures[f"{p}_busy"], 1.0, 3), fmt_value(figures[f"{p}_rate"], 1.0, 1),
         fmt_value(figures[f"{p}_occupancy"])] for p in ("prefill", "decode")])
    lines += ["", f"wall s: {fmt_value(figures['wall'], 1.0, 3)}, occupancy (any step): {fmt_value(figures['occupancy'])}, "
              f"overlap (prefill time with another request decoding): {fmt_value(figures['overlap'])}"]
    return "\n".join(lines)


def _aligned(rows: list[list[str]]) -> list[str]:
    """Rows as lines, the first column left-aligned and the others right-aligned to their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
