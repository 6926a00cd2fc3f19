"""Decoding on a CPU shared with other work: quanta and llama.cpp's ``llama-server`` next to busy processes.

For each round and server configuration, a fresh server is started and warmed (8 concurrent
200-word prompts, 8 tokens out); then, for each background load N (``--loads``, default 0,1,2,4) in
turn, N CPU-bound processes (``yes > /dev/null``) start, and after a 1 s ramp two of
``peer_llama_cpp.py``'s workloads run, client-side:

- one stream: decode time per token of one 128-token stream (first to last token);
- 8 streams: aggregate output tok/s of 8 concurrent 200-word prompts, 128 tokens each.

The background processes are killed after each load's workloads (and on any error, Ctrl-C or
SIGTERM; they also die with this script); the server is stopped after the last load. Configurations (``--configs``, default all):
``quanta-default`` (the pool's threads found by trying; ``$QUANTA_NATIVE_THREADS`` unset),
``quanta-t1`` / ``quanta-t2`` (``QUANTA_NATIVE_THREADS=1`` / ``2``: the hand-set settings), and
``llama-t2`` / ``llama-t1`` (``llama-server -t 2`` / ``-t 1``). Every other round reverses the order
of the configurations and of the loads; the tables give the median
(min-max) over ``--rounds``, quanta default's speed over the best quanta hand setting's in that row,
and each configuration's slowdown against its own 0-background figure.

Usage (never in CI; on 2 cores ~10-15 min a round, most of it ``llama-server -t 2`` under load):
``python benchmarks/contention.py [--loads 0,1,2,4] [--configs quanta-default,llama-t2] [--rounds 3]
[--out benchmarks/results/contention_<cpu kind>]``; ``--quick`` shortens both workloads (32 tokens
out, 64-word prompts) for a smoke test (results in the run's folder unless ``--out``).
``--llama-server PATH`` and ``--quanta-args`` as in ``peer_llama_cpp.py``, whose cached
``llama-server`` build is the default.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peer_llama_cpp import (  # noqa: E402
    ENV_KNOBS,
    LLAMA_ARGS,
    QUANTA_ARGS,
    WORKLOADS,
    bench,
    build_llama_server,
    free_port,
    int_list,
    run_record,
    server_command,
    start,
    startup_line,
    stop,
    summarize,
    write_result,
)
from quanta.bench.output import code_version  # noqa: E402
from quanta.launch import cpu_summary  # noqa: E402
from quanta.model.loader import embedded_model_path  # noqa: E402

#: the two workloads measured under each load (names as in peer_llama_cpp.WORKLOADS)
MEASURED = ("one stream decoding: time per token", "8 concurrent streams, 200-word prompts, 128 out: aggregate")
WARMUP = ["--workload", "burst", "--num-requests", "8", "--prompt-words", "200", "--max-tokens", "8"]
RAMP_S = 1.0

_LIBC = ctypes.CDLL(None, use_errno=True)


def llama_flags(threads: int) -> list[str]:
    """peer_llama_cpp's ``llama-server`` flags with ``-t threads``."""
    flags = list(LLAMA_ARGS)
    flags[flags.index("-t") + 1] = str(threads)
    return flags


#: name -> (server flags, QUANTA_NATIVE_THREADS or None to leave it unset)
CONFIGS: dict[str, tuple[list[str], str | None]] = {
    "quanta-default": (QUANTA_ARGS, None),
    "quanta-t1": (QUANTA_ARGS, "1"),
    "quanta-t2": (QUANTA_ARGS, "2"),
    "llama-t2": (llama_flags(2), None),
    "llama-t1": (llama_flags(1), None),
}
HAND = ("quanta-t1", "quanta-t2")


def cpu_kind() -> str:
    """The results' name suffix: ``avx512``, ``avx2`` (``avx2_forced`` on AVX-512 under
    ``QUANTA_NATIVE_MARCH=haswell``) or ``generic``."""
    flags = cpu_summary().split()
    if "avx512f" in flags:
        return "avx2_forced" if os.environ.get("QUANTA_NATIVE_MARCH") == "haswell" else "avx512"
    return "avx2" if "avx2" in flags else "generic"


