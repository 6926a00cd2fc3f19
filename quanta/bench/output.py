"""Result files of ``bench run`` / ``bench sweep``: JSON with every raw
sample, a markdown report and PNG plots, all named from one prefix
(``PREFIX.json``, ``PREFIX.md``, ``PREFIX-frontier.png``, ...)."""

from __future__ import annotations

import json
import math
import os
import platform
from datetime import UTC, datetime
from pathlib import Path

from quanta.analysis import plots
from quanta.analysis.report import aggregate, client_table, frontier_lines, main_table, rates_table, repeat_figures
from quanta.analysis.requests import RequestSample, token_times
from quanta.analysis.server_trace import trace_itl
from quanta.analysis.stats import fmt_spread, median_iqr
from quanta.bench.runner import compute_metrics, run_trace

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
  last response end); a stream that ended without `usage` (a probe's cancelled sessions) counts its chunks.
- **Busy rates**: tokens / length of the *union* of the step intervals of that phase (no double
  counting); occupancy = busy / wall. **Overlap**: share of prefill time during which another request was
  decoding, from the trace and from `quanta:engine_step_seconds_total` scraped every `--scrape` seconds
  (the scraped figure only when the run spans enough scrape windows to tell the phases apart, else n/a).
- **Lengths**: each request's prompt size and output length are drawn as the workload says and recorded
  per request (`max_tokens`, `ignore_eos`, `prompt_size` in the JSON); prompt and output tokens below are
  the server's `usage` counts. **Prefix hits**: `usage.prompt_tokens_details.cached_tokens` / prompt tokens.
- **Failed requests** are excluded from latency samples but counted per condition (column `failed`,
  section Errors); none is dropped silently.
"""


HOW_SIMULATED = """\
- **Simulated**: quanta's own scheduler and Engine ran every step; only the executor is a cost model
  (the profile below gives each step's seconds) and the clock is virtual. Each emitted token is one
  streamed chunk arriving at the end of its step; ITL is the server-trace ITL of the simulated trace.
- **Repeats**: every figure is the median over the repeats with the IQR (p25-p75) in parentheses (one
  repeat: the value alone); repeat r uses seed + r.
- **Throughput**: every emitted token (a probe's cancelled sessions too) / simulated wall time (first
  scheduled request to last end).
- **Busy rates, overlap**: as for a measured run, from the simulated trace.
- **KV cache**: the engine's own block pool (admission by blocks, preemption with recompute, prefix
  sharing) on the budget the serve flags give; its table is at the end.
- **Lengths**: prompt sizes and output lengths drawn as the workload says, recorded per request.
"""

#: what a run of quanta simulate leaves out (printed in its report)
NOT_SIMULATED = (
    "HTTP, the client and its queueing (a request reaches the engine at its scheduled time, or after a replayed send delay)",
    "tokenization, detokenization and the server's event loop between steps",
    "other load on the machine (the profile's step times, with its step noise if it has one, are all there is)",
    "end-of-sequence: outputs have exactly the planned length (as with ignore_eos)",
    "memory other than the KV block pool (weights, activations), and serve's cap of a default pool at half "
    "the serving machine's memory (give --kv-cache-memory to model a budget in bytes)",
    "/metrics scrapes (no scraped overlap)",
)


def not_simulated(doc: dict) -> list[str]:
    """What a simulation left out (:data:`NOT_SIMULATED`), plus a KV budget where a condition's pool had
    none: the engine's block pool is simulated, but without a budget it never runs short."""
    unbounded = [c["name"] for c in doc.get("conditions", [])
                 if any(r.get("kv_pool") and not r["kv_pool"]["bounded"] for r in c.get("runs", []))]
    if not unbounded:
        return list(NOT_SIMULATED)
    which = "every condition" if len(unbounded) == len(doc["conditions"]) else ", ".join(unbounded)
    return [*NOT_SIMULATED, f"a KV budget for {which}: no --kv-cache-tokens, --kv-cache-memory or --max-model-len was "
            "given, so the block pool never ran short (its table shows the blocks the run held)"]


def machine() -> dict:
    """CPU model, the vector features that choose kernels (``flags``), logical cores, platform and
    Python of this machine."""
    from quanta.model.cpu import cpu_summary

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "flags": cpu_summary(), "logical_cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def machine_text(m: dict) -> str:
    """``CPU (flags), N logical cores``: a result's machine (``flags`` where it was recorded)."""
    flags = f" ({m['flags']})" if m.get("flags") else ""
    return f"{m['cpu']}{flags}, {m['logical_cores']} logical cores"


def code_version() -> str | None:
    """``git`` short commit of the quanta checkout, ``+dirty`` when tracked files
    differ from it; None outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True,
                               timeout=10)
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
    """The result document written as JSON (a trace workload's own block reuse in ``trace_reuse``)."""
    extra = {}
    if workload.kind == "trace":
        from quanta.bench.mooncake import reuse

        extra["trace_reuse"] = reuse(workload.trace_requests(), workload.block_tokens())
    return {**extra, "kind": kind, "created": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
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
            run["metrics"] = compute_metrics(samples, run_trace(run), run.get("scrapes") or [], kind)
            c["figures"].append(repeat_figures(run["metrics"]))
        c["summary"] = aggregate(c["figures"]) if c["figures"] else None
    return doc


def itl_by_condition(doc: dict) -> dict[str, list[float]]:
    """Pooled ITL samples of each valid condition over all repeats (trace if present, else client)."""
    out = {}
    for c in doc["conditions"]:
        xs: list[float] = []
        for run in c.get("runs", []):
            if trace := run_trace(run):
                xs += trace_itl(trace)
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
        g = lambda f, ps=ps: [f(p) for p in ps]  # noqa: E731
        rows.append(f"| {c['name']} | {fmt_spread(g(lambda p: p['prompt_tokens'] or math.nan), 1, 0)} | "
                    f"{fmt_spread(g(lambda p: p['prefill_tok_s']), 1, 0)} | {fmt_spread(g(lambda p: p['itl_during']['p50']), 1e3, 1)} | "
                    f"{fmt_spread(g(lambda p: p['itl_during']['p99']), 1e3, 1)} | "
                    f"{fmt_spread(g(lambda p: p['itl_outside']['p99']), 1e3, 1)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def _load(doc: dict) -> str:
    loads = [x for c in doc["conditions"] for r in c.get("runs", []) for x in (r.get("load") or [])]
    return f"{min(loads):.2f}-{max(loads):.2f}" if loads else "n/a"


def _machine_lines(doc: dict) -> list[str]:
    """Where the figures come from: this machine and its load, or a simulation's profile."""
    if doc.get("kind") != "simulate":
        m = doc["machine"]
        return [f"- machine: {machine_text(m)}, {m['platform']}, Python {m['python']}",
                f"- 1-minute load average around the repeats: {_load(doc)} (other work on the machine inflates latencies)"]
    p = doc.get("profile") or {}
    m = p.get("machine")
    where = (f"{m.get('cpu')}, {m.get('logical_cores')} logical cores" if isinstance(m, dict) else m) or "not stated"
    lines = [f"- simulated on cost profile `{p.get('path', 'see note')}` ({p.get('name') or 'unnamed'}; model {p.get('model') or 'n/a'}), "
             f"whose step times were measured on: {where}"]
    if "prefix_cache" in doc:
        lines.append(f"- prefix cache: {'on' if doc['prefix_cache'] else 'off'} (quanta serve's default is on)")
    return lines


def _pooled(c: dict, key: str) -> list[int]:
    return [s[key] for r in c.get("runs", []) for s in r["samples"] if s.get(key) is not None and not s.get("error")]


def _lengths_section(doc: dict) -> str:
    """Per condition: the per-request prompt and output tokens (usage) pooled over repeats, min / p50 / max.

    ``requests ok`` counts the requests that finished without error, the same ones ``exact outputs`` is
    over; where fewer reported usage, the output column says how many it is over.
    """
    from quanta.analysis.stats import percentile

    rows = ["| condition | requests ok | prompt tokens min / p50 / max | output tokens min / p50 / max | exact outputs (ignore_eos) |",
            "|---|---|---|---|---|"]
    for c in doc["conditions"]:
        p, o = _pooled(c, "prompt_tokens"), _pooled(c, "completion_tokens")
        if not p or not o:
            continue
        ok = [s for r in c["runs"] for s in r["samples"] if not s.get("error")]
        known = [s["ignore_eos"] for s in ok if s.get("ignore_eos") is not None]
        exact = f"{sum(known)}/{len(known)}" if known else "n/a"
        fmt = lambda xs: f"{min(xs)} / {percentile(xs, 50):g} / {max(xs)}"  # noqa: E731
        usage = f" ({len(o)} with usage)" if len(o) != len(ok) else ""
        rows.append(f"| {c['name']} | {len(ok)} | {fmt(p)} | {fmt(o)}{usage} | {exact} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def _trace_section(doc: dict) -> str:
    """A trace run: the window's own block reuse beside the prefix-hit share each condition got."""
    reuse = doc.get("trace_reuse")
    if not reuse:
        return ""
    lines = [f"The window's own reuse: {reuse['repeated_blocks']} of {reuse['blocks']} prompt blocks "
             f"({reuse['block_reuse']:.1%}) repeat a block an earlier request of the window sent; an unbounded "
             f"prefix cache could serve {reuse['prefix_reuse']:.1%} of the prompt tokens (leading repeated blocks of "
             f"{reuse['block_tokens']} tokens). The share a server got is cached / prompt tokens of its `usage`.", "",
             "| condition | prefix-hit share (median over repeats) | vs the window's prefix reuse |", "|---|---|---|"]
    for c in doc["conditions"]:
        if c.get("figures"):
            vals = [f.get("prefix_hit_share") for f in c["figures"]]
            med = median_iqr([math.nan if v is None else v for v in vals])[0]
            ratio = "n/a" if math.isnan(med) or not reuse["prefix_reuse"] else f"{med / reuse['prefix_reuse']:.2f}"
            lines.append(f"| {c['name']} | {fmt_spread([math.nan if v is None else v for v in vals], 100, 1)}% | {ratio} |")
    return "\n".join(lines)


def _scrape_notes(doc: dict) -> str:
    notes = {}
    for c in doc["conditions"]:
        for r in c.get("runs", []):
            why = r.get("metrics", {}).get("scrape_overlap_note")
            if why and doc.get("kind") != "simulate":
                notes.setdefault(why, []).append(c["name"])
    return "\n".join(f"- overlap (/metrics) n/a in {len(set(v))} condition(s) ({', '.join(dict.fromkeys(v))}): {k}"
                     for k, v in notes.items())


def _pool_section(doc: dict) -> str:
    """A simulation's KV pool table (:func:`quanta.sim.pool.markdown_section`); '' for a measured run."""
    if doc.get("kind") != "simulate":
        return ""
    from quanta.sim.pool import markdown_section

    return markdown_section(doc)


def markdown(doc: dict, plot_files: dict[str, str], title: str) -> str:
    """The report: context, how measured, headline table, frontier, other tables, errors, plots."""
    simulated = doc.get("kind") == "simulate"
    parts = [f"# {title}", "", f"- date: {doc['created']}", *_machine_lines(doc),
             f"- command: `{doc['command']}`",
             f"- code: quanta {doc.get('code') or 'unknown'}",
             f"- workload: {doc['workload_text']}",
             f"- repeats: {doc['repeats']} per condition"
             + (", interleaved: all servers up, round r measures every condition once (ratios to the baseline paired per round)"
                if doc.get("interleaved") else "" if simulated else ", one condition after the other")
             + f"; baseline for throughput ratios: {doc.get('baseline') or 'none'}"]
    if doc.get("note"):
        parts.append(f"- note: {doc['note']}")
    src = {f.get("itl_source") for c in doc["conditions"] for f in c.get("figures", [])}
    how = (["", "## How it was simulated", "", HOW_SIMULATED, "## What a simulation does not model", "",
            *[f"- {x}" for x in not_simulated(doc)], ""] if simulated else ["", "## How it was measured", "", HOW_MEASURED])
    parts += [*how,
              f"## Results (ITL source: {', '.join(sorted(s for s in src if s)) or 'n/a'}; median over repeats, IQR p25-p75)", "",
              main_table(doc["conditions"], doc.get("baseline"), bool(doc.get("interleaved"))), "",
              "## Pareto frontier (throughput up, p99 ITL down; non-dominated conditions)", "", frontier_lines(doc["conditions"]), "",
              "## Client-side latency (median (IQR) over repeats)", "", client_table(doc["conditions"], simulated), "",
              "## Busy time, rates and overlap (server trace / scrapes; n/a for servers without them)", "",
              rates_table(doc["conditions"], simulated), ""]
    notes = _scrape_notes(doc)
    if notes:
        parts += [notes, ""]
    for heading, text in (("Request lengths (tokens from usage, pooled over repeats)", _lengths_section(doc)),
                          ("Trace prefix reuse", _trace_section(doc)), ("Probe", _probe_section(doc)),
                          ("KV block pool (simulated; median over repeats)", _pool_section(doc))):
        if text:
            parts += [f"## {heading}", "", text, ""]
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
        f = prefix.with_name(prefix.name + "-itl-cdf.png")
        if plots.itl_cdf_plot(itl_by_condition(doc), str(f), title + ": ITL CDF"):
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
