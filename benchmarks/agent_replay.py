"""Agent replay: prefix reuse on growing multi-turn contexts, with and without it.

Three coding-agent sessions start ``--stagger`` seconds apart. Every turn of a
session resends its whole conversation (system prompt, task, every earlier
reply and tool output) plus one new tool-output-sized block, through the
OpenAI chat endpoint, streamed, greedy, ``ignore_eos``. The same workload
runs against a fresh ``quanta serve`` with prefix reuse (the default) and
with ``--no-prefix-cache``.

Per turn it reports the prompt tokens served from cache and computed
(``usage.prompt_tokens_details.cached_tokens``), TTFT (client side: request
sent to first streamed token, so it includes waiting behind other sessions'
steps), and the prefill rate over the computed tokens only (computed prompt
tokens / TTFT). Per condition it adds the server-side prefill rate from the
engine trace (prompt tokens of prefill steps / their busy time) and whether
each turn's greedy output equals the other condition's.

Usage::

    python benchmarks/agent_replay.py [--turns 5] [--tool-words 300] [--stagger 4]
        [--repeats 2] [--server-flags "--max-num-seqs 4 --max-model-len 4096"]
        [--out benchmarks/results/agent_replay]

Each condition runs ``--repeats`` times, alternately, each time on a fresh
server; figures are medians with their min-max range. Writes ``OUT.json``
(every sample, the machine, the command) and ``OUT.md`` (the tables). Every
wait is bounded (``--timeout`` per request, server start 300 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quanta.bench.output import code_version, machine  # noqa: E402

SYSTEM = ("You are a coding agent working in a Python repository. Read the tool output, decide the next "
          "command, and explain your reasoning briefly.")
TASKS = [
    "The test suite fails with a NameError in main.py. Find the cause and fix it.",
    "Add type hints to utils.py and make sure mypy passes.",
    "Summarise what the repository does and list its entry points.",
]
WORDS = ("def return import self value result config path file line error test module class data list "
         "dict index count item name args kwargs yield async await raise except assert print open read").split()


def tool_block(words: int, rng: random.Random, turn: int) -> str:
    """A tool output of about ``words`` words: code-listing lines with line numbers."""
    lines, n = [f"$ tool call {turn}: cat src/module_{turn}.py"], 0
    while n < words:
        k = rng.randint(4, 10)
        lines.append(f"{len(lines):4d}  " + " ".join(rng.choice(WORDS) for _ in range(k)))
        n += k + 1
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], log_path: Path, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "quanta.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not healthy after {timeout} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


async def chat_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int, timeout: float) -> dict:
    """One streamed greedy chat turn: text, usage and client-side times (seconds)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, first, texts, usage = time.monotonic(), None, [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    first = first or time.monotonic()
                    texts.append(text)
    done = time.monotonic()
    return {"text": "".join(texts), "usage": usage, "sent": sent, "ttft": (first or done) - sent, "e2e": done - sent}


async def replay(url: str, args) -> list[dict]:
    """All sessions' turns; each sample: session, turn, start (s from run start), usage, ttft, text."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    t0 = time.monotonic()
    samples: list[dict] = []

    async def session(i: int, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(i * args.stagger)
        rng = random.Random(1000 + i)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": TASKS[i % len(TASKS)] + "\n\n" + tool_block(args.tool_words, rng, 0)}]
        for turn in range(args.turns):
            out = await chat_turn(client, url, model, messages, args.max_tokens, args.timeout)
            samples.append({"session": i, "turn": turn, "start": out["sent"] - t0, **out})
            messages = messages + [{"role": "assistant", "content": out["text"]},
                                   {"role": "user", "content": "Tool output:\n" + tool_block(args.tool_words, rng, turn + 1)}]

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(session(i, client) for i in range(args.sessions)))
    return sorted(samples, key=lambda s: (s["session"], s["turn"]))


def server_prefill(url: str) -> dict:
    """Prompt tokens and busy seconds of the trace's prefill steps, and the prefix-cache counters."""
    recs = httpx.get(url + "/v1/trace", timeout=30).json()["records"]
    pre = [r for r in recs if r["kind"] == "prefill"]
    tokens, secs = sum(sum(r["num_new_tokens"]) for r in pre), sum(r["end"] - r["start"] for r in pre)
    metrics = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("quanta:prefix_cache_", "quanta:prompt_tokens_total")) and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            metrics[name] = float(value)
    return {"prefill_steps": len(pre), "prefill_tokens": tokens, "prefill_seconds": secs,
            "prefill_tok_per_s": tokens / secs if secs else None, "metrics": metrics}


