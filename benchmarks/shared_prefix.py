"""Eight agent sessions that share a long prefix (system prompt and tools): is it held once and
computed once, and how soon do sessions 2-8 get their first token?

Starts ``quanta serve`` (embedded model, ``--max-model-len 8192``, 8 slots, extra flags with
``--serve-args``), sends session 1 (a ``--prefix``-token shared part, then its own 50-word
question) and waits for its answer, then sends sessions 2-8 at once, each with the same shared
part and its own question, streamed. Prints, per session, the prompt and cached tokens
(``usage``) and the TTFT; and, from ``/metrics`` after session 1 and after all eight, the
prompt tokens computed (queried minus hit), the prefix-cache hits, and the KV blocks in use and
cached. The shared part is computed once if sessions 2-8 together compute only their own tails.
Records the machine's CPU flags. Never run in CI.

Usage: ``python benchmarks/shared_prefix.py [--prefix 6000] [--serve-args "--dtype fp32"]``
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx

from quanta.bench.server import start

METRICS = ("quanta:prefix_cache_queries_total", "quanta:prefix_cache_hits_total", "quanta:kv_blocks_used",
           "quanta:kv_blocks_cached", "quanta:kv_blocks_total")


def _cpu_flags() -> str:
    words = Path("/proc/cpuinfo").read_text().split()
    return " ".join(sorted({w for w in words if w in ("avx2", "fma") or w.startswith("avx512")}))


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    return {name: float(m.group(1)) for name in METRICS
            if (m := re.search(rf"^{re.escape(name)} (\S+)$", text, re.M))}


def computed(a: dict[str, float], b: dict[str, float]) -> float:
    """Prompt tokens computed between two scrapes: looked up minus found in the cache."""
    queried = b["quanta:prefix_cache_queries_total"] - a["quanta:prefix_cache_queries_total"]
    return queried - (b["quanta:prefix_cache_hits_total"] - a["quanta:prefix_cache_hits_total"])


def _shared_text(base: str, tokens: int) -> str:
    """A system text of about ``tokens`` tokens (counted by the server's /tokenize)."""
    words, text = tokens, ""
    for _ in range(4):
        text = " ".join(f"tool{i % 97} takes argument{i % 13} and returns result{i % 31}." for i in range(words // 6))
        count = httpx.post(base + "/tokenize", json={"prompt": text}, timeout=60).json()["count"]
        words = max(6, int(words * tokens / max(count, 1)))
    return text


def _session(base: str, model: str, shared: str, index: int) -> dict:
    question = " ".join(f"question{index} word{j}" for j in range(25))
    body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": shared}, {"role": "user", "content": question}]}
    start_t, ttft, usage = time.monotonic(), None, None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.monotonic() - start_t
            usage = chunk.get("usage") or usage
    return {"session": index + 1, "ttft": ttft, "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=6000, help="tokens of the shared part")
    parser.add_argument("--serve-args", default="", help="extra quanta serve flags")
    args = parser.parse_args()
    flags = ["--max-model-len", "8192", "--max-num-seqs", "8", *shlex.split(args.serve_args)]
    server = start(flags, Path(tempfile.mkdtemp()))
    try:
        base = server.base_url
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        shared = _shared_text(base, args.prefix)
        before = _metrics(base)
        first = _session(base, model, shared, 0)
        after_first = _metrics(base)
        with ThreadPoolExecutor(7) as pool:
            rest = list(pool.map(lambda i: _session(base, model, shared, i), range(1, 8)))
        after_all = _metrics(base)
    finally:
        server.stop()
    print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; cpu flags: {_cpu_flags()}")
    print(f"command: python benchmarks/shared_prefix.py --prefix {args.prefix}"
          + (f" --serve-args {shlex.quote(args.serve_args)}" if args.serve_args else "") + f"; serve flags: {' '.join(flags)}")
    print("| session | prompt tokens | cached tokens | TTFT s |\n|---|---|---|---|")
    for row in [first, *rest]:
        print(f"| {row['session']} | {row['prompt']:,} | {row['cached']:,} | {row['ttft']:.2f} |")
    ttfts = [row["ttft"] for row in rest]
    print(f"sessions 2-8: TTFT median {statistics.median(ttfts):.2f} s, max {max(ttfts):.2f} s")
    print(f"prompt tokens computed: session 1 {computed(before, after_first):,.0f}; sessions 2-8 together "
          f"{computed(after_first, after_all):,.0f} (their prompts: {sum(r['prompt'] for r in rest):,})")
    print("KV blocks after all eight: " + ", ".join(f"{k.split(':')[1]} {v:,.0f}" for k, v in after_all.items()
                                                    if "kv_blocks" in k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
