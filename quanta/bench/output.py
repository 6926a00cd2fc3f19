"""Result files of ``bench run`` / ``bench sweep``: JSON with every raw
sample, a markdown report and PNG plots, all named from one prefix
(``PREFIX.json``, ``PREFIX.md``, ``PREFIX-frontier.png``, ...)."""

from __future__ import annotations

import json
import math
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from quanta.analysis import plots
from quanta.analysis.report import aggregate, client_table, frontier_lines, main_table, rates_table, repeat_figures
from quanta.analysis.requests import RequestSample, token_times
from quanta.analysis.server_trace import trace_itl
from quanta.analysis.stats import fmt_spread, median_iqr
from quanta.bench.runner import compute_metrics

HOW_MEASURED = """\
- **ITL** (headline table) is server-side when the server has quanta's `/v1/trace`: per request, the gap
  from the end of the step that emitted its previous token to the end of the step that emitted the next
  (a prefill that stalls a request lands in that request's gap). Elsewhere it is the client-side gap
  between consecutive token arrivals of one request. Both pool every gap of every request of a run.
- **Tokens** are counted from the server's `usage` (`stream_options.include_usage`), not from chunks; a
  chunk that carried several tokens is several tokens (arriving together).
- **Latencies include client-side queueing**: TTFT and E2E count from the request's *scheduled* send time
  (burst: the burst's start), not from when the client got round to sending it (no coordinated omission).
- **Repeats**: every figure is the median over the repeats with the IQR (p25-p75) in parentheses; the
  percentiles of one repeat and its mean come from the same samples.
- **Throughput**: output tokens of successful requests / wall time of the run (first scheduled send to
  last response end).
- **Busy rates**: tokens / length of the *union* of the step intervals of that phase (no double
  counting); occupancy = busy / wall. **Overlap**: share of prefill time during which another request was
  decoding, from the trace and from `quanta:engine_step_seconds_total` scraped every `--scrape` seconds.
- **Failed requests** are excluded from latency samples but counted per condition (column `failed`,
  section Errors); none is dropped silently.
"""


def machine() -> dict:
    """CPU model, logical cores, platform and Python of this machine."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def code_version() -> str | None:
    """``git`` short commit of the quanta checkout, ``+dirty`` when tracked files
    differ from it; None outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _clean(x):
    """JSON-safe copy: NaN/inf -> None, floats rounded to 1 µs / 6 decimals, tuples -> lists."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else round(x, 6)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def document(kind: str, command: str, workload, repeats: int, conditions: list[dict], baseline: str | None, note: str = "") -> dict:
    """The result document written as JSON."""
    return {"kind": kind, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "command": command, "workload": workload.to_dict(), "workload_text": workload.describe(), "repeats": repeats,
            "baseline": baseline, "note": note, "code": code_version(), "conditions": conditions}


def write_json(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(doc), separators=(",", ":")) + "\n", encoding="utf-8")


def recompute(doc: dict) -> dict:
    """Recompute every condition's metrics and figures from its raw data (in place)."""
    kind = doc["workload"]["kind"]
    for c in doc["conditions"]:
        c["figures"] = []
        for run in c.get("runs", []):
            samples = [RequestSample.from_dict(s) for s in run["samples"]]
            run["metrics"] = compute_metrics(samples, run.get("trace"), run.get("scrapes") or [], kind)
            c["figures"].append(repeat_figures(run["metrics"]))
        c["summary"] = aggregate(c["figures"]) if c["figures"] else None
    return doc


def itl_by_condition(doc: dict) -> dict[str, list[float]]:
    """Pooled ITL samples of each valid condition over all repeats (trace if present, else client)."""
    out = {}
    for c in doc["conditions"]:
        xs: list[float] = []
        for run in c.get("runs", []):
            if run.get("trace"):
                xs += trace_itl(run["trace"])
            else:
                for s in map(RequestSample.from_dict, run["samples"]):
                    if s.ok:
                        t, _ = token_times(s)
                        xs += [b - a for a, b in zip(t, t[1:])]
        if xs:
            out[c["name"]] = xs
    return out


def _errors_section(doc: dict) -> str:
    lines = []
    for c in doc["conditions"]:
        counts: dict[str, int] = {}
        example: dict[str, str] = {}
        for run in c.get("runs", []):
            for s in run["samples"]:
                if s.get("error"):
                    counts[s["error"]] = counts.get(s["error"], 0) + 1
                    example.setdefault(s["error"], s.get("error_detail") or "")
        for k, n in sorted(counts.items()):
            lines.append(f"- {c['name']}: **{k}** x{n} (e.g. {example[k][:160]})")
    return "\n".join(lines) or "- none: every request of every repeat finished"


