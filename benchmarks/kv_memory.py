"""Resident memory of quanta and llama.cpp's ``llama-server`` holding the same KV context.

Each server is started alone, then holds ``--sequences`` sequences of ``--tokens`` tokens at once:
that many streaming ``/v1/completions`` requests sent together, each a distinct prompt of random
token ids (no prefix in common, so nothing is shared) of ``tokens - 16`` ids and 16 tokens out
(``ignore_eos``). The table gives the server process's resident memory (``VmRSS`` of
``/proc/PID/status``) after start and 1 s after every request ended, and its peak (``VmHWM``); a
server that answers a fill request with an error has the error's message in the table instead.
quanta's pool keeps a finished request's blocks (its prefix cache) and never returns pages, so
"after" is the memory with the context held; llama-server allocates and clears its whole KV
cache at start.

Configurations (``--configs``, default all): ``llama-f16`` (``-np S -c S*T``, its default f16 KV),
``llama-q8_0`` (``--cache-type-k q8_0 --cache-type-v q8_0 -fa on``: llama.cpp quantizes V only
with flash attention), ``quanta-auto`` (``--max-num-seqs S --max-model-len T``, ``--kv-cache-dtype
auto``), ``quanta-q8_0``, and both with ``--prompt-weights form`` (``quanta-form``,
``quanta-q8_0-form``: no reference copy of the projections). Usage (never in CI; ~3-5 min a configuration on 2 cores):
``python benchmarks/kv_memory.py [--sequences 8 --tokens 4096] [--out benchmarks/results/kv_memory]``.
The ``llama-server`` binary is ``peer_llama_cpp.py``'s cached build.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from peer_llama_cpp import (  # noqa: E402
    THREADS,
    build_llama_server,
    free_port,
    run_record,
    server_command,
    start,
    stop,
    write_result,
)
from quanta.model.loader import embedded_model_path  # noqa: E402

OUT_TOKENS = 16
#: seconds between the last response and the "holding" reading (quanta hands its heap's free pages
#: back once its engine is idle; the same wait for every server)
SETTLE_S = 1.0


def configs(sequences: int, tokens: int) -> dict[str, list[str]]:
    """Server flags of each configuration (binary, model and address added by :func:`command`)."""
    llama = ["-t", str(THREADS), "-np", str(sequences), "-c", str(sequences * tokens)]
    quanta = ["--max-num-seqs", str(sequences), "--max-model-len", str(tokens)]
    return {
        "llama-f16": llama,
        "llama-q8_0": [*llama, "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "-fa", "on"],
        "quanta-auto": quanta,
        "quanta-q8_0": [*quanta, "--kv-cache-dtype", "q8_0"],
        "quanta-form": [*quanta, "--prompt-weights", "form"],
        "quanta-q8_0-form": [*quanta, "--kv-cache-dtype", "q8_0", "--prompt-weights", "form"],
    }


class Refused(Exception):
    """The server answered a fill request with an error (e.g. a context past what it allows)."""


def memory(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` of a process, in GB (10^9 bytes)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 / 1e9 for k in ("VmRSS", "VmHWM")}


async def fill(url: str, sequences: int, tokens: int) -> float:
    """Send the sequences at once; seconds until the last one ended."""
    async def one(client: httpx.AsyncClient, model: str, seed: int) -> None:
        rng = random.Random(seed)
        prompt = [rng.randrange(1000, 40000) for _ in range(tokens - OUT_TOKENS)]
        body = {"model": model, "prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0, "ignore_eos": True}
        r = await client.post(f"{url}/v1/completions", json=body)
        if r.status_code >= 400:
            raise Refused(r.json().get("error", {}).get("message", r.text))

    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=3600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(*(one(client, model, seed) for seed in range(sequences)))
    return time.monotonic() - t0


def measure(name: str, cmd: list[str], port: int, sequences: int, tokens: int, log: Path) -> dict:
    proc = start(cmd, port, log)
    try:
        time.sleep(2)
        started = memory(proc.pid)
        try:
            seconds, refused = asyncio.run(fill(f"http://127.0.0.1:{port}", sequences, tokens)), None
        except Refused as exc:
            seconds, refused = None, str(exc)
        time.sleep(SETTLE_S)
        held = memory(proc.pid)
    finally:
        stop(proc)
    row = {"config": name, "after_start_gb": started["VmRSS"], "holding_gb": None if refused else held["VmRSS"],
           "peak_gb": held["VmHWM"], "fill_s": seconds, "refused": refused, "flags": cmd[cmd.index("--port") + 2:]}
    print(f"  {name}: {row}", file=sys.stderr)
    return row


def render(rows: list[dict], info: dict, sequences: int, tokens: int) -> str:
    out = [f"# Resident memory holding {sequences} x {tokens:,} tokens ({info['date'][:10]})", "",
           f"- machine: {info['cpu']}; flags `{info['cpu_flags']}`; 1-minute load before: {info['load']}",
           f"- command: `python benchmarks/kv_memory.py --sequences {sequences} --tokens {tokens}`",
           f"- each sequence: {tokens - OUT_TOKENS:,} random prompt token ids, {OUT_TOKENS} out; all sent at once; one run",
           "- GB = 10^9 bytes of VmRSS / VmHWM of the server process", "",
           "| configuration | flags | after start | holding the context | peak | fill time |", "|---|---|---|---|---|---|"]
    for r in rows:
        held = f"refused: {r['refused']}" if r.get("refused") else f"{r['holding_gb']:.2f} GB"
        fill = "-" if r["fill_s"] is None else f"{r['fill_s']:.0f} s"
        out.append(f"| {r['config']} | `{' '.join(r['flags'])}` | {r['after_start_gb']:.2f} GB | {held} "
                   f"| {r['peak_gb']:.2f} GB | {fill} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--configs", default=None, help="comma list of configurations (default: all)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kv_memory")
    args = ap.parse_args()
    table = configs(args.sequences, args.tokens)
    picked = args.configs.split(",") if args.configs else list(table)
    unknown = [c for c in picked if c not in table]
    if unknown:
        ap.error(f"unknown configuration {unknown[0]!r}; known: {', '.join(table)}")
    binary, gguf = build_llama_server(), embedded_model_path()
    workdir = Path(tempfile.mkdtemp(prefix="quanta-kvmem-"))
    info = run_record()
    rows = []
    for name in picked:
        port = free_port()
        rows.append(measure(name, server_command(name, table[name], port, binary, gguf), port, args.sequences, args.tokens,
                            workdir / f"{name}.log"))
    text = render(rows, info, args.sequences, args.tokens)
    print(text)
    write_result(args.out, text, {"machine": info, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
