"""quanta against llama.cpp's ``llama-server`` on the same GGUF, CPU and workloads.

Builds ``llama-server`` once from the llama.cpp tree vendored in the
``llama-cpp-python`` sdist (``pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36``, then cmake's ``llama-server`` target; about 20
minutes on 2 cores) and caches it under ``~/.cache/quanta/peer`` (or
``$QUANTA_PEER_CACHE``). Then starts both servers on 127.0.0.1 and runs the
same five ``quanta bench run`` workloads against each, alternating servers
for ``--rounds`` rounds, and prints one table: medians, min-max over rounds,
and the quanta / llama-server ratio of the round medians. All figures are
client-side (``llama-server`` has no step trace):

- prefill: prompt tokens / TTFT of one 1,000-word prompt, nothing else running;
- one stream: decode time per token of one 128-token stream (first to last token);
- 8 streams: aggregate output tok/s of 8 concurrent 200-word prompts, 128 tokens each;
- 32 on 8 slots: aggregate output tok/s of 32 requests sent at once, 128 tokens each;
- probe: prefill tok/s of a 2,000-word prompt while 3 sessions decode.

Usage: ``python benchmarks/peer_llama_cpp.py [--rounds 3] [--out benchmarks/results/peer_llama_cpp]``
(``--servers quanta --workloads 2,3`` for a quick look at part of it; only whole runs write results)
(never run in CI). Extra quanta flags: ``--quanta-args "--quantization none"``. The AVX2 kind on an
AVX-512 machine: build ``llama-server`` with ``-DGGML_NATIVE=OFF -DGGML_AVX512=OFF`` into another
build directory, pass it as ``--llama-server PATH``, and run with ``QUANTA_NATIVE_MARCH=haswell
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``--quanta-args
"--dtype fp32"`` (the environment is recorded with the results).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from quanta.bench.output import machine
from quanta.launch import cpu_summary
from quanta.model.loader import embedded_model_path
from quanta.tools.make_model import LLAMA_CPP_PYTHON, llama_cpp_source, peer_cache

CACHE = peer_cache()
SRC = llama_cpp_source()
BINARY = SRC / "build" / "bin" / "llama-server"
THREADS = os.cpu_count() or 2
LLAMA_ARGS = ["-t", str(THREADS), "-np", "8", "-c", "32768"]
QUANTA_ARGS = ["--max-num-seqs", "8", "--max-model-len", "4096"]

#: environment variables that change which kernels either server runs (recorded with the results)
ENV_KNOBS = ("QUANTA_NATIVE_MARCH", "QUANTA_NATIVE_THREADS", "GOMP_SPINCOUNT", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
             "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")

#: name -> (quanta bench run flags, figure, unit, higher is better)
WORKLOADS = {
    "prefill, 1,000-word prompt, nothing else running": (
        ["--workload", "burst", "--num-requests", "1", "--prompt-words", "1000", "--max-tokens", "1"], "prefill", "tok/s", True),
    "one stream decoding: time per token": (
        ["--workload", "concurrency", "--concurrency", "1", "--num-requests", "1", "--prompt-words", "32", "--max-tokens", "128"],
        "tpot", "ms", False),
    "8 concurrent streams, 200-word prompts, 128 out: aggregate": (
        ["--workload", "burst", "--num-requests", "8", "--prompt-words", "200", "--max-tokens", "128"], "throughput", "tok/s", True),
    "32 requests at once on 8 slots, 128 out: aggregate": (
        ["--workload", "burst", "--num-requests", "32", "--prompt-words", "32", "--max-tokens", "128"], "throughput", "tok/s", True),
    "3 streams decoding + a 2,000-word prompt: probe prefill": (
        ["--workload", "probe", "--sessions", "3", "--probe-words", "2000"], "probe", "tok/s", True),
}


def build_llama_server() -> Path:
    """The cached ``llama-server`` binary, downloading and building it first if missing.

    Raises:
        subprocess.CalledProcessError: the download or the build failed.
    """
    if BINARY.exists():
        return BINARY
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(CACHE)], check=True)
    if not SRC.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"],
                   cwd=SRC, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", f"-j{THREADS}"], cwd=SRC, check=True)
    return BINARY


def server_command(server: str, flags: list[str], port: int, binary: Path | None, gguf: Path) -> list[str]:
    """The command line serving ``gguf`` on 127.0.0.1:``port`` with ``flags``: ``llama-server``
    (``binary``) for a name starting with ``llama``, else ``quanta serve``."""
    if server.startswith("llama"):
        return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *flags]
    return [sys.executable, "-m", "quanta.cli", "serve", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            *flags]


def server_pair(names: str, llama_args: list[str], quanta_args: list[str]) -> tuple[list[str], dict[str, int], dict[str, list[str]]]:
    """The servers a comma list ``names`` picks (``llama-server``, ``quanta``; others ignored, order
    kept), a free port each and their command lines serving the embedded GGUF with ``llama_args`` /
    ``quanta_args`` (``llama-server`` built first if picked)."""
    ports = {"llama-server": free_port(), "quanta": free_port()}
    servers = [s for s in names.split(",") if s in ports]
    binary, gguf = build_llama_server() if "llama-server" in servers else None, embedded_model_path()
    cmds = {s: server_command(s, llama_args if s == "llama-server" else quanta_args, ports[s], binary, gguf) for s in servers}
    return servers, ports, cmds


def run_record(**extra) -> dict:
    """What a result file records of its run: the machine, its CPU flags, the date and the 1-minute
    load before the run, and ``extra``."""
    return {**machine(), "cpu_flags": cpu_summary(), "date": datetime.now(UTC).isoformat(), "load": os.getloadavg()[0],
            **extra}


def int_list(text: str, minimum: int = 1) -> list[int]:
    """An argparse ``type``: ``"2048,8192"`` -> ``[2048, 8192]``, each ``minimum`` or more (positive by default)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers, got {text!r}") from None
    if min(values) < minimum:
        raise argparse.ArgumentTypeError(f"must be {'positive' if minimum == 1 else f'{minimum} or more'}, got {text!r}")
    return values


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """:func:`start`'s failure; ``returncode``: the server's exit code, None when it was not healthy in time."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


def start(cmd: list[str], port: int, log: Path, timeout: float = 300, poll: float = 0.5) -> subprocess.Popen:
    """Start a server and wait for its ``/health`` to answer 200 (bounded by ``timeout`` s, asked every ``poll`` s).

    Raises:
        ServerStartError: the server exited, or was not healthy in time (then it is killed).
    """
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"{cmd[0]} exited with {proc.returncode}; see {log}", proc.returncode)
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    proc.kill()
    proc.wait()
    raise ServerStartError(f"{cmd[0]} did not become healthy in {timeout} s; see {log}", None)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def figure(run: dict, kind: str) -> float:
    """One workload figure from a ``quanta bench run`` result's single run (see the module docstring)."""
    client = run["metrics"]["client"]
    if kind == "throughput":
        return client["throughput"]
    if kind == "prefill":
        return client["prompt_tokens"] / client["ttft"]["p50"]
    if kind == "probe":
        return run["metrics"]["probe"]["prefill_tok_s"]
    sample = run["samples"][0]
    times = [t for t, _ in sample["chunks"]]
    return (times[-1] - times[0]) / (sample["completion_tokens"] - 1) * 1e3