def _probe_section(doc: dict) -> str:
    rows = ["| condition | probe prompt tokens | probe prefill tok/s | others' ITL p50 ms during probe | p99 during | p99 outside |",
            "|---|---|---|---|---|---|"]
    for c in doc["conditions"]:
        ps = [r["metrics"].get("probe") for r in c.get("runs", []) if r["metrics"].get("probe")]
        if not ps:
            continue
        g = lambda f: [f(p) for p in ps]  # noqa: E731
        rows.append(f"| {c['name']} | {fmt_spread(g(lambda p: p['prompt_tokens'] or math.nan), 1, 0)} | "
                    f"{fmt_spread(g(lambda p: p['prefill_tok_s']), 1, 0)} | {fmt_spread(g(lambda p: p['itl_during']['p50']), 1e3, 1)} | "
                    f"{fmt_spread(g(lambda p: p['itl_during']['p99']), 1e3, 1)} | {fmt_spread(g(lambda p: p['itl_outside']['p99']), 1e3, 1)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def _load(doc: dict) -> str:
    loads = [x for c in doc["conditions"] for r in c.get("runs", []) for x in (r.get("load") or [])]
    return f"{min(loads):.2f}-{max(loads):.2f}" if loads else "n/a"


def markdown(doc: dict, plot_files: dict[str, str], title: str) -> str:
    """The report: context, how measured, headline table, frontier, other tables, errors, plots."""
    m = doc["machine"]
    parts = [f"# {title}", "",
             f"- date: {doc['created']}",
             f"- machine: {m['cpu']}, {m['logical_cores']} logical cores, {m['platform']}, Python {m['python']}",
             f"- 1-minute load average around the repeats: {_load(doc)} (other work on the machine inflates latencies)",
             f"- command: `{doc['command']}`",
             f"- code: quanta {doc.get('code') or 'unknown'}",
             f"- workload: {doc['workload_text']}",
             f"- repeats: {doc['repeats']} per condition"
             + (", interleaved: all servers up, round r measures every condition once (ratios to the baseline paired per round)"
                if doc.get("interleaved") else ", one condition after the other")
             + f"; baseline for throughput ratios: {doc.get('baseline') or 'none'}"]
    if doc.get("note"):
        parts.append(f"- note: {doc['note']}")
    src = {f.get("itl_source") for c in doc["conditions"] for f in c.get("figures", [])}
    parts += ["", "## How it was measured", "", HOW_MEASURED,
              f"## Results (ITL source: {', '.join(sorted(s for s in src if s)) or 'n/a'}; median over repeats, IQR p25-p75)", "",
              main_table(doc["conditions"], doc.get("baseline"), bool(doc.get("interleaved"))), "",
              "## Pareto frontier (throughput up, p99 ITL down; non-dominated conditions)", "", frontier_lines(doc["conditions"]), "",
              "## Client-side latency (median (IQR) over repeats)", "", client_table(doc["conditions"]), "",
              "## Busy time, rates and overlap (server trace / scrapes; n/a for servers without them)", "",
              rates_table(doc["conditions"]), ""]
    probe = _probe_section(doc)
    if probe:
        parts += ["## Probe", "", probe, ""]
    invalid = [c for c in doc["conditions"] if not c.get("valid", True)]
    if invalid:
        parts += ["## Invalid conditions (not measured)", ""] + [f"- {c['name']}: {c.get('invalid_reason')}" for c in invalid] + [""]
    parts += ["## Errors", "", _errors_section(doc), ""]
    if plot_files:
        parts += ["## Plots", ""] + [f"![{k}]({v})" for k, v in plot_files.items()] + [""]
    return "\n".join(parts)


def write_outputs(doc: dict, prefix: Path, title: str, plots_enabled: bool = True) -> list[Path]:
    """Write ``PREFIX.json``, the PNGs and ``PREFIX.md``; returns the paths written."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = [prefix.with_name(prefix.name + ".json")]
    write_json(doc, written[0])
    files: dict[str, str] = {}
    if plots_enabled:
        f = prefix.with_name(prefix.name + "-frontier.png")
        plots.frontier_plot(doc["conditions"], str(f), title)
        files["throughput vs p99 ITL"] = f.name
        itl = itl_by_condition(doc)
        if itl:
            f = prefix.with_name(prefix.name + "-itl-cdf.png")
            plots.itl_cdf_plot(itl, str(f), title + ": ITL CDF")
            files["ITL CDF"] = f.name
        f = prefix.with_name(prefix.name + "-prefill-rate.png")
        if plots.prefill_rate_plot(doc["conditions"], str(f), title + ": prefill rate"):
            files["prefill rate vs quantum"] = f.name
        written += [prefix.with_name(n) for n in files.values()]
    md = prefix.with_name(prefix.name + ".md")
    md.write_text(markdown(doc, files, title), encoding="utf-8")
    written.append(md)
    return written


def headline(doc: dict) -> str:
    """The main table alone (printed to the terminal at the end of a run)."""
    return main_table(doc["conditions"], doc.get("baseline"), bool(doc.get("interleaved")))


__all__ = ["document", "headline", "machine", "median_iqr", "recompute", "write_json", "write_outputs"]