def command(name: str, port: int, binary: Path | None, gguf: Path, quanta_extra: list[str]) -> list[str]:
    """The configuration's command line, behind ``env`` so its ``QUANTA_NATIVE_THREADS`` is explicit."""
    flags, threads = CONFIGS[name]
    if name.startswith("quanta"):
        flags = [*flags, *quanta_extra]
    env = ["env", "-u", "QUANTA_NATIVE_THREADS", *([f"QUANTA_NATIVE_THREADS={threads}"] if threads else [])]
    return [*env, *server_command(name, flags, port, binary, gguf)]


def _die_with_parent() -> None:
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone even if we are killed


@contextlib.contextmanager
def background(n: int) -> Iterator[None]:
    """``n`` processes of ``yes > /dev/null`` for the duration of the block (started, then
    ``RAMP_S`` s to ramp up); always killed on the way out."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        if n:
            time.sleep(RAMP_S)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def workload_flags(name: str, quick: bool) -> list[str]:
    """``quanta bench run`` flags of a workload; ``quick``: 32 tokens out, prompts of 64 words at most."""
    flags = list(WORKLOADS[name][0])
    if quick:
        for flag, cap in (("--max-tokens", 32), ("--prompt-words", 64)):
            i = flags.index(flag) + 1
            flags[i] = str(min(int(flags[i]), cap))
    return flags


def measure(cmd: list[str], loads: list[int], quick: bool, prefix: Path) -> dict[int, dict[str, float]]:
    """Start the server, warm it, then run the measured workloads under each background load in turn
    (the server goes on across loads, as one would while other work comes and goes)."""
    port = int(cmd[cmd.index("--port") + 1])
    proc = start(cmd, port, prefix.with_name(prefix.name + ".log"))
    try:
        url = f"http://127.0.0.1:{port}"
        bench(url, WARMUP, "throughput", prefix.with_name(prefix.name + "-warmup"))
        got = {}
        for load in loads:
            with background(load):
                got[load] = {w: bench(url, workload_flags(w, quick), WORKLOADS[w][1], prefix.with_name(f"{prefix.name}-l{load}-w{i}"))
                             for i, w in enumerate(MEASURED)}
        return got
    finally:
        stop(proc)


def round_order(loads: list[int], configs: list[str], rnd: int) -> tuple[list[int], list[str]]:
    """One round's configurations and the loads each runs through, both reversed every other round."""
    return (loads, configs) if rnd % 2 == 0 else (loads[::-1], configs[::-1])


def cell(values: list[float], idle: list[float] | None, higher: bool) -> str:
    """``median (min-max)``, and ``, N.NNx slower`` against the idle median when there is one."""
    s = summarize(values)
    text = f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"
    if idle:
        base = summarize(idle)["median"]
        text += f", {(base / s['median'] if higher else s['median'] / base):.2f}x slower"
    return text


def default_vs_hand(per: dict[str, dict[int, list[float]]], load: int, higher: bool) -> str:
    """quanta default's speed / the best quanta hand setting's at ``load`` (>1: default faster)."""
    hand = {h: summarize(per[h][load])["median"] for h in HAND if per.get(h, {}).get(load)}
    if not hand or not per.get("quanta-default", {}).get(load):
        return "-"
    best = (max if higher else min)(hand, key=hand.get)
    ours = summarize(per["quanta-default"][load])["median"]
    return f"{(ours / hand[best] if higher else hand[best] / ours):.2f} (vs {best})"


