"""quanta against llama.cpp's ``llama-server`` on any GGUF: load time, memory, first token, decode, 8 streams.

For ``--model PATH.gguf`` (default: the embedded SmolLM2-135M-Instruct Q4_1), starts each server in
turn on 127.0.0.1 (llama-server and quanta alternating who goes first, ``--rounds`` rounds) and
measures, per round and server:

- load: seconds from the server process's start to the first 200 from ``/health`` (asked every 0.1 s;
  quanta loads the model before it listens, llama-server answers 503 while loading);
- peak resident memory during load: ``VmHWM`` of ``/proc/PID/status`` read when ``/health`` first
  answers 200, and resident memory serving: ``VmRSS`` after the workloads. Both are summed over the
  server process and its descendants (the processes are recorded); ``quanta serve`` runs as one
  process that holds the model (model, engine thread and uvicorn; checked with ``ps``) and so does
  llama-server, so the sum is that process's figure. Resident memory counts the GGUF's pages mapped
  from the file (llama-server mmaps it), the JSON splits it into ``RssAnon`` and ``RssFile``;
- time to first token (streamed) of one 1,000-word prompt, nothing else running, and the prompt
  tokens the server counted for it (each server's own tokenizer);
- decode time per token of one stream (128 tokens, first to last token);
- aggregate output tok/s of 8 concurrent streams (200-word prompts, 128 tokens each).

The last three are the first three ``quanta bench run`` workloads of ``peer_llama_cpp.py`` (each with
its 2 unmeasured warmup requests; every prompt starts with a fresh nonce, so no cache serves it).

Server settings (printed with the table): one configuration with 8 slots for every row, no restart
between workload groups: llama-server ``-t 2 -np 8 -c 8*CTX`` (each slot ``CTX`` tokens) and
``quanta serve --max-num-seqs 8 --max-model-len CTX``, ``--ctx`` 4096 by default. quanta's default KV
pool is what 8 sequences of ``CTX`` tokens need and llama-server allocates its 8 x ``CTX`` cache at
start, so the memory rows compare the same reservation; a single stream on llama-server still only
attends its own slot. quanta runs at its defaults: its C kernels use 2 threads where it may use 2
cores or more, its prompt matmuls (torch) every core it may use; on a machine with more than 2
cores run the script under ``taskset -c 0,1`` to give both servers 2 cores. Extra flags:
``--quanta-args "..."`` / ``--llama-args "..."``.

A server not healthy within ``--timeout`` seconds (e.g. quanta refusing the file, or the kernel
killing it for memory), or one that fails a workload, is a row "failed: <last log line>" for that
round; its other rounds still count.

``--load-only`` stops each server at its first ``/health`` (the load time and peak memory rows only).

Usage (never in CI): ``python benchmarks/peer_gguf.py [--model PATH.gguf] [--rounds 3] [--ctx 4096]
[--timeout 600] [--load-only] [--out NAME]``; ``--out NAME`` writes ``benchmarks/results/NAME.md`` and ``.json``
(a NAME with a ``/`` is used as the path prefix). ``llama-server`` is ``peer_llama_cpp.py``'s cached
build (or ``--llama-server PATH``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peer_llama_cpp import (  # noqa: E402
    ENV_KNOBS,
    LLAMA_CPP_PYTHON,
    WORKLOADS,
    ServerStartError,
    bench_run,
    beside,
    build_llama_server,
    figure,
    free_port,
    read_run,
    run_record,
    server_command,
    start,
    startup_line,
    stop,
    summarize,
    write_result,
)
from quanta.bench.output import code_version  # noqa: E402
from quanta.launch import cpu_flags  # noqa: E402
from quanta.model.gguf_loader import gguf_tensor_types  # noqa: E402
from quanta.model.loader import embedded_model_path  # noqa: E402

#: ``quanta bench run`` flags of the 1,000-word prompt, the one stream and the 8 streams (peer_llama_cpp.py's first three)
PREFILL, ONE_STREAM, EIGHT_STREAMS = (flags for flags, *_ in list(WORKLOADS.values())[:3])
SLOTS = 8
THREADS = 2
#: figure -> (row label, unit, format, better: "lower" / "higher" / None for no ratio)
ROWS = {
    "load_s": ("load: process start to first 200 from /health", "s", ".2f", "lower"),
    "load_peak_mib": ("peak resident memory during load (VmHWM at first /health)", "MiB", ".0f", "lower"),
    "serving_rss_mib": ("resident memory serving (VmRSS after the workloads)", "MiB", ".0f", "lower"),
    "ttft_ms": ("time to first token, 1,000-word prompt, streamed, nothing else running", "ms", ".0f", "lower"),
    "prompt_tokens": ("prompt tokens of that prompt (each server's count)", "tokens", ".0f", None),
    "tpot_ms": ("one stream decoding 128 tokens: time per token", "ms", ".1f", "lower"),
    "agg_tok_s": ("8 concurrent streams, 200-word prompts, 128 out: aggregate", "tok/s", ".1f", "higher"),
}
SERVERS = ("llama-server", "quanta")
MEMORY_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (from each process's parent in ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def tree_memory(pid: int) -> dict:
    """:data:`MEMORY_FIELDS` in MiB summed over ``pid``'s process tree, and the tree's ``pid name`` list."""
    total, names = dict.fromkeys(MEMORY_FIELDS, 0.0), []
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue  # ended since the tree was read
        fields = {k: v.strip() for k, v in (ln.split(":", 1) for ln in status.splitlines() if ":" in ln)}
        for k in MEMORY_FIELDS:
            total[k] += int(fields.get(k, "0 kB").split()[0]) / 1024
        names.append(f"{p} {fields.get('Name', '?')}")
    return {**total, "processes": names}


def last_line(log: Path) -> str:
    """The log's last non-empty line (where a failed server says why)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    return lines[-1][:200] if lines else "(empty log)"


