"""Start-up time of the CLI: commands that load no model (``quanta --version``, ``--help``, ``advise`` with no
arguments) and, with ``--serve-model GGUF``, ``quanta serve`` from its start to the first 200 from ``/health``.

Each command runs ``--runs`` times as a fresh process (after one discarded warm-up run, so
the page cache is warm as for a user's second call); prints the median with the min-max
range of the wall seconds and of the CPU seconds (user + system: steadier than wall time on a
shared machine, blind to work overlapped on threads), the bare interpreter's start
(``python -c pass``) for scale, and the machine.
``--serve-model`` adds ``import quanta.server.run`` (what ``serve`` imports before it loads),
the server's start (``--max-num-seqs 8 --max-model-len 4096``, as ``peer_gguf.py`` starts it;
``/health`` asked every 0.05 s; CPU seconds read from ``/proc`` at that answer), and the total
that ``python -X importtime`` reports for that import. ``--baseline DIR`` times the same three
for another version's ``quanta/`` package in ``DIR`` (e.g. ``git archive REV quanta | tar -x -C DIR``),
alternating run by run with this checkout.
Standard library only (the machine flags come from /proc/cpuinfo, not quanta.launch,
which imports torch). ``--out FILE`` also writes the table as Markdown with the date,
machine and command.

Usage: ``.venv/bin/python benchmarks/cli_startup.py [--runs 9] [--quanta .venv/bin/quanta]
[--serve-model GGUF [--baseline DIR]] [--out FILE]``
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the timed processes' working directory: ``python -c`` puts it first on ``sys.path``, where a checkout's
#: ``quanta/`` would shadow ``--baseline``'s
NEUTRAL_CWD = "/"
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


def run_once(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, from ``wait4``) of one fresh process of ``argv``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=NEUTRAL_CWD)
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0  # reaped by wait4
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def time_runs(argv: list[str], runs: int) -> tuple[list[float], list[float]]:
    """:func:`run_once` of ``runs`` fresh processes of ``argv`` (one warm-up run first, not counted)."""
    times = [run_once(argv) for _ in range(runs + 1)][1:]
    return [w for w, _ in times], [c for _, c in times]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the live process ``pid`` has used so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """Whether ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def serve_to_health(argv: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> tuple[float, float]:
    """Wall seconds from starting ``argv`` plus ``--port`` to the first 200 from its ``/health``, and the CPU seconds
    the server had used by then; the server is then stopped.

    Raises:
        RuntimeError: it exited, or was not healthy within ``timeout`` seconds.
    """
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([*argv, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            cwd=NEUTRAL_CWD)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(argv)} exited with {proc.returncode}")
            if healthy(f"http://127.0.0.1:{port}/health"):
                return time.perf_counter() - t0, cpu_seconds(proc.pid)
            time.sleep(0.05)
        raise RuntimeError(f"{shlex.join(argv)} not healthy in {timeout:g} s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def alternate(versions: dict[str, dict[str, str]], measure, runs: int) -> dict[str, list[tuple[float, ...]]]:
    """``measure(env)`` for each version (label -> environment), ``runs`` rounds taking the versions in
    turn (after one warm-up round, not counted), so that a busy moment of a shared machine falls on both."""
    out: dict[str, list[tuple[float, ...]]] = {label: [] for label in versions}
    for i in range(runs + 1):
        for label, env in versions.items():
            result = measure(env)
            if i:
                out[label].append(result)
    return out


def row(label: str, wall: list[float], cpu: list[float]) -> str:
    """A table row: median and min-max of the wall and CPU seconds."""
    return (f"| {label} | {statistics.median(wall):.3f} | {min(wall):.3f}-{max(wall):.3f} | "
            f"{statistics.median(cpu):.3f} | {min(cpu):.3f}-{max(cpu):.3f} |")


def importtime_total(python: str, module: str, env: dict[str, str] | None = None) -> float:
    """Seconds ``python -X importtime`` reports for importing ``module`` (its cumulative column)."""
    out = subprocess.run([python, "-X", "importtime", "-c", f"import {module}"], capture_output=True, text=True,
                         check=True, env=env, cwd=NEUTRAL_CWD)
    line = next(ln for ln in reversed(out.stderr.splitlines()) if ln.rstrip().endswith(f"| {module}"))
    return int(line.split("|")[1]) / 1e6


def serve_rows(args) -> list[str]:
    """Rows for ``--serve-model``: serve's imports, the server's start to ``/health``, and the ``-X importtime``
    total, for this checkout and (``--baseline``) the other quanta, the two alternating run by run."""
    python = str(Path(args.quanta).with_name("python"))
    versions = {"": dict(os.environ)}
    if args.baseline:
        versions = {" (this checkout)": dict(os.environ, PYTHONPATH=str(ROOT)),
                    f" (baseline {args.baseline})": dict(os.environ, PYTHONPATH=str(Path(args.baseline).resolve()))}
    serve = [args.quanta, "serve", "--model", str(Path(args.serve_model).resolve()), "--max-num-seqs", "8", "--max-model-len", "4096"]
    measures = [
        ("python -c 'import quanta.server.run' (serve's imports)", lambda env: run_once([python, "-c", "import quanta.server.run"], env)),
        (f"quanta serve --model {Path(args.serve_model).name}: start to first /health", lambda env: serve_to_health(serve, env)),
    ]
    rows = []
    for label, measure in measures:
        for version, times in alternate(versions, measure, args.runs).items():
            rows.append(row(label + version, [w for w, _ in times], [c for _, c in times]))
    for version, times in alternate(versions, lambda env: (importtime_total(python, "quanta.server.run", env),),
                                    args.runs).items():
        total = [t for t, in times]
        rows.append(f"| `-X importtime` total of quanta.server.run{version} | {statistics.median(total):.3f} | "
                    f"{min(total):.3f}-{max(total):.3f} | | |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9, help="timed runs per command (default 9)")
    ap.add_argument("--quanta", default=str(ROOT / ".venv" / "bin" / "quanta"), help="the quanta script (default .venv/bin/quanta)")
    ap.add_argument("--serve-model", help="also time `quanta serve --model GGUF` to its first /health")
    ap.add_argument("--baseline", help="with --serve-model: a directory holding another version's quanta/ package, "
                    "timed the same way, alternating run by run with this checkout (each put first on PYTHONPATH)")
    ap.add_argument("--out", help="also write the Markdown table here")
    args = ap.parse_args()
    commands = [
        ("python -c pass (interpreter start)", [sys.executable, "-c", "pass"]),
        ("quanta --version", [args.quanta, "--version"]),
        ("quanta --help", [args.quanta, "--help"]),
        ("quanta advise (no arguments: usage error)", [args.quanta, "advise"]),
    ]
    rows, load_start = [], os.getloadavg()[0]
    for label, argv in commands:
        rows.append(row(label, *time_runs(argv, args.runs)))
        print(rows[-1], flush=True)
    if args.serve_model:
        for line in serve_rows(args):
            rows.append(line)
            print(line, flush=True)
    command = "python benchmarks/cli_startup.py " + shlex.join(sys.argv[1:])
    lines = [
        "# CLI start-up",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {machine()}",
        f"- command: `{command.strip()}`",
        f"- runs: {args.runs} fresh processes per command after one warm-up run; wall seconds, and CPU seconds "
        f"(user + system: steadier than wall time on a shared machine); load average at the start "
        f"{load_start:.2f}, at the end {os.getloadavg()[0]:.2f}",
        "",
        "| command | wall median s | wall min-max s | CPU median s | CPU min-max s |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
