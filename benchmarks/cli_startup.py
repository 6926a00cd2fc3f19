"""Wall time of CLI commands that load no model: ``quanta --version``, ``--help`` and ``advise`` with no arguments.

Each command runs ``--runs`` times as a fresh process (after one discarded warm-up run, so
the page cache is warm as for a user's second call); prints the median with the min-max
range, the bare interpreter's start (``python -c pass``) for scale, and the machine.
Standard library only (the machine flags come from /proc/cpuinfo, not quanta.launch,
which imports torch). ``--out FILE`` also writes the table as Markdown with the date,
machine and command.

Usage: ``.venv/bin/python benchmarks/cli_startup.py [--runs 9] [--quanta .venv/bin/quanta] [--out FILE]``
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def machine() -> str:
    """CPU model, logical CPUs, vector flags, OS and Python."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.partition(":")[2].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.partition(":")[2].split())
    except OSError:
        pass
    vector = " ".join(f for f in FLAGS if f in flags) or "no avx2"
    return (f"{model}, {os.cpu_count()} logical CPUs ({vector}); {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}")


def time_runs(argv: list[str], runs: int) -> list[float]:
    """Wall seconds of ``runs`` fresh processes of ``argv`` (one warm-up run first, not counted)."""
    times = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9, help="timed runs per command (default 9)")
    ap.add_argument("--quanta", default=str(ROOT / ".venv" / "bin" / "quanta"), help="the quanta script (default .venv/bin/quanta)")
    ap.add_argument("--out", help="also write the Markdown table here")
    args = ap.parse_args()
    commands = [
        ("python -c pass (interpreter start)", [sys.executable, "-c", "pass"]),
        ("quanta --version", [args.quanta, "--version"]),
        ("quanta --help", [args.quanta, "--help"]),
        ("quanta advise (no arguments: usage error)", [args.quanta, "advise"]),
    ]
    rows = []
    for label, argv in commands:
        t = time_runs(argv, args.runs)
        rows.append(f"| {label} | {statistics.median(t):.3f} | {min(t):.3f}-{max(t):.3f} |")
        print(rows[-1], flush=True)
    command = "python benchmarks/cli_startup.py " + shlex.join(sys.argv[1:])
    lines = [
        "# CLI start-up: commands that load no model",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {machine()}",
        f"- command: `{command.strip()}`",
        f"- runs: {args.runs} fresh processes per command after one warm-up run; wall seconds; "
        f"load average at the end {os.getloadavg()[0]:.2f}",
        "",
        "| command | median s | min-max s |",
        "|---|---:|---:|",
        *rows,
        "",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
