"""Memory read bandwidth of this machine, and the decode speed it allows a GGUF file's weights.

A one-stream decode step reads every weight once; once the weights are far larger than the caches,
the step cannot be faster than ``weight bytes / read bandwidth``. This prints the read bandwidth
(sums of a 1 GiB float32 tensor, torch on 1 and on 2 threads, median and min-max of ``--repeats``)
and, for each ``--model`` with a measured ``--ms`` per token, the bound and how close that figure is
to it (``--ms`` from ``benchmarks/peer_gguf.py``'s decode row, e.g. llama-server's).

Usage: ``python benchmarks/memory_bandwidth.py [--repeats 7] [--model FILE --ms MS_A_TOKEN ...] [--out PREFIX]``
"""

from __future__ import annotations

import quanta  # noqa: F401  first: it sets libgomp's spin count before torch loads libgomp (quanta/__init__.py)

# isort: split
import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from quanta.bench.output import code_version, machine, machine_text

GIB = 1 << 30


def read_gb_s(threads: int, repeats: int) -> list[float]:
    """GB/s of each of ``repeats`` sums over a 1 GiB float32 tensor on ``threads`` threads (after one warm-up)."""
    torch.set_num_threads(threads)
    x = torch.ones(GIB // 4, dtype=torch.float32)
    x.sum()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        out.append(GIB / (time.perf_counter() - t) / 1e9)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", action="append", default=[], help="a GGUF file (repeatable, each with its --ms)")
    ap.add_argument("--ms", action="append", type=float, default=[], help="a measured decode ms a token of --model")
    ap.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = ap.parse_args()
    if len(args.model) != len(args.ms):
        ap.error("give one --ms for each --model")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    rates = {n: read_gb_s(n, args.repeats) for n in (1, min(2, os.cpu_count() or 1))}
    best = max(statistics.median(r) for r in rates.values())
    lines = ["# Memory read bandwidth and the one-stream decode bound", "",
             f"- date: {datetime.now(UTC).isoformat(timespec='seconds')}",
             f"- machine: {machine_text(machine())}",
             f"- command: `python benchmarks/memory_bandwidth.py {' '.join(sys.argv[1:])}`; quanta {code_version()}", "",
             "| threads | read GB/s, median (min-max) |", "|---|---|"]
    lines += [f"| {n} | {statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f}) |" for n, r in rates.items()]
    models = []
    if args.model:
        lines += ["", f"At the best median ({best:.1f} GB/s): a step that reads the file's bytes once cannot take less than",
                  "(an untied embedding table, of which a step reads one row, is counted: the bound is a little high there)",
                  "", "| file | bytes (GB) | bound, ms a token | measured, ms a token | measured / bound | a 1.5x faster step / bound |",
                  "|---|---|---|---|---|---|"]
        for path, ms in zip(args.model, args.ms):
            gb = Path(path).stat().st_size / 1e9
            bound = gb / best * 1e3
            models.append({"model": path, "gb": gb, "bound_ms": bound, "measured_ms": ms})
            lines.append(f"| {Path(path).name} | {gb:.3f} | {bound:.1f} | {ms:.1f} | {ms / bound:.2f} | {ms / 1.5 / bound:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(f"{args.out}.md").write_text(text)
        Path(f"{args.out}.json").write_text(json.dumps({"rates_gb_s": rates, "best_gb_s": best, "models": models,
                                                        "machine": machine()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
