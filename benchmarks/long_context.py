"""Prefill and decode at long context: quanta against llama.cpp's ``llama-server`` on one CPU.

For each context length N (``--contexts``, default 2048,8192) each server gets one streaming
``/v1/completions`` request alone: ``N - 64`` random prompt token ids (a new draw each round, so no
cache helps) and 64 tokens out (``ignore_eos``). Figures, client-side:

- prefill tok/s: prompt tokens / time to the first token (a cold prefill of the whole prompt);
- decode ms/token: (last token - first token) / 63, at context N.

Servers (one slot, the context reaching past the longest request): ``llama-server -np 1 -c C`` (its
default f16 KV) and ``quanta serve --max-num-seqs 1 --max-model-len C`` (``--kv-cache-dtype auto``),
C = the longest context + 64. Rounds alternate which server goes first; the table has the median
(min-max) over rounds and the quanta / llama-server ratio of medians (>1: quanta faster).
SmolLM2-135M was trained on 8,192 positions: past that both servers still compute, but what the
model says there is not meaningful (the figures are of speed only).

Usage (never in CI): ``python benchmarks/long_context.py [--contexts 2048,8192] [--rounds 3]
[--servers llama-server,quanta] [--out benchmarks/results/long_context]``. The ``llama-server``
binary is ``peer_llama_cpp.py``'s cached build; ``--quanta-args`` adds quanta flags.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
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
    startup_line,
    stop,
    summarize,
    write_result,
)

OUT_TOKENS = 64


def one_request(url: str, context: int, seed: int) -> dict:
    """Stream one request of ``context - 64`` random ids; prefill tok/s and decode ms/token."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 40000) for _ in range(context - OUT_TOKENS)]
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                if json.loads(line[6:])["choices"][0].get("text") is not None:
                    times.append(time.monotonic() - t0)
    if len(times) < 2:
        raise RuntimeError(f"{url}: {len(times)} tokens streamed for a {context}-token context")
    return {"prefill_tok_s": len(prompt) / times[0], "decode_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3,
            "tokens": len(times)}


def render(results: dict, info: dict, args) -> str:
    out = [f"# Long context: quanta vs llama-server ({info['date'][:10]})", "",
           f"- machine: {info['cpu']}, {info['logical_cores']} cores; flags `{info['cpu_flags']}`; "
           f"1-minute load before: {info['load']:.1f}",
           f"- command: `python benchmarks/long_context.py --contexts {','.join(map(str, args.contexts))} --rounds {args.rounds}"
           f"{' --quanta-args ' + shlex.quote(args.quanta_args) if args.quanta_args else ''}`",
           f"- llama-server `{' '.join(info['llama_args'])}`; quanta `{' '.join(info['quanta_args'])}`",
           f"- quanta: {info['quanta_startup']}",
           f"- one request alone per context, {OUT_TOKENS} tokens out; median (min-max) over {args.rounds} rounds; "
           "ratio = quanta / llama-server speed", "",
           "| context | figure | llama-server | quanta | quanta / llama |", "|---|---|---|---|---|"]
    for context, per in results.items():
        for key, label, faster in (("prefill_tok_s", "prefill tok/s", True), ("decode_ms", "decode ms/token", False)):
            cells, meds = [], {}
            for server in ("llama-server", "quanta"):
                vals = [r[key] for r in per.get(server, [])]
                if vals:
                    s = summarize(vals)
                    meds[server] = s["median"]
                    cells.append(f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})")
                else:
                    cells.append("-")
            ratio = "-"
            if len(meds) == 2:
                ratio = f"{(meds['quanta'] / meds['llama-server']) if faster else (meds['llama-server'] / meds['quanta']):.2f}x"
            out.append(f"| {context:,} | {label} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int_list, default=[2048, 8192], help="comma list of context lengths (tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", default="llama-server,quanta")
    ap.add_argument("--quanta-args", default="", help="extra flags for quanta serve")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "long_context")
    args = ap.parse_args()
    contexts = args.contexts
    if min(contexts) <= OUT_TOKENS + 1:
        ap.error(f"--contexts: each context must exceed {OUT_TOKENS + 1} tokens")
    room = max(contexts) + OUT_TOKENS
    workdir = Path(tempfile.mkdtemp(prefix="quanta-long-"))
    llama_args = ["-t", str(THREADS), "-np", "1", "-c", str(room)]
    quanta_args = ["--max-num-seqs", "1", "--max-model-len", str(room), *shlex.split(args.quanta_args)]
    servers, ports, cmds = server_pair(args.servers, llama_args, quanta_args)
    info = run_record(llama_args=llama_args, quanta_args=quanta_args)
    results: dict[int, dict[str, list[dict]]] = {c: {s: [] for s in servers} for c in contexts}
    for rnd in range(args.rounds):
        for server in servers if rnd % 2 == 0 else servers[::-1]:
            proc = start(cmds[server], ports[server], workdir / f"{server}.log")
            try:
                for c in contexts:
                    got = one_request(f"http://127.0.0.1:{ports[server]}", c, seed=rnd * 1000 + c)
                    results[c][server].append(got)
                    print(f"  round {rnd + 1} {server} {c}: {got}", file=sys.stderr)
            finally:
                stop(proc)
    info["quanta_startup"] = startup_line(workdir / "quanta.log") if "quanta" in servers else ""
    text = render(results, info, args)
    print(text)
    write_result(args.out, text, {"machine": info, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
