"""Kill one of 2 replicas mid-run: the other's streams finish, the killed one's end with an
error event, Ray Serve starts a new replica.

Starts ``quanta serve --replicas 2 --routing least-loaded`` on a local Ray, opens
``--streams`` chat streams one after another (each once the one before has its first
token, so least-loaded alternates replicas 0, 1, 0, 1...), kills replica 0's process
(SIGKILL) ``--kill-after`` s later and follows every stream to its end: which replica served
it (``x-quanta-replica``), the events it got, how it ended (its finish reason, or the SSE
error event's message) and when, counted from the kill. Then waits until ``/health`` reports
both replicas again and sends one request to each. Prints Markdown with the machine's CPU
flags, the date and the command. Never run in CI.

Usage: ``python benchmarks/cluster_failover.py [--streams 4] [--kill-after 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from quanta.bench.server import start

SERVE = ["--replicas", "2", "--routing", "least-loaded", "--stats-interval", "0", "--max-model-len", "4096"]


def cpu_flags() -> str:
    words = Path("/proc/cpuinfo").read_text().split()
    return " ".join(sorted({w for w in words if w in ("avx2", "fma") or w.startswith("avx512")}))


async def follow(client: httpx.AsyncClient, base: str, index: int, first: asyncio.Event, row: dict) -> None:
    """Stream one chat completion; record its replica, events and end in ``row``."""
    body = {"messages": [{"role": "user", "content": f"Story {index}: tell a long story."}], "max_tokens": 1500,
            "temperature": 0, "stream": True, "ignore_eos": True}
    row.update(stream=index, events=0, end="cut without an end (a hang or a silent cut)")
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        row["replica"] = response.headers.get("x-quanta-replica")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            first.set()
            row["events"] += 1
            if line == "data: [DONE]":
                break
            data = json.loads(line.removeprefix("data: "))
            if "error" in data:
                row["end"] = f"error event: {data['error']['message']}"
            elif data["choices"] and data["choices"][0]["finish_reason"]:
                row["end"] = f"finish_reason {data['choices'][0]['finish_reason']}"
    row["ended_at"] = time.monotonic()
    first.set()


async def both_healthy(client: httpx.AsyncClient, base: str) -> float:
    """When ``/health`` next reports every replica up, its 200 (polled twice a second from a moment after the kill)."""
    await asyncio.sleep(0.5)
    while (await client.get(base + "/health")).status_code != 200:
        await asyncio.sleep(0.5)
    return time.monotonic()


def replica_pids(base: str) -> list[int]:
    replicas = httpx.get(base + "/v1/config", timeout=60).json()["cluster"]["replica_configs"]
    return [replicas[str(i)]["replica"]["pid"] for i in range(len(replicas))]


async def run(base: str, streams: int, kill_after: float) -> tuple[list[dict], dict]:
    pids = replica_pids(base)
    rows: list[dict] = [{} for _ in range(streams)]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        for i in range(streams):
            first = asyncio.Event()
            tasks.append(asyncio.create_task(follow(client, base, i, first, rows[i])))
            await first.wait()
        await asyncio.sleep(kill_after)
        os.kill(pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        healthy = asyncio.create_task(both_healthy(client, base))
        await asyncio.gather(*tasks)
        healthy_at = await healthy
        after = []
        for _ in range(2):  # least-loaded with nothing in flight: replica 0 (restarted) answers
            r = await client.post(base + "/v1/completions", json={"prompt": "One, two,", "max_tokens": 4, "temperature": 0})
            after.append((r.headers.get("x-quanta-replica"), r.status_code))
    for row in rows:
        row["seconds_after_kill"] = row.pop("ended_at") - killed_at
    new = replica_pids(base)
    return rows, {"killed_pid": pids[0], "new_pid": new[0], "other_pid": (pids[1], new[1]),
                  "restart_s": healthy_at - killed_at, "after": after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--kill-after", type=float, default=3.0)
    args = parser.parse_args()
    started = datetime.now(UTC)
    proc = start(SERVE, Path(tempfile.mkdtemp(prefix="cluster-failover-")), timeout=300)
    try:
        rows, restart = asyncio.run(run(proc.base_url, args.streams, args.kill_after))
    finally:
        proc.stop()
    print(f"- date: {started:%Y-%m-%d %H:%M} UTC; 1-minute load after: {os.getloadavg()[0]:.1f}")
    print(f"- machine: {os.cpu_count()} cores; flags: {cpu_flags()}")
    print(f"- command: python benchmarks/cluster_failover.py --streams {args.streams} --kill-after {args.kill_after:g} "
          f"(server: quanta serve {' '.join(SERVE)})\n")
    print("| stream | replica | SSE events | end | seconds after the kill |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['stream']} | {row['replica']} | {row['events']} | {row['end']} | {row['seconds_after_kill']:.2f} |")
    print(f"\nReplica 0: pid {restart['killed_pid']} killed; Ray Serve's new replica (pid {restart['new_pid']}) passed "
          f"/health {restart['restart_s']:.1f} s after the kill; replica 1 kept pid {restart['other_pid'][0]} "
          f"(after: {restart['other_pid'][1]}). Requests after the restart (replica, HTTP status): {restart['after']}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