def run_condition(name: str, flags: list[str], args) -> dict:
    log = Path(tempfile.gettempdir()) / f"agent_replay_{name}_{os.getpid()}.log"
    print(f"condition {name}: quanta serve {' '.join(flags)} (log {log})", file=sys.stderr, flush=True)
    proc, url = start_server(flags, log)
    try:
        config = httpx.get(url + "/v1/config", timeout=10).json()
        load_before = os.getloadavg()
        t = time.monotonic()
        samples = asyncio.run(replay(url, args))
        wall = time.monotonic() - t
        server = server_prefill(url)
        return {"name": name, "flags": flags, "config": config, "samples": samples, "wall_s": wall,
                "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "server": server}
    finally:
        stop_server(proc)


def _row(s: dict) -> dict:
    prompt = s["usage"]["prompt_tokens"]
    cached = (s["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"prompt": prompt, "cached": cached, "new": prompt - cached, "ttft": s["ttft"],
            "rate": (prompt - cached) / s["ttft"] if s["ttft"] > 0 else None}


def _median(xs) -> float:
    return statistics.median(list(xs))


def _span(xs, digits: int = 2) -> str:
    """``median (min-max)`` of ``xs`` with ``digits`` decimals; just the value when there is one."""
    xs = list(xs)
    fmt = f"{{:.{digits}f}}".format
    return fmt(xs[0]) if len(xs) == 1 else f"{fmt(_median(xs))} ({fmt(min(xs))}-{fmt(max(xs))})"


def markdown(doc: dict) -> str:
    """The per-turn table and the per-condition summary; each figure is the
    median over the repeats with its min-max range."""
    on, off = doc["conditions"]["on"], doc["conditions"]["off"]
    loads = ", ".join(f"{name} {r['loadavg_before'][0]:.1f}/{r['loadavg_after'][0]:.1f}"
                      for name in ("on", "off") for r in doc["conditions"][name])
    a = doc["args"]
    lines = [
        f"# Agent replay: prefix reuse on vs off ({doc['date']})", "",
        f"Command: `{doc['command']}`  ", f"Code: {doc['code_version']}  ",
        f"Machine: {doc['machine']['cpu']}, {doc['machine']['logical_cores']} logical cores, {doc['machine']['platform']}, "
        f"Python {doc['machine']['python']}; 1-min load average before/after each run: {loads} "
        "(the machine was shared with other work, so times are noisy)  ",
        f"Server flags: `{' '.join(on[0]['flags'])}` (off adds `--no-prefix-cache`); scheduler "
        f"{on[0]['config']['scheduler']}, dtype {on[0]['config']['dtype']}  ",
        f"Workload: {a['sessions']} sessions x {a['turns']} turns, started {a['stagger']} s apart; every turn resends the "
        f"conversation plus ~{a['tool_words']} words of tool output; {a['max_tokens']} output tokens (greedy, ignore_eos); "
        f"{a['repeats']} repeats per condition, run alternately (on, off, on, off, ...)", "",
        "TTFT is client side (sent -> first token) and includes waiting behind the other sessions' steps; "
        "new tok/s = computed (new) prompt tokens / TTFT. Figures: median (min-max) over the repeats.", "",
        "| session | turn | prompt tok | on: cached | on: new | on: TTFT s | on: new tok/s | off: new | off: TTFT s | off: new tok/s | "
        "same output |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = on + off
    for k, first in enumerate(on[0]["samples"]):
        ra, rb = [_row(r["samples"][k]) for r in on], [_row(r["samples"][k]) for r in off]
        same = "yes" if len({r["samples"][k]["text"] for r in runs}) == 1 else "NO"
        cached = _median(r["cached"] for r in ra)
        lines.append(f"| {first['session']} | {first['turn']} | {ra[0]['prompt']} | {cached:.0f} | {ra[0]['prompt'] - cached:.0f} | "
                     f"{_span(r['ttft'] for r in ra)} | {_span((r['rate'] for r in ra), 0)} | {rb[0]['new']} | "
                     f"{_span(r['ttft'] for r in rb)} | {_span((r['rate'] for r in rb), 0)} | {same} |")
    lines += ["", "| condition | prompt tok | cached | cached share | median TTFT s | server prefill tok | prefill busy s | "
              "server prefill tok/s | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, reps in (("on", on), ("off", off)):
        rows = [[_row(s) for s in r["samples"]] for r in reps]
        prompt = sum(x["prompt"] for x in rows[0])
        cached = _median(sum(x["cached"] for x in rr) for rr in rows)
        sv = [r["server"] for r in reps]
        lines.append(f"| {name} | {prompt} | {cached:.0f} | {cached / prompt:.0%} | "
                     f"{_span(_median(x['ttft'] for x in rr) for rr in rows)} | "
                     f"{_median(v['prefill_tokens'] for v in sv):.0f} | {_span((v['prefill_seconds'] for v in sv), 1)} | "
                     f"{_span((v['prefill_tok_per_s'] for v in sv), 0)} | {_span((r['wall_s'] for r in reps), 1)} |")
    n = len(on[0]["samples"])
    same = sum(len({r["samples"][k]["text"] for r in runs}) == 1 for k in range(n))
    lines += ["", f"Greedy outputs identical in every run with and without reuse: {same} of {n} turns.",
              f"Prefix-cache counters after the first run with reuse: {on[0]['server']['metrics']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--tool-words", type=int, default=300, help="words of tool output appended per turn (~1.6 tokens each)")
    p.add_argument("--stagger", type=float, default=4.0, help="seconds between session starts")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs per condition, alternating on/off")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--server-flags", default="--max-num-seqs 4 --max-model-len 4096")
    p.add_argument("--out", default="benchmarks/results/agent_replay")
    p.add_argument("--render", metavar="JSON", help="only re-render OUT.md from a result JSON of this script")
    args = p.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        text = markdown(doc)
        Path(args.render).with_suffix(".md").write_text(text)
        print(text)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = shlex.split(args.server_flags)
    conditions: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        conditions["on"].append(run_condition("on", flags, args))
        conditions["off"].append(run_condition("off", flags + ["--no-prefix-cache"], args))
    doc = {"kind": "agent_replay", "date": datetime.now(UTC).isoformat(timespec="seconds"),
           "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
           "code_version": code_version(), "machine": machine(), "args": vars(args), "conditions": conditions}
    out.with_name(out.name + ".json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    out.with_name(out.name + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