def workload(url: str, flags: list[str], out: Path) -> dict:
    """:func:`bench_run`'s run if all its requests succeeded.

    Raises:
        RuntimeError: some failed (the first error named), or the bench itself did.
    """
    try:
        run = bench_run(url, flags, out)
    except subprocess.CalledProcessError as exc:
        try:  # a bench whose every request failed exits 1 after writing its result
            run = read_run(out)
        except (OSError, ValueError, KeyError, IndexError):
            raise RuntimeError(f"quanta bench run exited with {exc.returncode}") from None
    client = run["metrics"]["client"]
    if client["num_failed"]:
        error = next((s["error"] for s in run["samples"] if s["error"]), "?")
        raise RuntimeError(f"{client['num_failed']} requests failed: {error}")
    return run


def one_round(cmd: list[str], port: int, log: Path, timeout: float, bench_flags: list[str], tag: Path,
              load_only: bool = False) -> dict:
    """One server's figures (:data:`ROWS` keys, plus the memory readings; ``load_only``: the load rows
    alone); ``failed`` where it failed."""
    row: dict = {}
    t0 = time.monotonic()
    try:
        proc = start(cmd, port, log, timeout, poll=0.1)
    except ServerStartError as exc:  # exited, or not healthy in time
        why = f"exited with {exc.returncode}" if exc.returncode is not None else f"not healthy in {timeout:g} s"
        return {"failed": f"{last_line(log)} ({why})", "error": str(exc)}
    row["load_s"] = time.monotonic() - t0
    try:
        row["memory_at_load"] = tree_memory(proc.pid)
        row["load_peak_mib"] = row["memory_at_load"]["VmHWM"]
        if load_only:
            return row
        url = f"http://127.0.0.1:{port}"
        client = workload(url, [*PREFILL, *bench_flags], Path(f"{tag}-ttft"))["metrics"]["client"]
        row["ttft_ms"], row["prompt_tokens"] = client["ttft"]["p50"] * 1e3, client["prompt_tokens"]
        row["tpot_ms"] = figure(workload(url, [*ONE_STREAM, *bench_flags], Path(f"{tag}-one")), "tpot")
        row["agg_tok_s"] = figure(workload(url, [*EIGHT_STREAMS, *bench_flags], Path(f"{tag}-eight")), "throughput")
        row["memory_serving"] = tree_memory(proc.pid)
        row["serving_rss_mib"] = row["memory_serving"]["VmRSS"]
    except (RuntimeError, KeyError, ValueError) as exc:
        row["error"] = str(exc)  # a server that died: its last words; else the bench's complaint
        row["failed"] = f"{last_line(log)} (exited with {proc.returncode})" if proc.poll() is not None else str(exc)[:200]
    finally:
        stop(proc)
    return row


