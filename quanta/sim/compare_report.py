"""The report of a simulated vs measured comparison (:mod:`quanta.sim.compare`): Markdown tables and lines."""

from __future__ import annotations

import math

from quanta.sim.compare import FIGURES, STEPS, TOLERANCE
from quanta.sim.profile import Profile


def _cell(row: dict, key: str, scale: float) -> str:
    m = row["measured"][key][0]
    s = row["simulated"][key][0]
    if math.isnan(m):
        return f"{s * scale:.1f} / -"
    lo, hi = row["spread"][key]
    mark = " **miss**" if key in row["misses"] else " out" if key in row["outside"] else ""
    return f"{s * scale:.1f} / {m * scale:.1f} ({lo * scale:.1f}-{hi * scale:.1f}) {row['rel_error'][key]:+.0%}{mark}"


def _steps(row: dict, which: str) -> str:
    return "/".join("-" if math.isnan(row[which][k][0]) else f"{row[which][k][0]:g}" for k in STEPS)


def markdown_table(rows: list[dict]) -> str:
    """One line per condition: simulated / measured median (measured min-max) and the relative error of each
    figure, ``out`` when the simulated median is outside the measured spread, ``**miss**`` when it is also
    more than :data:`TOLERANCE` from the measured median."""
    head = "| condition | " + " | ".join(f"{h}: sim / meas (min-max) err" for _, h, _ in FIGURES) + " | steps p/d/m sim vs meas |"
    lines = [head, "|---|" + "---|" * (len(FIGURES) + 1)]
    for r in rows:
        cells = [_cell(r, k, s) for k, _, s in FIGURES]
        lines.append(f"| {r['condition']} | " + " | ".join(cells) + f" | {_steps(r, 'simulated')} vs {_steps(r, 'measured')} |")
    return "\n".join(lines)


def ratio_table(ratios: list[dict]) -> str:
    """Markdown: simulated / measured ratio (the measured ratio's min-max over repeats) and its error, per
    figure, for :func:`~quanta.sim.compare.ratio_rows`, marked as figures are (:func:`markdown_table`)."""
    head = "| conditions | " + " | ".join(f"{h}: sim / meas ratio (min-max) err" for _, h, _ in FIGURES) + " |"
    lines = [head, "|---|" + "---|" * len(FIGURES)]
    for r in ratios:
        cells = ["-" if math.isnan(r["rel_error"][k]) else _ratio_cell(r, k) for k, _, _ in FIGURES]
        lines.append(f"| {r['condition']} over {r['over']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio_cell(r: dict, key: str) -> str:
    lo, hi = r.get("spread", {}).get(key, (math.nan, math.nan))
    spread = "" if math.isnan(lo) else f" ({lo:.2f}-{hi:.2f})"
    mark = " **miss**" if key in r.get("misses", []) else " out" if key in r.get("outside", []) else ""
    return f"{r['ratio'][key][0]:.2f} / {r['ratio'][key][1]:.2f}{spread} {r['rel_error'][key]:+.0%}{mark}"


def summary_lines(summ: dict) -> str:
    per = ", ".join(f"{h} {summ[k]:.0%}" for k, h, _ in FIGURES)
    misses = (f" {summ['misses']} of {summ['figures']} figures are outside the measured min-max and more than "
              f"{TOLERANCE:.0%} from the measured median." if "misses" in summ else "")
    return f"Median absolute relative error: **{summ['all']:.0%}** over all figures; per figure: {per}.{misses}" + _chance_text(summ)


def _chance_text(summ: dict) -> str:
    c = summ.get("chance")
    if not c:
        return ""
    return (f" By chance, with these repeats, an exact simulator would miss {c['mean']:.2f} of them (each of its "
            f"{c['draws']} draws per repeat taken as the measured repeats, the others as the simulation: "
            f"{' '.join(map(str, c['misses']))}; none in {c['none']:.0%} of them).")


def _profile_line(label: str, path: str, p: Profile) -> str:
    dec = ", ".join(f"B={b:g} {t * 1e3:.1f} ms" for b, t in p.decode_points)
    pre = ", ".join(f"{n:g}: {t * 1e3:.2f}" for n, t in p.prefill_points)
    return (f"- {label} `{path}` ({p.meta.get('created', 'undated')}): overhead {p.overhead_s * 1e3:.1f} ms/call; decode "
            f"step net of overhead {dec}; prefill ms/token by chunk {pre}; context {p.prefill_ctx * 1e9:.1f} ns/token/pos "
            f"(prefill), {p.decode_ctx * 1e9:.1f} ns/pos (decode)" + _step_model_text(p))


def _step_model_text(p: Profile) -> str:
    m = p.step_model
    if m is None:
        return ""
    wake = f", a step after {p.wake.idle_s:g} s of idle engine {p.wake.factor:.2f}x" if p.wake else ""
    return (f"; step model: interference {m.interference_s_per_row * 1e3:.2f} ms per decode row beside prompt rows, "
            f"prefix hit {m.prefix_hit_s_per_token * 1e9:.1f} ns/token, threads {m.threads or 'unknown'}{wake}")


def markdown(doc: dict, profiles: dict[str, Profile], title: str) -> str:
    """The report: how it was made, the table, the error summary (and the same with the second profile)."""
    from quanta.bench.output import machine_text

    sources = sorted({r["source"] for r in doc["rows"]})
    out = [f"# {title}", "", f"- date: {doc['created']}",
           f"- machine: {machine_text(doc['machine'])}, Python {doc['machine']['python']}",
           f"- command: `{doc['command']}`", f"- code: quanta {doc['code']}",
           "- measured: " + ", ".join(f"`{s}`" for s in sources) + " (quanta bench over HTTP; each row's workload is "
           "that file's; TTFT from the client, the other figures from the server trace; medians over repeats, "
           "each cell with the measured min-max)",
           _profile_line("profile", doc["profile"], profiles[doc["profile"]])]
    if "also_profile" in doc:
        out.append(_profile_line("second profile", doc["also_profile"], profiles[doc["also_profile"]]))
    if doc.get("replay_front"):
        out.append("- front: replayed (each request reached the simulated engine when the measured front handed it over; "
                   "the profile's front model priced only the tokens' way back)")
    out += ["", "Each cell: simulated / measured median (measured min-max over repeats) relative error; `out`: the "
            "simulated median is outside the measured min-max, `**miss**`: and more than "
            f"{TOLERANCE:.0%} from the measured median. Steps: prefill calls / decode "
            "steps / mixed steps (median over repeats), simulated vs measured.", "", markdown_table(doc["rows"]), "",
            summary_lines(doc["summary"])]
    if doc.get("ratios"):
        out += ["", "Between the conditions of one measured file (each over the file's first condition): the ratio of "
                "each figure, simulated / measured, and the simulated ratio's relative error:", "", ratio_table(doc["ratios"])]
    if "also_profile" in doc:
        out += ["", f"With the second profile (`{doc['also_profile']}`):", "",
                markdown_table(doc["also_rows"]), "", summary_lines(doc["also_summary"])]
    return "\n".join(out) + "\n"
