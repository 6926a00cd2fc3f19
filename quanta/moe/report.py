"""Printing, plotting and storing a prefill cost report (see :mod:`quanta.moe.prefill_cost`).

Files written by :func:`write_report` (``STEM`` = ``moe_profile_<model>``,
``prefill_profile_<model>`` for a dense model):
``STEM.json`` (everything, machine included), ``STEM.md`` (the tables) and
``STEM.png`` (the curve). A copy of the JSON goes to
:func:`cost_report_cache_path` so ``quanta advise`` and
``quanta serve --mixed-prefill-quantum auto`` find the measured saturation
point for that model on this machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def cost_report_cache_path(model_name: str) -> Path:
    """``$XDG_CACHE_HOME/quanta/profiles/<model_name>.json`` (``~/.cache`` when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "quanta" / "profiles" / f"{model_name}.json"


def _ms(s: dict) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def format_report(report: dict) -> str:
    """Markdown: header (model, label, machine, method), cost-curve table, fragmentation table."""
    m, mach, meth = report["model"], report["machine"], report["method"]
    moe = m.get("num_experts") is not None
    lines = [f"# Prefill cost per token against the quantum: {m['name']}", ""]
    if report.get("synthetic"):
        lines += [f"**Synthetic model: {report['synthetic']}.**", ""]
    shape = f"{m['architecture']}, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, {m['parameters'] / 1e6:.0f} M parameters"
    if moe:
        shape += (f"; {m['num_moe_layers']} MoE layers, E={m['num_experts']} routed experts of width "
                  f"{m['moe_intermediate_size']}, top-k K={m['top_k']}, shared expert width {m['shared_expert_intermediate_size'] or 0}")
    lines += [f"- Model: {shape}",
              f"- Machine: {mach['cpu']} ({mach['cpu_flags']}), {mach['cores']} cores, torch threads {mach['torch_threads']}, "
              f"{mach['memory_gib']} GiB; torch {mach['torch']}, Python {mach['python']}; {mach['date']}, quanta {mach['quanta_commit']}; "
              f"load average before/after {mach['loadavg_before']} / {mach['loadavg_after']}",
              f"- Method: {meth['prompt_tokens']}-token prompt, pure prefill ({meth['scheduler']}), {meth['dtype']}; "
              f"{meth['timing']}; {meth['repeats']} repeats interleaved, {meth['statistic']}.", ""]
    if moe:
        lines += ["| quantum | calls | unique experts (random-routing expectation) | tokens per expert Q·K/E | tokens per active expert "
                  "| ms per token, median (min-max) | ratio to best | MoE blocks ms per token | MoE ratio to best |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["rows"]:
            lines.append(f"| {r['quantum']} | {r['calls']} | {r['unique_experts']:.1f} ({r['unique_experts_expected']:.1f}) | "
                         f"{r['tokens_per_expert']:.1f} | {r['tokens_per_active_expert']:.1f} | {_ms(r['ms_per_token'])} | "
                         f"{r['ratio_to_best']:.2f} | {_ms(r['moe_ms_per_token'])} | {r['moe_ratio_to_best']:.2f} |")
        sat = report.get("saturation_tokens_per_expert")
        lines += ["", f"Saturation point ({meth.get('saturation_rule', 'smallest tokens per expert near the best')}, "
                  f"{meth['saturation_tolerance']:.0%}): **{sat:g} tokens per expert**." if sat is not None else "",
                  "", "ms per token: whole prefill steps (what a client waits); MoE blocks: router to output only. "
                  "The whole-step figure also carries attention, whose chunked work grows with Q and whose single-chunk "
                  "run (Q = prompt) takes the causal fast path."]
    else:
        lines += ["| quantum | calls | ms per token, median (min-max) | ratio to best |", "|---:|---:|---:|---:|"]
        for r in report["rows"]:
            lines.append(f"| {r['quantum']} | {r['calls']} | {_ms(r['ms_per_token'])} | {r['ratio_to_best']:.2f} |")
    d = report["decode_step_ms"]
    lines += ["", f"Decode step ({d['sequences']} sequence, {d['context_tokens']}-token context): {_ms(d)} ms, {len(d['runs'])} steps."]
    frag = report.get("fragmentation")
    if frag:
        lines += ["", f"## Fragmentation: quantum {frag['quantum']}, prefill cap lowered", "",
                  "| prefill cap | calls | chunk sizes | calls ratio | ms per token, median (min-max) | cost ratio |",
                  "|---:|---:|---|---:|---:|---:|"]
        for r in frag["rows"]:
            lines.append(f"| {r['prefill_cap']} | {r['calls']} | {' '.join(map(str, r['chunk_tokens']))} | {r['calls_ratio']:.2f} | "
                         f"{_ms(r['ms_per_token'])} | {r['cost_ratio']:.3f} |")
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: Path) -> None:
    """PNG: ms per token (median, min-max bars) against the quantum; unique experts measured vs expected."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    q = [r["quantum"] for r in rows]
    med = [r["ms_per_token"]["median"] for r in rows]
    err = [[m - r["ms_per_token"]["min"] for m, r in zip(med, rows)], [r["ms_per_token"]["max"] - m for m, r in zip(med, rows)]]
    moe = "unique_experts" in rows[0]
    fig, axes = plt.subplots(1, 2 if moe else 1, figsize=(11 if moe else 6, 4.2), squeeze=False)
    ax = axes[0][0]
    ax.errorbar(q, med, yerr=err, marker="o", capsize=3, label="whole prefill step")
    if moe:
        mmed = [r["moe_ms_per_token"]["median"] for r in rows]
        merr = [[m - r["moe_ms_per_token"]["min"] for m, r in zip(mmed, rows)],
                [r["moe_ms_per_token"]["max"] - m for m, r in zip(mmed, rows)]]
        ax.errorbar(q, mmed, yerr=merr, marker="s", capsize=3, label="MoE blocks only")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefill quantum Q (tokens per chunk)")
    ax.set_ylabel("ms per prompt token (median, min-max)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if moe:
        top = ax.secondary_xaxis("top", functions=(lambda x: x * rows[0]["tokens_per_expert"] / q[0],
                                                   lambda t: t * q[0] / rows[0]["tokens_per_expert"]))
        top.set_xlabel("tokens per expert Q·K/E")
        sat = report.get("saturation_tokens_per_expert")
        if sat:
            ax.axvline(sat * q[0] / rows[0]["tokens_per_expert"], ls="--", c="gray", label=f"saturation: {sat:g} tokens/expert")
        ax.legend()
        ax2 = axes[0][1]
        ax2.plot(q, [r["unique_experts"] for r in rows], "o-", label="measured (mean over layers and chunks)")
        ax2.plot(q, [r["unique_experts_expected"] for r in rows], "x--", label="E·(1-(1-K/E)^Q), random routing")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("prefill quantum Q")
        ax2.set_ylabel("unique experts per chunk")
        ax2.set_ylim(0, report["model"]["num_experts"] * 1.05)
        ax2.legend()
        ax2.grid(alpha=0.3)
    title = f"{report['model']['name']}: prefill cost per token"
    if report.get("synthetic"):
        title += " (synthetic random-weight model)"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out_dir: str | Path, cache: bool = True) -> list[Path]:
    """Write JSON, Markdown and PNG under ``out_dir`` (and the JSON to the cache); returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "moe" if report["model"].get("num_experts") else "prefill"
    stem = f"{kind}_profile_{report['model']['name']}"  # names may hold dots (GGUF stems): no with_suffix
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(format_report(report))
    plot(report, paths[2])
    if cache:
        target = cost_report_cache_path(report["model"]["name"])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(paths[0].read_text())
        paths.append(target)
    return paths
