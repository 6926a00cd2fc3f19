"""The held-out runs re-fitted and re-simulated with the front's loop queue (``loop_s``) and without it.

For each run prefix of ``benchmarks/sim_holdout.sh``, this fits the profile again with this checkout's
``quanta profile-engine --from-bench`` (the fitting runs only; its front has ``loop_s``, the event loop
taking a burst's requests one at a time), writes a copy whose front is fitted on the same runs without it
(``quanta.sim.front.fit_front(runs, loop=False)``: the slope on the prompt sizes alone, a burst leaving the
loop at once), and compares both with the fitting runs (in sample) and the checked runs (held out):
``quanta simulate --compare ... --also-profile``. The table gives each file's TTFT p50 and p99 error under
each front and the misses; stdout and, with ``--out PREFIX``, PREFIX.md and PREFIX.json (rows, machine,
date, command, code).

Never run in CI; about a minute per run prefix on a 2-core machine (``--draws`` 4).

Usage: ``python benchmarks/sim_front_loop.py --kind single --out benchmarks/results/sim_front_loop_avx512
benchmarks/results/sim_holdout_avx512{,b,c}``
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's quanta, before an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quanta.sim.compare import FIGURES  # noqa: E402
from quanta.sim.front import fit_front  # noqa: E402
from script_result import header, provenance, write_result  # noqa: E402
from sim_front_sendorder import FILES, held_out_parser, quanta, work_dir  # noqa: E402

#: the fronts compared, in table order: (key, label)
FRONTS = (("loop", "loop queue"), ("pooled", "no loop queue"))


def without_loop(profile: dict, fitting_docs: list[dict]) -> dict:
    """A copy of ``profile`` (its JSON) whose front is fitted on the runs of ``fitting_docs`` without ``loop_s``
    (the response delay kept)."""
    runs = [run for doc in fitting_docs for cond in doc["conditions"] for run in cond.get("runs") or []]
    front = fit_front(runs, loop=False)
    if front is None:
        raise SystemExit("the fitting runs gave no front model (no arrivals recorded): nothing to compare")
    p = json.loads(json.dumps(profile))
    p["front"] = {**front.to_dict(), "response_s": profile["front"]["response_s"]}
    return p


def run_one(prefix: str, kind: str, work: Path, draws: int, quanta_bin: str) -> dict:
    """Fit, vary and compare one run prefix; its summary (:func:`summarize`)."""
    fitted, checked = FILES[kind]
    name = f"{kind}_{Path(prefix).name}"
    prof, var, out = work / f"{name}_profile.json", work / f"{name}_noloop.json", work / f"{name}_loop"
    fitting = [f"{prefix}_{f}.json" for f in fitted]
    quanta(["profile-engine", *[a for f in fitting for a in ("--from-bench", f)], "--out", str(prof)], quanta_bin)
    profile = json.loads(prof.read_text())
    if not profile.get("front"):
        raise SystemExit(f"{prefix}: its fitting runs gave no front model (no arrivals recorded): nothing to compare")
    var.write_text(json.dumps(without_loop(profile, [json.loads(Path(f).read_text()) for f in fitting])))
    quanta(["simulate", "--profile", str(prof), "--also-profile", str(var), "--draws", str(draws),
            *[a for f in fitted + checked for a in ("--compare", f"{prefix}_{f}.json")], "--out", str(out)], quanta_bin)
    summary = summarize(Path(prefix).name, json.loads(out.with_suffix(".json").read_text()), set(checked))
    summary["loop_s"] = profile["front"].get("loop_s", 0.0)
    return summary


def summarize(run: str, doc: dict, checked: set[str]) -> dict:
    """Each row's label (file and condition; held out or fitted) and, per front, its TTFT p50 and p99 errors
    and the misses of the held-out rows."""
    stems = [Path(r["source"]).stem.removeprefix(run + "_") for r in doc["rows"]]
    out = {"run": run, "labels": [f"{s} {r['condition']}" for s, r in zip(stems, doc["rows"])],
           "held_out": [s in checked for s in stems]}
    for front, key in (("loop", "rows"), ("pooled", "also_rows")):
        rows = doc[key]
        out[front] = {"ttft_p50_error": [r["rel_error"]["ttft_p50"] for r in rows],
                      "ttft_p99_error": [r["rel_error"]["ttft_p99"] for r in rows],
                      "misses": [f"{s}: {f}" for s, r in zip(stems, rows) if s in checked
                                 for f, _, _ in FIGURES if f in (r.get("misses") or [])],
                      "fitted_misses": sum(len(r.get("misses") or []) for s, r in zip(stems, rows) if s not in checked)}
    return out


def markdown(summaries: list[dict]) -> str:
    """Per front: one line per run (each row's TTFT p50 / p99 error, held-out misses, in-sample miss count)
    and a line of means."""
    labels, lines = summaries[0]["labels"], []
    for front, label in FRONTS:
        lines += [f"With the {label}:", "", "| run | " + " | ".join(f"{x} TTFT p50 / p99" for x in labels)
                  + " | held-out misses | in-sample misses |", "|" + "---|" * (len(labels) + 3)]
        for s in summaries:
            f = s[front]
            cells = [f"{100 * a:+.0f}% / {100 * b:+.0f}%" for a, b in zip(f["ttft_p50_error"], f["ttft_p99_error"])]
            held = f"{len(f['misses'])}: {', '.join(f['misses'])}" if f["misses"] else "0"
            lines.append(f"| {s['run']} | " + " | ".join(cells) + f" | {held} | {f['fitted_misses']} |")
        means = [f"mean {100 * statistics.mean(a):+.1f}% / {100 * statistics.mean(b):+.1f}%"
                 for a, b in zip(zip(*(s[front]["ttft_p50_error"] for s in summaries)),
                                 zip(*(s[front]["ttft_p99_error"] for s in summaries)))]
        lines += ["| all | " + " | ".join(means) + f" | {sum(len(s[front]['misses']) for s in summaries)} | "
                  f"{sum(s[front]['fitted_misses'] for s in summaries)} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = held_out_parser(__doc__.split("\n")[0], 4, "/tmp/sim_front_loop")
    args = ap.parse_args(argv)
    work = work_dir(ap, args)
    summaries = [run_one(p, args.kind, work, args.draws, args.quanta) for p in args.prefixes]
    table = markdown(summaries)
    print(table)
    if args.out:
        meta = provenance("sim_front_loop.py", argv)
        write_result(args.out, header("The held-out runs with and without the front's loop queue", meta)
                     + f"\nEach cell: TTFT p50 / p99, simulated / measured median - 1; misses: figures outside the "
                     f"measured min-max and more than 10% off.\n\n{table}\n", {"kind": "sim_front_loop", "runs": summaries}, meta)
    return 0

if __name__ == "__main__":
    sys.exit(main())