def gguf_summary(path: Path) -> dict:
    """The file's size and its tensor count per type (:func:`gguf_tensor_types`); ``error`` where unreadable."""
    info: dict = {"path": str(path), "bytes": path.stat().st_size}
    try:
        info["tensor_types"] = dict(Counter(gguf_tensor_types(path).values()).most_common())
    except Exception as exc:  # noqa: BLE001 - a file the reader refuses is still benchmarked
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096, help="tokens per slot / sequence (default 4096)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a server may take to become healthy (default 600)")
    ap.add_argument("--bench-timeout", type=float, default=1800,
                    help="bound of each workload and each request, seconds (default 1800: big models on few cores)")
    ap.add_argument("--quanta-args", default="", help="extra flags for quanta serve")
    ap.add_argument("--llama-args", default="", help="extra flags for llama-server")
    ap.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary instead of the cached build")
    ap.add_argument("--out", default=None, help="write benchmarks/results/NAME.md and .json (a NAME with / is a path prefix)")
    ap.add_argument("--load-only", action="store_true", help="only the load rows: each server is stopped at its first /health")
    args = ap.parse_args()
    if args.rounds < 1 or args.ctx < 1:
        ap.error("--rounds and --ctx must be positive")
    gguf = (args.model or embedded_model_path()).resolve()
    if not gguf.is_file():
        ap.error(f"--model {gguf}: no such file")
    binary = args.llama_server or build_llama_server()
    flags = {"llama-server": ["-t", str(THREADS), "-np", str(SLOTS), "-c", str(SLOTS * args.ctx), *shlex.split(args.llama_args)],
             "quanta": ["--max-num-seqs", str(SLOTS), "--max-model-len", str(args.ctx), *shlex.split(args.quanta_args)]}
    ports = {s: free_port() for s in SERVERS}
    cmds = {s: server_command(s, flags[s], ports[s], binary, gguf) for s in SERVERS}
    bench_flags = ["--max-duration", str(args.bench_timeout), "--request-timeout", str(args.bench_timeout)]
    workdir = Path(tempfile.mkdtemp(prefix="quanta-peer-gguf-"))
    rounds: dict[str, list[dict]] = {s: [] for s in SERVERS}
    for rnd in range(args.rounds):
        for server in SERVERS if rnd % 2 == 0 else SERVERS[::-1]:  # alternate who goes first
            log = workdir / f"{server}-r{rnd}.log"
            row = one_round(cmds[server], ports[server], log, args.timeout, bench_flags, workdir / f"{server}-r{rnd}",
                            args.load_only)
            rounds[server].append(row)
            shown = {k: round(v, 2) for k, v in row.items() if k in ROWS}
            print(f"  round {rnd + 1} {server}: {shown}" + (f" failed: {row['failed']}" if "failed" in row else ""),
                  file=sys.stderr)
    quanta_logs = sorted(workdir.glob("quanta-r*.log"))
    info = run_record(command="python benchmarks/peer_gguf.py " + shlex.join(sys.argv[1:]), code=code_version(),
                      cpu_flags_all=sorted(cpu_flags()), model=gguf_summary(gguf), rounds=args.rounds, ctx=args.ctx,
                      llama_cpp_python=LLAMA_CPP_PYTHON, llama_server_binary=str(binary),
                      commands={s: shlex.join(c) for s, c in cmds.items()},
                      quanta_startup=startup_line(quanta_logs[-1]) if quanta_logs else "",
                      env={k: v for k, v in os.environ.items() if k in ENV_KNOBS})
    table = render(rounds, info, flags)
    print(table)
    print(f"server logs and bench results: {workdir}")
    if args.out:
        out = Path(args.out) if "/" in args.out else Path(__file__).parent / "results" / args.out
        summary = {key: {s: summarize(v) for s in SERVERS if (v := values(rounds[s], key))} for key in ROWS}
        write_result(out, table, {**info, "summary": summary, "per_round": rounds})
        print(f"wrote {beside(out, '.md')} and {beside(out, '.json')}")
    return 0