def render(results: dict, info: dict, configs: list[str], loads: list[int], rounds: int) -> str:
    out = [f"# Decoding next to CPU-bound processes ({info['date'][:10]})", "",
           f"- machine: {info['cpu']}, {info['logical_cores']} logical cores; flags `{info['cpu_flags']}`; "
           f"1-minute load before: {info['load']:.1f}, before each condition: "
           f"{min(info['loads_before']):.1f}-{max(info['loads_before']):.1f} (the previous condition's own fading in it)",
           f"- command: `{info['command']}` at quanta {info['code']}; kernel environment: "
           + (", ".join(f"`{k}={v}`" for k, v in info["env"].items()) or "none set"),
           *(f"- {c}: `{shlex.join(info['commands'][c])}`" for c in configs),
           *(f"- {c} startup: {s}" for c, s in info["quanta_startup"].items()),
           f"- each round and configuration: a fresh server, warmed, then for each background load N in turn "
           f"(reversed every other round): N `yes > /dev/null`, {RAMP_S:g} s ramp, the two workloads; "
           f"median (min-max) over {rounds} rounds; `x slower`: against the configuration's own 0-background median; "
           "last column: quanta default's speed / the best quanta hand setting's (>1: default faster)"
           + ("; **quick workloads** (32 tokens out, prompts <= 64 words)" if info["quick"] else "")]
    for w in MEASURED:
        unit, higher = WORKLOADS[w][2], WORKLOADS[w][3]
        out += ["", f"## {w} ({unit}, {'higher' if higher else 'lower'} is better)", "",
                "| background | " + " | ".join(configs) + " | quanta default / best hand |",
                "|---" * (len(configs) + 2) + "|"]
        per = results[w]
        for load in loads:
            cells = [cell(per[c][load], per[c].get(0) if load else None, higher) for c in configs]
            out.append(f"| {load} | " + " | ".join(cells) + f" | {default_vs_hand(per, load, higher)} |")
    return "\n".join(out) + "\n"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=lambda t: int_list(t, minimum=0), default=[0, 1, 2, 4], help="comma list of background process counts")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="short workloads (32 tokens out), for a smoke test")
    ap.add_argument("--quanta-args", default="", help="extra flags for quanta serve")
    ap.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary instead of the cached build")
    ap.add_argument("--out", type=Path, default=None,
                    help="results path without suffix (default: results/contention_<cpu kind>; with --quick, in the run's folder)")
    args = ap.parse_args()
    args.configs = args.configs.split(",")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    return args


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so servers and background processes stop
    args = parse_args()
    needs_llama = any(c.startswith("llama") for c in args.configs)
    binary = (args.llama_server or build_llama_server()) if needs_llama else None
    gguf, extra = embedded_model_path(), shlex.split(args.quanta_args)
    workdir = Path(tempfile.mkdtemp(prefix="quanta-contention-"))
    out = args.out or (workdir / "contention" if args.quick else Path(__file__).parent / "results" / f"contention_{cpu_kind()}")
    info = run_record(command=shlex.join(sys.orig_argv), code=code_version(), quick=args.quick, llama_server_binary=str(binary or ""),
                      env={k: v for k, v in os.environ.items() if k in ENV_KNOBS}, commands={}, loads_before=[])
    results = {w: {c: {load: [] for load in args.loads} for c in args.configs} for w in MEASURED}
    for rnd in range(args.rounds):
        loads, configs = round_order(args.loads, args.configs, rnd)
        for c in configs:
            cmd = command(c, free_port(), binary, gguf, extra)
            info["commands"].setdefault(c, cmd)  # the first one (ports differ)
            info["loads_before"].append(os.getloadavg()[0])  # other work on the machine shows here
            for load, got in measure(cmd, loads, args.quick, workdir / f"{c}-r{rnd}").items():
                for w, value in got.items():
                    results[w][c][load].append(value)
                print(f"  round {rnd + 1} {c} background {load}: "
                      + ", ".join(f"{v:.1f} {WORKLOADS[w][2]}" for w, v in got.items()), file=sys.stderr)
    info["quanta_startup"] = {c: startup_line(workdir / f"{c}-r0.log") for c in args.configs
                              if c.startswith("quanta")}
    table = render(results, info, args.configs, args.loads, args.rounds)
    print(table)
    print(f"server logs and bench results: {workdir}; this table: {out}.md")
    write_result(out, table, {"machine": info, "rounds": args.rounds, "loads": args.loads,
                                   "results": {w: {c: {load: summarize(v) for load, v in per.items()} for c, per in r.items()}
                                               for w, r in results.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
