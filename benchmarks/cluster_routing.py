"""Multi-turn agent sessions against one server and against 2 replicas per routing policy:
does prefix routing keep each session on the replica that holds its context?

Per condition, starts a fresh server (``quanta serve``, or ``quanta serve --replicas 2
--routing POLICY`` on a local Ray, 1 CPU per replica), runs ``quanta bench run --workload
replay`` (sessions started ``--stagger`` s apart, each turn resending the whole conversation
plus a tool output) and reads the result: the prefix-hit share (the server's
``cached_tokens`` over prompt tokens), TTFT of the turns after the first (the ones that can
hit), end-to-end time, and for the clusters how many requests each replica got. Prints a
Markdown table with the machine's CPU flags, the date and the commands. Never run in CI.

Usage: ``python benchmarks/cluster_routing.py [--conditions single,prefix,round-robin] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import httpx

from quanta.analysis.requests import RequestSample, request_latencies
from quanta.bench.server import start

#: the replayed workload (``quanta bench run`` flags): 4 sessions x 4 turns (twice), a 3,000-word first turn (a miss
#: recomputes some 3,000 tokens, a hit about 150), 100 words of tool output and 16 output tokens a turn; twice
WORKLOAD = ["--workload", "replay", "--sessions", "4", "--turns", "4", "--prompt-words", "3000", "--tool-words", "100",
            "--max-tokens", "16", "--stagger", "4", "--endpoint", "chat", "--repeats", "2", "--warmup", "0",
            "--no-progress", "--no-plots", "--request-timeout", "600", "--max-duration", "900"]
SERVE = ["--max-model-len", "4096", "--stats-interval", "0"]
CONDITIONS = {"single": [], "prefix": ["--replicas", "2", "--routing", "prefix"],
              "round-robin": ["--replicas", "2", "--routing", "round-robin"],
              "least-loaded": ["--replicas", "2", "--routing", "least-loaded"]}


def cpu_flags() -> str:
    words = Path("/proc/cpuinfo").read_text().split()
    return " ".join(sorted({w for w in words if w in ("avx2", "fma") or w.startswith("avx512")}))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_condition(name: str, out: Path) -> dict:
    """One fresh server of condition ``name``, the workload once; the figures of the result."""
    proc = start([*SERVE, *CONDITIONS[name]], out, timeout=300)
    try:
        cmd = [sys.executable, "-m", "quanta", "bench", "run", "--base-url", proc.base_url, "--name", name, *WORKLOAD,
               "--out", str(out / f"bench_{name}")]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1200)
        config = httpx.get(proc.base_url + "/v1/config", timeout=60).json()
    finally:
        proc.stop()
    doc = json.loads((out / f"bench_{name}.json").read_text())
    samples = [s for run in doc["conditions"][0]["runs"] for s in run["samples"]]
    return figures(name, samples, config.get("cluster"))


def figures(name: str, samples: list[dict], cluster: dict | None) -> dict:
    """Prefix hits, TTFT of later turns, end-to-end, failures; the replicas' request counts."""
    parsed = [RequestSample.from_dict(d) for d in samples]
    ok = [s for s in parsed if s.ok]
    cached = [s for s in ok if s.cached_tokens is not None and s.prompt_tokens]
    ttft = [request_latencies(s)["ttft"] for s in ok if not s.tag.endswith("turn0")]
    e2e = [request_latencies(s)["e2e"] for s in ok]
    return {"condition": name, "requests": len(parsed), "failed": len(parsed) - len(ok),
            "hit_share": sum(s.cached_tokens for s in cached) / max(1, sum(s.prompt_tokens for s in cached)),
            "computed": sum(s.prompt_tokens - s.cached_tokens for s in cached), "ttft_mean": statistics.fmean(ttft) if ttft else math.nan,
            "ttft_p50": statistics.median(ttft) if ttft else math.nan, "ttft_p90": _percentile(ttft, 0.9),
            "e2e_p50": statistics.median(e2e) if e2e else math.nan, "e2e_max": max(e2e) if e2e else math.nan,
            "routed": cluster["routed"] if cluster else None}


def table(rows: list[dict], source: bool = False) -> str:
    """Markdown, one row per condition; ``source``: a column of each row's ``source`` (measured or simulated)."""
    head = (f"| condition | {'source | ' if source else ''}requests (failed) | prefix-hit share | prompt tokens computed "
            f"| TTFT mean / p50 / p90, turns 2-4 (s) | end-to-end p50 / max (s) | requests per replica |\n"
            f"|---|{'---|' if source else ''}---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['condition']} | {r['source'] + ' | ' if source else ''}{r['requests']} ({r['failed']}) "
        f"| {r['hit_share']:.1%} | {r['computed']:,} "
        f"| {r['ttft_mean']:.2f} / {r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} "
        f"| {r['e2e_p50']:.2f} / {r['e2e_max']:.2f} | {' / '.join(map(str, r['routed'])) if r['routed'] else '-'} |\n"
        for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conditions", default="single,prefix,round-robin")
    parser.add_argument("--out", default=None, help="folder for the bench results and server logs (default: a temporary one)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="cluster-routing-"))
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    rows = [run_condition(name, out) for name in args.conditions.split(",")]
    print(f"- date: {started:%Y-%m-%d %H:%M}-{datetime.now(UTC):%H:%M} UTC; 1-minute load after: {os.getloadavg()[0]:.1f}")
    print(f"- machine: {os.cpu_count()} cores; flags: {cpu_flags()}")
    print(f"- command: python benchmarks/cluster_routing.py --conditions {args.conditions}")
    print(f"- server flags: {' '.join(SERVE)} (+ the condition's); workload: quanta bench run {' '.join(WORKLOAD)}\n")
    print(table(rows))
    (out / "figures.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
