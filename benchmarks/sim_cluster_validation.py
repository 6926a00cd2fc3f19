"""Simulated vs measured replicas: ``quanta simulate`` of the ``cluster_routing`` workload on one server
and on 2 replicas per routing policy, beside what the real runs measured.

Reads the raw ``quanta bench`` results of ``benchmarks/cluster_routing.py`` (one per condition:
``PREFIX_single.json``, ``PREFIX_prefix.json``, ``PREFIX_round-robin.json``, and the figures it
printed, ``PREFIX.json``) and replays each condition as ``quanta simulate --compare`` does
(:func:`quanta.sim.compare.simulate_condition`: the scheduler and KV pool the server reported, the
same workload and seeds, each request's output length; a cluster condition on as many simulated
replicas behind the same router policy, with the load bound and load weight its front reported, or,
for a front that reported none, the pure affinity it had). Both sides are reduced by
``cluster_routing.figures``: prefix-hit share, prompt tokens computed, TTFT of turns 2-4, end-to-end,
requests per replica. ``--extra-load-tokens N`` adds a predicted-only row: the prefix condition
with the prefix router's load weight set to N.

Profiles: ``--profile LABEL=PATH[,REPLICA_PATH]`` (repeatable): the one-server condition is simulated
with PATH, the replica conditions with REPLICA_PATH (default PATH), e.g. a profile measured on one
core for replicas that had one core each. Prints a Markdown table; ``--out PREFIX`` also writes
PREFIX.json (the rows, machine, date, command). Never run in CI; seconds per profile.

Usage: ``python benchmarks/sim_cluster_validation.py [--measured benchmarks/results/cluster_routing]
--profile fitted=benchmarks/results/sim_validation_profile.json [--out PREFIX]``
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's quanta, before an installed one
sys.path.insert(0, str(Path(__file__).parent))
from cluster_routing import cpu_flags, figures, table  # noqa: E402
from quanta.bench.output import code_version, machine  # noqa: E402
from quanta.bench.workloads import Workload  # noqa: E402
from quanta.sim.compare import simulate_condition  # noqa: E402
from quanta.sim.profile import Profile  # noqa: E402

CONDITIONS = ("single", "prefix", "round-robin")


def measured(prefix: Path, name: str) -> tuple[Workload, dict]:
    """The workload and the one condition of the raw bench result of condition ``name``."""
    doc = json.loads(prefix.with_name(f"{prefix.name}_{name}.json").read_text(encoding="utf-8"))
    return Workload.from_dict(doc["workload"]), doc["conditions"][0]


def measured_routed(prefix: Path) -> dict[str, list[int] | None]:
    """Requests per replica of each condition, as the real run's front counted them (``PREFIX.json``)."""
    return {r["condition"]: r["routed"] for r in json.loads(prefix.with_name(prefix.name + ".json").read_text(encoding="utf-8"))}


def simulated(profile: Profile, name: str, w: Workload, cond: dict) -> dict:
    """``cluster_routing.figures`` of the simulated repeats of ``cond`` (all repeats' requests together)."""
    runs = simulate_condition(profile, cond, w, max_duration=3600.0)
    routed = None
    if runs[0].get("replicas"):
        routed = [sum(r["replicas"]["requests"][i] for r in runs) for i in range(runs[0]["replicas"]["count"])]
    return figures(name, [s for r in runs for s in r["samples"]], {"routed": routed} if routed else None)


def with_load_tokens(cond: dict, load_tokens: int) -> dict:
    """``cond`` with its front's prefix-routing load weight set to ``load_tokens``."""
    out = copy.deepcopy(cond)
    out["applied"]["cluster"] |= {"load_tokens": load_tokens, "max_waiting": out["applied"]["cluster"].get("max_waiting", 4)}
    return out


def rows(prefix: Path, profiles: list[tuple[str, Profile, Profile]], extra_load_tokens: int | None) -> list[dict]:
    routed = measured_routed(prefix)
    out = []
    for name in CONDITIONS:
        w, cond = measured(prefix, name)
        samples = [s for run in cond["runs"] for s in run["samples"]]
        meas = figures(name, samples, {"routed": routed[name]} if routed.get(name) else None)
        out.append({**meas, "source": "measured"})
        for label, single, replica in profiles:
            out.append({**simulated(replica if name != "single" else single, name, w, cond), "source": f"simulated: {label}"})
        if name == "prefix" and extra_load_tokens is not None:
            alt = with_load_tokens(cond, extra_load_tokens)
            for label, _, replica in profiles:
                out.append({**simulated(replica, f"prefix, load-tokens {extra_load_tokens}", w, alt),
                            "source": f"simulated: {label}"})
    return out


def parse_profile(text: str) -> tuple[str, Path, Path]:
    label, _, paths = text.partition("=")
    single, _, replica = paths.partition(",")
    if not label or not single:
        raise argparse.ArgumentTypeError(f"--profile takes LABEL=PATH[,REPLICA_PATH], got {text!r}")
    return label, Path(single), Path(replica or single)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", default="benchmarks/results/cluster_routing",
                        help="prefix of the real run's files: PREFIX.json (figures) and PREFIX_CONDITION.json (bench results)")
    parser.add_argument("--profile", action="append", type=parse_profile, required=True, metavar="LABEL=PATH[,REPLICA_PATH]")
    parser.add_argument("--extra-load-tokens", type=int, default=None, metavar="N",
                        help="also simulate the prefix condition with this load weight (predicted only)")
    parser.add_argument("--out", help="PREFIX.md and PREFIX.json")
    args = parser.parse_args()
    profiles = [(label, Profile.load(s), Profile.load(r)) for label, s, r in args.profile]
    rs = rows(Path(args.measured), profiles, args.extra_load_tokens)
    print(table(rs, source=True))
    if args.out:
        command = "python benchmarks/sim_cluster_validation.py " + shlex.join(sys.argv[1:])
        doc = {"created": datetime.now(UTC).isoformat(timespec="seconds"), "machine": {**machine(), "flags": cpu_flags()},
               "code": code_version(), "command": command,
               "profiles": {label: {"single": str(s), "replicas": str(r)} for label, s, r in args.profile}, "rows": rs}
        Path(args.out + ".json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
