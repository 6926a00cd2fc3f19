"""Join ``quanta bench`` results of the same workload and conditions, run at different times, into one result
whose conditions hold every run (their repeats), figures recomputed from the raw runs.

A shared machine's speed drifts over minutes; ``benchmarks/sim_holdout.sh`` runs its fitted and its checked
workloads in alternating rounds, one repeat each, and joins each workload's rounds here, so both sides sample
the same stretch of time and a condition's min-max shows the drift.

Usage: ``python benchmarks/merge_bench.py OUT.json IN.json [IN.json ...]``; exit 2 when the inputs differ in
workload or condition names.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's quanta, before an installed one
from quanta.bench.output import recompute, write_json  # noqa: E402


def merge(docs: list[dict]) -> dict:
    """The first document with every document's runs, condition by condition (ValueError: they do not match)."""
    first = docs[0]
    names = [c["name"] for c in first["conditions"]]
    for d in docs[1:]:
        if d["workload"] != first["workload"] or [c["name"] for c in d["conditions"]] != names:
            raise ValueError("the results differ in workload or condition names")
    out = json.loads(json.dumps(first))
    for i, cond in enumerate(out["conditions"]):
        cond["runs"] = [run for d in docs for run in d["conditions"][i].get("runs") or []]
        cond["valid"] = all(d["conditions"][i].get("valid", True) for d in docs)
    out["repeats"] = sum(d["repeats"] for d in docs)
    out["command"] = " ; ".join(d["command"] for d in docs)
    out["created"] = docs[-1]["created"]
    return recompute(out)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    try:
        doc = merge([json.loads(Path(p).read_text(encoding="utf-8")) for p in argv[2:]])
    except (OSError, ValueError, KeyError) as exc:
        print(f"merge_bench: error: {exc}", file=sys.stderr)
        return 2
    write_json(doc, Path(argv[1]))
    print(f"wrote {argv[1]} ({doc['repeats']} repeats per condition)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
