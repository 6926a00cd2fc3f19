"""The order a server's front hands a burst to the engine, measured and simulated.

A Mooncake window sends bursts of up to 16 requests within a few milliseconds; the order the front
hands them to the engine decides which prompt the batched scheduler prefills first, and with it the
window's tail time to first token. For each bench result this reads the measured order (each run's
requests paired with the trace's ``arrivals``: :func:`quanta.sim.front.paired`) and simulates every
measured repeat as ``quanta simulate --compare`` does (:func:`quanta.sim.compare.simulate_condition`,
``--draws`` runs each), then reduces both sides alike over the bursts (requests sent within 5 ms of the
one before, 3 or more of them):

- reversed: of the pairs of a burst, the share handed over in the other order than sent;
- first sent, first / last: the bursts whose first-sent request was handed over first / last;
- longest: over the bursts whose longest prompt has more than ``--long`` tokens, its mean place in the
  handover order (0 first, 1 last) and the share of them it was handed over last.

Inputs: ``--pair PROFILE=BENCH[,BENCH...]`` (repeatable), e.g. a profile of ``benchmarks/sim_holdout.sh``
and its checked windows. Prints a Markdown table; ``--out PREFIX`` also writes PREFIX.md and PREFIX.json
(rows, machine, date, command, code). Never run in CI; seconds per pair.

Usage: ``python benchmarks/sim_front_order.py --pair
benchmarks/results/sim_holdout_avx512_profile.json=benchmarks/results/sim_holdout_avx512_check_x4.json,benchmarks/results/sim_holdout_avx512_check_x2.json``
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's quanta, before an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quanta.bench.workloads import Workload  # noqa: E402
from quanta.sim.compare import simulate_condition  # noqa: E402
from quanta.sim.front import BURST_S, paired  # noqa: E402
from quanta.sim.profile import Profile  # noqa: E402
from script_result import provenance, write_result  # noqa: E402

#: bursts of fewer requests than this are left out
MIN_BURST = 3


def bursts(run: dict, min_size: int = MIN_BURST) -> list[list[tuple[float, int, float]]]:
    """The run's bursts of ``min_size`` requests or more, each ``(sent, prompt tokens, handed over)`` per
    request in send order."""
    reqs = sorted((s["sent"], a[3], a[1]) for s, a in paired(run) or [])
    out, cur = [], reqs[:1]
    for r in reqs[1:]:
        if r[0] - cur[-1][0] <= BURST_S:
            cur.append(r)
        else:
            out.append(cur)
            cur = [r]
    return [b for b in out + [cur] if len(b) >= min_size]


def tally(runs: list[dict], long_tokens: int, st: Counter | None = None) -> Counter:
    """Add the order counts of ``runs``' bursts to ``st``."""
    st = Counter() if st is None else st
    for run in runs:
        for b in bursts(run):
            place = {i: k for k, i in enumerate(sorted(range(len(b)), key=lambda i: b[i][2]))}
            last = len(b) - 1
            st["bursts"] += 1
            st["first_first"] += place[0] == 0
            st["first_last"] += place[0] == last
            for i, j in itertools.combinations(range(len(b)), 2):
                st["pairs"] += 1
                st["reversed"] += place[j] < place[i]
            longest = max(range(len(b)), key=lambda i: b[i][1])
            if b[longest][1] > long_tokens:
                st["long"] += 1
                st["long_place"] += place[longest] / last
                st["long_last"] += place[longest] == last
    return st


def shares(st: Counter) -> dict:
    def of(k, n):
        return st[k] / st[n] if st[n] else float("nan")

    return {"bursts": st["bursts"], "reversed": of("reversed", "pairs"), "first_first": of("first_first", "bursts"),
            "first_last": of("first_last", "bursts"), "long_bursts": st["long"], "long_place": of("long_place", "long"),
            "long_last": of("long_last", "long")}


def pair_rows(profile_path: str, bench_paths: list[str], draws: int, long_tokens: int) -> dict:
    profile = Profile.load(profile_path)
    measured, simulated = Counter(), Counter()
    for path in bench_paths:
        doc = json.loads(Path(path).read_text())
        w = Workload.from_dict(doc["workload"])
        for cond in doc["conditions"]:
            if cond.get("valid", True) and cond.get("runs"):
                tally(cond["runs"], long_tokens, measured)
                tally(simulate_condition(profile, cond, w, 3600.0, draws), long_tokens, simulated)
    return {"profile": profile_path, "bench": bench_paths, "measured": shares(measured), "simulated": shares(simulated),
            "counts": {"measured": dict(measured), "simulated": dict(simulated)}}


def table(rows: list[dict]) -> str:
    head = ("| profile | bursts meas / sim | reversed pairs | first sent, handed first | first sent, handed last "
            "| longest: mean place | longest: handed last |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        m, s = r["measured"], r["simulated"]
        cells = [f"{m[k]:.2f} / {s[k]:.2f}" for k in ("reversed", "first_first", "first_last", "long_place", "long_last")]
        lines.append(f"| {Path(r['profile']).name} | {m['bursts']} / {s['bursts']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", action="append", required=True, metavar="PROFILE=BENCH[,BENCH...]")
    ap.add_argument("--draws", type=int, default=3, help="simulated runs per measured repeat (default 3)")
    ap.add_argument("--long", type=int, default=2000, metavar="TOKENS",
                    help="a burst's longest prompt counts above this many tokens (default 2000)")
    ap.add_argument("--out", help="also write OUT.md and OUT.json")
    args = ap.parse_args(argv)
    pairs = []
    for p in args.pair:
        profile, sep, benches = p.partition("=")
        if not sep or not benches:
            ap.error(f"--pair {p!r}: expected PROFILE=BENCH[,BENCH...]")
        pairs.append((profile, benches.split(",")))
    rows = [pair_rows(profile, benches, args.draws, args.long) for profile, benches in pairs]
    total = {k: sum((Counter(r["counts"][k]) for r in rows), Counter()) for k in ("measured", "simulated")}
    rows.append({"profile": "all", "bench": [], "measured": shares(total["measured"]),
                 "simulated": shares(total["simulated"]), "counts": {k: dict(v) for k, v in total.items()}})
    text = table(rows)
    print(text)
    if args.out:
        meta = provenance("sim_front_order.py", argv)
        write_result(args.out, f"Measured / simulated ({args.draws} draws per measured repeat). {meta['created']}, "
                     f"code {meta['code']}.\n\n`{meta['command']}`\n\n{text}\n",
                     {"rows": rows}, meta)  # a share with no burst to count is NaN: written as null
    return 0


if __name__ == "__main__":
    sys.exit(main())