def bench(url: str, flags: list[str], kind: str, out: Path) -> float:
    """Run one workload once; ``out`` (no suffix) keeps its result JSON."""
    return figure(bench_run(url, flags, out), kind)


def bench_run(url: str, flags: list[str], out: Path) -> dict:
    """``quanta bench run`` with ``flags`` once against ``url``; its single run (``out``.json keeps the document).

    Raises:
        subprocess.CalledProcessError: the bench failed (e.g. the server went away).
    """
    cmd = [sys.executable, "-m", "quanta.cli", "bench", "run", "--base-url", url, "--repeats", "1", "--no-progress",
           "--no-plots", "--out", str(out), *flags]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return read_run(out)


def read_run(out: Path) -> dict:
    """The single run of the ``quanta bench run`` result ``out``.json."""
    return json.loads(beside(out, ".json").read_text())["conditions"][0]["runs"][0]


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quanta-args", default="", help="extra flags for quanta serve")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "peer_llama_cpp")
    ap.add_argument("--servers", default="llama-server,quanta", help="comma list, for a quick look at one side")
    ap.add_argument("--workloads", default=None, help="comma list of workload numbers (1-5) to run (default: all)")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="a llama-server binary to use instead of the cached build (e.g. one built for AVX2 only)")
    args = ap.parse_args()
    picked = {int(i) for i in args.workloads.split(",")} if args.workloads else set(range(1, len(WORKLOADS) + 1))
    workloads = {name: w for i, (name, w) in enumerate(WORKLOADS.items(), 1) if i in picked}
    binary = args.llama_server or build_llama_server()
    gguf = embedded_model_path()
    workdir = Path(tempfile.mkdtemp(prefix="quanta-peer-"))
    ports = {"llama-server": free_port(), "quanta": free_port()}
    cmds = {
        "llama-server": server_command("llama-server", LLAMA_ARGS, ports["llama-server"], binary, gguf),
        "quanta": server_command("quanta", [*QUANTA_ARGS, *shlex.split(args.quanta_args)], ports["quanta"], binary, gguf),
    }
    cmds = {name: cmd for name, cmd in cmds.items() if name in args.servers.split(",")}
    results: dict[str, dict[str, list[float]]] = {w: {s: [] for s in cmds} for w in workloads}
    order = list(cmds)
    for rnd in range(args.rounds):
        for server in order if rnd % 2 == 0 else order[::-1]:  # alternate who goes first
            proc = start(cmds[server], ports[server], workdir / f"{server}.log")
            try:
                url = f"http://127.0.0.1:{ports[server]}"
                for i, (name, (flags, kind, _, _)) in enumerate(workloads.items()):
                    results[name][server].append(bench(url, flags, kind, workdir / f"{server}-w{i}-r{rnd}"))
                    print(f"  round {rnd + 1} {server}: {name}: {results[name][server][-1]:.1f}", file=sys.stderr)
            finally:
                stop(proc)
    info = {**machine(), "cpu_flags": cpu_summary(), "llama_cpp_python": LLAMA_CPP_PYTHON,
            "llama_server_args": LLAMA_ARGS, "quanta_args": QUANTA_ARGS + shlex.split(args.quanta_args),
            "llama_server_binary": str(binary), "quanta_startup": startup_line(workdir / "quanta.log"),
            "env": {k: v for k, v in os.environ.items() if k in ENV_KNOBS}}
    table = render(results, info, args.rounds)
    print(table)
    print(f"bench results (quanta's carry its server trace, for quanta profile-engine --from-bench): {workdir}")
    if len(cmds) < 2 or len(workloads) < len(WORKLOADS):
        return 0  # a partial look: the committed results stay those of a whole run
    record = {"date": datetime.now(UTC).isoformat(), "machine": info, "rounds": args.rounds,
              "results": {w: {s: summarize(v) for s, v in r.items()} for w, r in results.items()}}
    write_result(args.out, table, record)
    return 0


