"""How a server's front hands a burst over: in pairs by prompt size, and what delays a burst's first request.

Reads bench results whose runs recorded the trace's ``arrivals`` (paired with the requests by
:func:`quanta.sim.front.paired`) and reduces the bursts (requests sent within 5 ms of the one before, 2 or
more of them; :func:`sim_front_order.bursts`) two ways:

- **pairs by size**: every pair of a burst, by the prompt sizes of its first- and second-sent request
  (S under 500 tokens, M under 1,500, L the rest): the share handed over in the other order than sent,
  and, with ``--profile``, the share the profile's front model (:class:`quanta.sim.front.FrontStages`,
  its residuals drawn ``--draws`` times per run) hands over reversed for the same sends;
- **first-sent delay**: per group of files (an argument, its files joined by commas), the least-squares
  line of the first-sent request's delay (handed over minus sent) on its own prompt tokens, the tokens
  of the requests sent after it in its burst, and their count. A front that hands each request over on
  its own way leaves the later ones' terms at 0; a front that hands a burst over once it has taken all
  of it charges them to the first.

Prints Markdown tables; ``--out PREFIX`` also writes PREFIX.md and PREFIX.json (rows, machine, date,
command, code). Never run in CI; seconds per file.

Usage: ``python benchmarks/sim_front_bursts.py --profile benchmarks/results/sim_holdout_avx512h_profile.json
benchmarks/results/sim_holdout_avx512h_fit_x4.json,benchmarks/results/sim_holdout_avx512h_check_x4.json``
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's quanta, before an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quanta.sim.front import FrontModel  # noqa: E402
from quanta.sim.profile import Profile  # noqa: E402
from script_result import provenance, write_result  # noqa: E402
from sim_front_order import bursts  # noqa: E402

#: upper bounds (tokens, exclusive) of the size classes S and M; L is the rest
SIZE_BOUNDS = (500, 1500)
CLASSES = ("S", "M", "L")


def size_class(tokens: int) -> str:
    return next((c for c, b in zip(CLASSES, SIZE_BOUNDS) if tokens < b), CLASSES[-1])


def pair_counts(groups: list[list[tuple[float, int, float]]], st: Counter | None = None) -> Counter:
    """Add each burst pair's ``(first class, second class)`` count and reversals (``"rev", ...``) to ``st``."""
    st = Counter() if st is None else st
    for b in groups:
        for i in range(len(b)):
            for j in range(i + 1, len(b)):
                key = (size_class(b[i][1]), size_class(b[j][1]))
                st[key] += 1
                st[("rev", *key)] += b[j][2] < b[i][2]
    return st


def through_front(groups: list[list[tuple[float, int, float]]], front: FrontModel,
                  rng: random.Random) -> list[list[tuple[float, int, float]]]:
    """The same bursts with the handovers ``front`` gives their sends (all of a run's bursts, in send order)."""
    stages = front.stages(rng)
    return [[(s, n, stages.cross(s, n)) for s, n, _ in b] for b in groups]


def first_delay_fit(groups: list[list[tuple[float, int, float]]]) -> dict:
    """Least squares of the first-sent request's delay on ``[1, own tokens, later tokens, later count]``
    (seconds; the count's coefficient in seconds per request, the tokens' per token)."""
    x = np.array([[1.0, b[0][1], sum(n for _, n, _ in b[1:]), len(b) - 1] for b in groups], dtype=float)
    y = np.array([b[0][2] - b[0][0] for b in groups], dtype=float)
    if len(y) < x.shape[1]:
        return {"bursts": len(y)}
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    return {"bursts": len(y), "intercept_s": float(coef[0]), "own_s_per_token": float(coef[1]),
            "later_s_per_token": float(coef[2]), "later_s_per_request": float(coef[3])}


def file_groups(path: str) -> list[list[list[tuple[float, int, float]]]]:
    """Each run's bursts of 2 or more of a bench result (every valid condition)."""
    doc = json.loads(Path(path).read_text())
    return [bursts(run, min_size=2) for c in doc["conditions"] if c.get("valid", True) for run in c.get("runs") or []]


def shares_table(measured: Counter, modelled: Counter | None) -> str:
    lines = ["| first sent | second sent | pairs | handed over reversed: measured | front model |", "|---|---|---|---|---|"]
    for a in CLASSES:
        for b in CLASSES:
            if measured[(a, b)]:
                sim = f"{modelled[('rev', a, b)] / modelled[(a, b)]:.0%}" if modelled and modelled[(a, b)] else "-"
                lines.append(f"| {a} | {b} | {measured[(a, b)]} | {measured[('rev', a, b)] / measured[(a, b)]:.0%} | {sim} |")
    return "\n".join(lines)


def fit_table(fits: dict[str, dict]) -> str:
    lines = ["| files | bursts | intercept ms | own us/token | later us/token | later ms/request |", "|---|---|---|---|---|---|"]
    for path, f in fits.items():
        if "intercept_s" in f:
            names = ", ".join(Path(p).name for p in path.split(","))
            lines.append(f"| {names} | {f['bursts']} | {f['intercept_s'] * 1e3:.1f} | {f['own_s_per_token'] * 1e6:.2f} "
                         f"| {f['later_s_per_token'] * 1e6:.2f} | {f['later_s_per_request'] * 1e3:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench", nargs="+", metavar="BENCH[,BENCH...]",
                    help="quanta bench results with the trace's arrivals; the files of one argument are fitted together")
    ap.add_argument("--profile", help="a profile whose front model hands the same sends over")
    ap.add_argument("--draws", type=int, default=4, help="front-model draws per run (default 4)")
    ap.add_argument("--out", help="also write OUT.md and OUT.json")
    args = ap.parse_args(argv)
    front = Profile.load(args.profile).front if args.profile else None
    if args.profile and front is None:
        ap.error(f"--profile {args.profile}: no front model")
    measured, modelled, fits = Counter(), Counter() if front else None, {}
    for arg in args.bench:
        runs = [(path, groups) for path in arg.split(",") for groups in file_groups(path)]
        fits[arg] = first_delay_fit([b for _, groups in runs for b in groups])
        for r, (path, groups) in enumerate(runs):
            pair_counts(groups, measured)
            for k in range(args.draws if front else 0):
                pair_counts(through_front(groups, front, random.Random(f"{path}/{r}/{k}")), modelled)
    text = ("Pairs of a burst by prompt size (S < 500 tokens, M < 1,500, L the rest):\n\n" + shares_table(measured, modelled)
            + "\n\nThe first-sent request's delay, least squares over the bursts of 2 or more:\n\n" + fit_table(fits))
    print(text)
    if args.out:
        meta = provenance("sim_front_bursts.py", argv)
        pairs = {f"{a}{b}": {"pairs": measured[(a, b)], "reversed": measured[("rev", a, b)],
                             **({"model_pairs": modelled[(a, b)], "model_reversed": modelled[("rev", a, b)]} if front else {})}
                 for a in CLASSES for b in CLASSES}
        write_result(args.out, f"{meta['created']}, code {meta['code']}.\n\n`{meta['command']}`\n\n{text}\n",
                     {"pairs": pairs, "first_delay": fits}, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
