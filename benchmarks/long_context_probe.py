"""A long cold prompt while other sessions decode at long context: quanta against ``llama-server``.

Each server gets ``--decoders`` (3) streaming ``/v1/completions`` requests of ``--decode-context``
(4,096) random prompt ids and ``DECODE_OUT`` tokens out (``ignore_eos``). Once every one of them
has streamed a token (all are decoding), a probe request of N random ids and one token out is sent
(N from ``--probe-tokens``, default 8,000 and 16,000). Figures, client-side:

- probe prefill tok/s: N / the probe's time to its first token;
- the decoders' inter-token gaps while the probe was in flight: the longest, and the median.

Servers: ``llama-server -np D+1 -c (D+1)*C`` and ``quanta serve --max-num-seqs D+1 --max-model-len
C`` with C the longest probe + 64. SmolLM2-135M was trained on 8,192 positions and llama-server
refuses a longer request (its slot's context is capped there); such a probe is recorded as refused
(quanta computes past it: figures of speed only). Rounds alternate which server goes first.

Usage (never in CI): ``python benchmarks/long_context_probe.py [--probe-tokens 8000,16000]
[--decoders 3] [--decode-context 4096] [--rounds 2] [--servers llama-server,quanta]
[--quanta-args "..."] [--out benchmarks/results/long_context_probe]``.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from peer_llama_cpp import (  # noqa: E402
    THREADS,
    int_list,
    run_record,
    server_pair,
    start,
    stop,
    summarize,
    write_result,
)

DECODE_OUT = 4000  # more than the probe lasts; the decoders are closed after it
ROOM = 64


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


class Decoder(threading.Thread):
    """One streaming request; ``times`` holds each token's arrival (monotonic seconds)."""

    def __init__(self, url: str, model: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {"model": model, "prompt": prompt, "max_tokens": DECODE_OUT, "temperature": 0,
                                    "ignore_eos": True, "stream": True}
        self.times: list[float] = []
        self.stop_flag = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=3600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if self.stop_flag.is_set():
                        return
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.times.append(time.monotonic())
        except httpx.HTTPError as exc:
            self.error = str(exc)


def probe(url: str, model: str, prompt: list[int]) -> tuple[float | None, str | None]:
    """Seconds to the probe's first token, or the server's refusal."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
        if r.status_code >= 400:
            r.read()
            return None, r.json().get("error", {}).get("message", r.text)
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.monotonic() - t0, None
    return None, "no token streamed"


def one_round(url: str, tokens: int, decoders: int, context: int, seed: int) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    threads = [Decoder(url, model, ids(context, seed + i)) for i in range(decoders)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 1800
    while not all(t.times for t in threads) and time.monotonic() < deadline:
        if any(t.error for t in threads):
            raise RuntimeError(f"{url}: a decoder failed: {[t.error for t in threads if t.error]}")
        time.sleep(0.05)
    t0 = time.monotonic()
    seconds, refused = probe(url, model, ids(tokens, seed + 100))
    t1 = time.monotonic()
    for t in threads:
        t.stop_flag.set()
    gaps = [b - a for t in threads for a, b in zip(t.times, t.times[1:]) if a >= t0 and b <= t1 + 1.0]
    row = {"probe_tokens": tokens, "refused": refused, "probe_tok_s": tokens / seconds if seconds else None,
           "max_gap_ms": max(gaps) * 1e3 if gaps else None, "median_gap_ms": statistics.median(gaps) * 1e3 if gaps else None}
    for t in threads:
        t.join(timeout=60)
    return row


def cell(rows: list[dict], key: str, say_refusal: bool = False) -> str:
    vals = [r[key] for r in rows if r[key] is not None]
    if not vals:
        refusals = {r["refused"] for r in rows if r["refused"]}
        return f"refused: {refusals.pop()}" if refusals and say_refusal else "-"
    s = summarize(vals)
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def render(results: dict, info: dict, args) -> str:
    out = [f"# A long cold prompt while {args.decoders} sessions decode at {args.decode_context:,} tokens ({info['date'][:10]})", "",
           f"- machine: {info['cpu']}, {info['logical_cores']} cores; flags `{info['cpu_flags']}`; "
           f"1-minute load before: {info['load']:.1f}",
           f"- command: `python benchmarks/long_context_probe.py --probe-tokens {','.join(map(str, args.probe_tokens))} "
           f"--decoders {args.decoders} "
           f"--decode-context {args.decode_context} --rounds {args.rounds}"
           f"{' --quanta-args ' + shlex.quote(args.quanta_args) if args.quanta_args else ''}`",
           f"- llama-server `{' '.join(info['llama_args'])}`; quanta `{' '.join(info['quanta_args'])}`",
           f"- median (min-max) over {args.rounds} rounds; gaps: between consecutive tokens of one decoding "
           "session while the probe was in flight", "",
           "| probe tokens | server | probe prefill tok/s | longest decode gap, ms | median decode gap, ms |",
           "|---|---|---|---|---|"]
    for tokens, per in results.items():
        for server, rows in per.items():
            out.append(f"| {tokens:,} | {server} | {cell(rows, 'probe_tok_s', True)} | {cell(rows, 'max_gap_ms')} "
                       f"| {cell(rows, 'median_gap_ms')} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe-tokens", type=int_list, default=[8000, 16000], help="comma list of probe prompt lengths")
    ap.add_argument("--decoders", type=int, default=3)
    ap.add_argument("--decode-context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--servers", default="llama-server,quanta")
    ap.add_argument("--quanta-args", default="", help="extra flags for quanta serve")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "long_context_probe")
    args = ap.parse_args()
    sizes = args.probe_tokens
    if args.decoders < 1 or args.decode_context < 2:
        ap.error("--decoders and --decode-context must be positive")
    room, slots = max(max(sizes), args.decode_context) + ROOM, args.decoders + 1
    workdir = Path(tempfile.mkdtemp(prefix="quanta-probe-"))
    llama_args = ["-t", str(THREADS), "-np", str(slots), "-c", str(slots * room)]
    quanta_args = ["--max-num-seqs", str(slots), "--max-model-len", str(room), *shlex.split(args.quanta_args)]
    servers, ports, cmds = server_pair(args.servers, llama_args, quanta_args)
    info = run_record(llama_args=llama_args, quanta_args=quanta_args)
    results: dict[int, dict[str, list[dict]]] = {n: {s: [] for s in servers} for n in sizes}
    for rnd in range(args.rounds):
        for server in servers if rnd % 2 == 0 else servers[::-1]:
            for n in sizes:  # a fresh server for each probe: no decoder or cache left from the last
                proc = start(cmds[server], ports[server], workdir / f"{server}.log")
                try:
                    row = one_round(f"http://127.0.0.1:{ports[server]}", n, args.decoders, args.decode_context,
                                    seed=rnd * 10_000 + n)
                finally:
                    stop(proc)
                results[n][server].append(row)
                print(f"  round {rnd + 1} {server} {n}: {row}", file=sys.stderr)
    text = render(results, info, args)
    print(text)
    write_result(args.out, text, {"info": info, "results": {str(k): v for k, v in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
