"""The held-out runs re-fitted and re-simulated with two fronts: the fitted two stages, and one that keeps the send order.

For each run prefix of ``benchmarks/sim_holdout.sh`` (``PREFIX_fit_x4.json`` ... or ``PREFIX_rep_fit.json``),
this fits the profile again with this checkout's ``quanta profile-engine --from-bench`` (the fitting runs
only), writes a copy whose front keeps the send order (:func:`send_order`: the per-token term folded into
``request_s`` at ``--fold-tokens`` tokens, so no request passes one sent before it), and compares both
with the checked runs (``quanta simulate --compare ... --also-profile``). The profiles and comparisons go
to ``--work``; the table (each run's TTFT p50 error per checked row and its misses, and the totals) to
stdout and, with ``--out PREFIX``, PREFIX.md and PREFIX.json (rows, machine, date, command, code).

Never run in CI; about a minute per run prefix on a 2-core machine (``--draws`` 5).

Usage: ``python benchmarks/sim_front_sendorder.py --kind single --out benchmarks/results/sim_front_sendorder_avx512
benchmarks/results/sim_holdout_avx512{,b,c}``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's quanta, before an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quanta.sim.compare import FIGURES  # noqa: E402
from script_result import header, provenance, write_result  # noqa: E402

#: the workloads a run prefix holds, by kind: (fitted files, checked files)
FILES = {"single": (["fit_x4", "fit_x2", "fit_probe"], ["check_x4", "check_x2", "check_probe"]),
         "replicas": (["rep_fit"], ["rep_check"])}


def send_order(profile: dict, fold_tokens: int) -> dict:
    """A copy of ``profile`` (its JSON) whose front's per-token term is folded into ``request_s`` at
    ``fold_tokens`` prompt tokens: the loop stage, which keeps the send order, then holds all of the delay."""
    p = json.loads(json.dumps(profile))
    f = p["front"]
    f["request_s"] += f["prompt_token_s"] * fold_tokens
    f["prompt_token_s"] = 0.0
    return p


def held_out_parser(description: str, draws: int, work: str) -> argparse.ArgumentParser:
    """The command line the held-out re-fitting scripts share: run prefixes, ``--kind``, ``--draws``,
    ``--work``, ``--quanta``, ``--out``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("prefixes", nargs="+", metavar="PREFIX", help="a run prefix of benchmarks/sim_holdout.sh")
    ap.add_argument("--kind", choices=sorted(FILES), default="single")
    ap.add_argument("--draws", type=int, default=draws)
    ap.add_argument("--work", default=work, help="where the profiles and comparisons go")
    ap.add_argument("--quanta", default=str(REPO / ".venv/bin/quanta"))
    ap.add_argument("--out", help="write OUT.md and OUT.json")
    return ap


def work_dir(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """``--work``, made, once ``--draws`` is checked and every run file of ``args.prefixes`` is there (else
    ``ap.error``: exit 2, before any fit)."""
    if args.draws < 1:
        ap.error("--draws must be >= 1")
    missing = [f"{p}_{f}.json" for p in args.prefixes for f in sum(FILES[args.kind], []) if not Path(f"{p}_{f}.json").is_file()]
    if missing:
        ap.error(f"missing: {', '.join(missing)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    return work


def quanta(args: list[str], quanta_bin: str) -> None:
    subprocess.run([quanta_bin, *args], check=True, stdout=subprocess.DEVNULL, cwd=REPO)


def run_one(prefix: str, kind: str, work: Path, fold_tokens: int, draws: int, quanta_bin: str) -> dict:
    """Fit, vary and compare one run prefix; its summary (:func:`summarize`)."""
    fitted, checked = FILES[kind]
    name = f"{kind}_{Path(prefix).name}"
    prof, var, out = work / f"{name}_profile.json", work / f"{name}_sendorder.json", work / name
    quanta(["profile-engine", *[a for f in fitted for a in ("--from-bench", f"{prefix}_{f}.json")], "--out", str(prof)],
           quanta_bin)
    fitted_profile = json.loads(prof.read_text())
    if not fitted_profile.get("front"):
        raise SystemExit(f"{prefix}: its fitting runs gave no front model (no arrivals recorded): nothing to vary")
    var.write_text(json.dumps(send_order(fitted_profile, fold_tokens)))
    quanta(["simulate", "--profile", str(prof), "--also-profile", str(var), "--draws", str(draws),
            *[a for f in checked for a in ("--compare", f"{prefix}_{f}.json")], "--out", str(out)], quanta_bin)
    return summarize(Path(prefix).name, json.loads(out.with_suffix(".json").read_text()))


def summarize(run: str, doc: dict) -> dict:
    """Each checked row's label (file and condition) and, per front (``stages``: the profile's, ``send``: the
    variant's), its TTFT p50 error and the misses."""
    out = {"run": run, "labels": [f"{Path(r['source']).stem.removeprefix(run + '_')} {r['condition']}" for r in doc["rows"]]}
    for front, key in (("stages", "rows"), ("send", "also_rows")):
        rows = doc[key]
        out[front] = {"ttft_p50_error": [r["rel_error"]["ttft_p50"] for r in rows],
                      "misses": [f"{r['condition']}: {f}" for r in rows for f, _, _ in FIGURES
                                  if f in (r.get("misses") or [])]}
    return out


def markdown(summaries: list[dict]) -> str:
    """One line per run and one of totals (the checked rows are the first run's)."""
    rows = summaries[0]["labels"]
    head = ("| run | " + " | ".join(f"two stages: {r} TTFT p50" for r in rows) + " | two stages: misses | "
            + " | ".join(f"send order: {r} TTFT p50" for r in rows) + " | send order: misses |")
    lines = [head, "|" + "---|" * (2 * len(rows) + 3)]
    for s in summaries:
        cells = [s["run"]]
        for front in ("stages", "send"):
            cells += [f"{100 * e:+.0f}%" for e in s[front]["ttft_p50_error"]]
            cells.append(f"{len(s[front]['misses'])}: {', '.join(s[front]['misses'])}" if s[front]["misses"] else "0")
        lines.append("| " + " | ".join(cells) + " |")
    total = ["all"]
    for front in ("stages", "send"):
        errs = list(zip(*(s[front]["ttft_p50_error"] for s in summaries)))
        total += [f"mean {100 * statistics.mean(e):+.1f}%" for e in errs]
        total.append(str(sum(len(s[front]["misses"]) for s in summaries)))
    lines.append("| " + " | ".join(total) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = held_out_parser(__doc__.split("\n")[0], 5, "/tmp/sim_front_sendorder")
    ap.add_argument("--fold-tokens", type=int, default=200, help="prompt tokens the per-token term is folded in at")
    args = ap.parse_args(argv)
    if args.fold_tokens < 0 or args.draws < 1:
        ap.error("--fold-tokens must be >= 0 and --draws >= 1")
    work = work_dir(ap, args)
    summaries = [run_one(p, args.kind, work, args.fold_tokens, args.draws, args.quanta) for p in args.prefixes]
    table = markdown(summaries)
    print(table)
    if args.out:
        meta = provenance("sim_front_sendorder.py", argv)
        write_result(args.out, header("The held-out runs with the two-stage front and a send-order front", meta)
                     + f"\nTTFT p50: simulated / measured median - 1; misses: figures outside the measured min-max "
                     f"and more than 10% off.\n\n{table}\n", {"kind": "sim_front_sendorder", "runs": summaries}, meta)
    return 0

if __name__ == "__main__":
    sys.exit(main())