def values(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def render(rounds: dict[str, list[dict]], info: dict, flags: dict[str, list[str]]) -> str:
    model = info["model"]
    procs = {s: {str(len(r["memory_at_load"]["processes"])) for r in rounds[s] if "memory_at_load" in r} for s in SERVERS}
    types = ", ".join(f"{t} {n}" for t, n in model.get("tensor_types", {}).items()) or model.get("error", "?")
    out = [f"# quanta vs llama-server on {Path(model['path']).name} ({info['date'][:10]})", "",
           f"- command: `{info['command']}`",
           f"- model: `{model['path']}`, {model['bytes'] / 2**20:.1f} MiB; tensors per type: {types}",
           f"- machine: {info['cpu']}, {info['logical_cores']} logical cores, flags: {info['cpu_flags']}; "
           f"1-minute load before: {info['load']:.2f}; quanta code: {info['code']}",
           f"- llama-server (llama.cpp vendored in llama-cpp-python {LLAMA_CPP_PYTHON}): `{' '.join(flags['llama-server'])}`",
           f"- quanta: `quanta serve {' '.join(flags['quanta'])}`; startup: `{info['quanta_startup']}`",
           f"- one configuration with {SLOTS} slots of {info['ctx']} tokens for every row (no restart between workloads); "
           "kernel environment: " + (", ".join(f"`{k}={v}`" for k, v in info["env"].items()) or "none set"),
           "- memory: summed over the server process and its children (processes at first /health: "
           + ", ".join(f"{s} {'/'.join(sorted(procs[s])) or '-'}" for s in SERVERS)
           + "); MiB = 2^20 bytes; client: `quanta bench run` on the same machine",
           f"- rounds: {info['rounds']}, servers alternating first; median (min-max) over rounds; "
           "ratio > 1 means quanta is better (llama / quanta for times and memory, quanta / llama for tok/s)", "",
           "| figure | llama-server | quanta | ratio |", "|---|---|---|---|"]
    for key, (label, unit, fmt, better) in ROWS.items():
        stats = {s: summarize(v) if (v := values(rounds[s], key)) else None for s in SERVERS}
        cells = [f"{st['median']:{fmt}} {unit} ({st['min']:{fmt}}-{st['max']:{fmt}})" if st else "-" for st in stats.values()]
        llama, ours = stats["llama-server"], stats["quanta"]
        ratio = "-"
        if better and llama and ours and min(llama["median"], ours["median"]) > 0:
            ratio = f"{(llama['median'] / ours['median']) ** (1 if better == 'lower' else -1):.2f}"
        out.append(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
    failures = {s: [f"round {i + 1}: {r['failed']}" for i, r in enumerate(rounds[s]) if "failed" in r] for s in SERVERS}
    if any(failures.values()):
        cells = ["failed: " + "; ".join(f).replace("|", "/") if f else "-" for f in failures.values()]
        out.append(f"| failed | {cells[0]} | {cells[1]} | - |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