def beside(prefix: Path, ext: str) -> Path:
    """``prefix`` with ``ext`` appended, as ``quanta bench`` names its files: a name may hold dots
    (``llama-3.2-1b``), which ``with_suffix`` would cut."""
    return prefix.with_name(prefix.name + ext)


def write_result(out: Path, table: str, record: dict) -> None:
    """``out``.md (the table) and ``out``.json (the record), the folder made if missing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    beside(out, ".md").write_text(table)
    beside(out, ".json").write_text(json.dumps(record, indent=2))


def startup_line(log: Path) -> str:
    """quanta's startup line naming dtype, quantization, kernels and threads."""
    lines = [ln for ln in log.read_text().splitlines() if "kernels:" in ln and "scheduler=" in ln]
    return lines[-1].split("INFO quanta: ", 1)[-1] if lines else ""


def render(results: dict, info: dict, rounds: int) -> str:
    out = [f"# quanta vs llama-server ({datetime.now(UTC).date()})", "",
           f"- machine: {info['cpu']}, {info['logical_cores']} logical cores, flags: {info['cpu_flags']}",
           f"- llama-server: llama.cpp vendored in llama-cpp-python {LLAMA_CPP_PYTHON}, CPU Release, `{' '.join(LLAMA_ARGS)}`",
           f"- quanta: `quanta serve {' '.join(info['quanta_args'])}`; startup: `{info['quanta_startup']}`",
           f"- llama-server binary: `{info['llama_server_binary']}`; kernel environment: "
           + (", ".join(f"`{k}={v}`" for k, v in info["env"].items()) or "none set"),
           "- model: the embedded SmolLM2-135M-Instruct Q4_1 GGUF for both; client: `quanta bench run` on the same machine",
           f"- {rounds} rounds, servers alternating first; median (min-max) over rounds; ratio = quanta / llama-server "
           "of the medians (for time per token: llama / quanta, so > 1 means quanta is faster)", "",
           "| workload | llama-server | quanta | quanta / llama (speed) |", "|---|---|---|---|"]
    for name, per in results.items():
        _, _, unit, higher = WORKLOADS[name]
        if not (per.get("llama-server") and per.get("quanta")):  # a --servers run of one side
            cells = [_fmt(summarize(per[s]), unit) if per.get(s) else "-" for s in ("llama-server", "quanta")]
            out.append(f"| {name} | {cells[0]} | {cells[1]} | - |")
            continue
        llama, ours = summarize(per["llama-server"]), summarize(per["quanta"])
        ratio = ours["median"] / llama["median"] if higher else llama["median"] / ours["median"]
        out.append(f"| {name} | {_fmt(llama, unit)} | {_fmt(ours, unit)} | {ratio:.2f} |")
    return "\n".join(out) + "\n"


def _fmt(s: dict, unit: str) -> str:
    return f"{s['median']:.1f} {unit} ({s['min']:.1f}-{s['max']:.1f})"


if __name__ == "__main__":
    sys.exit(main())
