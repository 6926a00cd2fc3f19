"""Slow clients against ``quanta serve``: does ``/health`` stay quick while thousands of
connections trickle request heads?

Starts the embedded model's server (``--max-model-len 256``), then opens ``--connections``
TCP connections from ``--workers`` client processes (each process holds at most ~10,000
sockets, under the usual open-files limit of 20,000); each connection sends a request line
and then one header line every ``--trickle`` seconds, never finishing its head (the
slowloris pattern). Meanwhile one probe thread sends ``GET /health`` every 0.1 s on a new
connection and another on one keep-alive connection. Prints the machine's CPU flags, how
many slow connections were open at the end (the server closes the ones waiting longest
for a head past ``--max-connections``, and any that take longer than its head deadline),
and both probes' latency: median, p99, max, failures. Never run in CI.

Usage: ``python benchmarks/slow_clients.py [--connections 20000] [--seconds 30]``
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from quanta.bench.server import free_port, launch


def _cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    wanted = sorted({w for w in text.split() if w in ("avx2", "fma") or w.startswith("avx512")})
    return " ".join(wanted)


def _trickle(port: int, count: int, seconds: float, trickle: float, opened, still_open) -> None:
    """One client process: ``count`` slow connections, kept trickling for ``seconds``."""
    socks = []
    for _ in range(count):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(sock)
        except OSError:
            continue
    with opened.get_lock():
        opened.value += len(socks)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(trickle)
        alive = []
        for sock in socks:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                alive.append(sock)
            except OSError:
                sock.close()
        socks = alive
    with still_open.get_lock():
        still_open.value += len(socks)
    for sock in socks:
        sock.close()


def _probe(port: int, stop: threading.Event, keep_alive: bool, out: dict) -> None:
    """``GET /health`` every 0.1 s; latencies and failures into ``out``."""
    latencies, failures = [], []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    while not stop.is_set():
        start = time.monotonic()
        try:
            if not keep_alive:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            body = conn.getresponse().read()
            if body != b'{"status":"ok"}':
                failures.append(body[:80])
        except (OSError, http.client.HTTPException) as exc:
            failures.append(repr(exc))
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        latencies.append(time.monotonic() - start)
        if not keep_alive:
            conn.close()
        time.sleep(0.1)
    out.update(latencies=latencies, failures=failures)


def _row(name: str, probe: dict) -> str:
    lat = sorted(probe["latencies"])
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    return (f"| {name} | {len(lat)} | {statistics.median(lat) * 1e3:.1f} | {p99 * 1e3:.1f} | {lat[-1] * 1e3:.1f} "
            f"| {len(probe['failures'])} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2, help="client processes holding the connections")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the slow connections trickle")
    parser.add_argument("--trickle", type=float, default=5.0, help="seconds between a connection's header lines")
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp()) / "slow-clients.log"
    server = launch([sys.executable, "-m", "quanta.cli", "serve", "--port", str(port), "--max-model-len", "256"],
                    base, base + "/health", log)
    try:
        stop, probes = threading.Event(), {"new connection": {}, "keep-alive": {}}
        threads = [threading.Thread(target=_probe, args=(port, stop, name == "keep-alive", out))
                   for name, out in probes.items()]
        for t in threads:
            t.start()
        opened, still_open = multiprocessing.Value("i", 0), multiprocessing.Value("i", 0)
        share = args.connections // args.workers
        workers = [multiprocessing.Process(target=_trickle, args=(port, share, args.seconds, args.trickle, opened,
                                                                  still_open)) for _ in range(args.workers)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        for t in threads:
            t.join()
    finally:
        server.stop()
    text = log.read_text(errors="replace")
    warnings = [ln for ln in text.splitlines() if "closed connections" in ln]
    print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; cpu flags: {_cpu_flags()}; cores: {multiprocessing.cpu_count()}")
    print(f"command: python benchmarks/slow_clients.py --connections {args.connections} --workers {args.workers} "
          f"--seconds {args.seconds:g} --trickle {args.trickle:g}")
    print(f"slow connections opened: {opened.value}; still open after {args.seconds:g} s: {still_open.value}")
    print("| /health probe | requests | median ms | p99 ms | max ms | failures |\n|---|---|---|---|---|---|")
    for name, probe in probes.items():
        print(_row(name, probe))
    print(f"server log lines about closed connections: {len(warnings)}" + (f" (first: {warnings[0].strip()})" if warnings else ""))
    print(f"tracebacks in the server log: {text.count('Traceback')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
