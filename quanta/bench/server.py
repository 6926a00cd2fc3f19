"""Start, verify and stop a local ``quanta serve`` (for sweeps).

The server runs as a subprocess on 127.0.0.1 on a free port; its output goes
to a log file. Startup and shutdown are bounded; the process is stopped by
its PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0
_STARTUP_LINE = re.compile(r"scheduler=(\S+) max_num_seqs=\d+.*")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class QuantaServer:
    """A running ``quanta serve`` subprocess."""

    base_url: str
    flags: list[str]
    log_path: Path
    proc: subprocess.Popen = field(repr=False)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def startup_values(self) -> dict[str, str] | None:
        """``key=value`` pairs of the startup line (``scheduler=... max_num_seqs=...``), or None."""
        for line in self.log_tail(1_000_000).splitlines():
            m = _STARTUP_LINE.search(line)
            if m:
                return dict(kv.split("=", 1) for kv in m.group(0).split() if "=" in kv)
        return None

    def stop(self) -> None:
        """SIGTERM by PID, wait (bounded), then SIGKILL."""
        if self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)


def start(flags: list[str], log_dir: Path, timeout: float = STARTUP_TIMEOUT_S) -> QuantaServer:
    """Start ``python -m quanta.cli serve`` with ``flags`` and wait until ``/health`` is 200.

    Raises:
        RuntimeError: the process exited or stayed unhealthy past ``timeout``
            seconds (it is stopped; the message carries the log tail).
    """
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"quanta-serve-{port}.log"
    cmd = [sys.executable, "-m", "quanta.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = QuantaServer(f"http://127.0.0.1:{port}", list(flags), log_path, proc)
    deadline = time.monotonic() + timeout
    try:
        with httpx.Client(timeout=5.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"quanta serve exited with code {proc.returncode}:\n{server.log_tail()}")
                try:
                    if client.get(server.base_url + "/health").status_code == 200:
                        return server
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"quanta serve not healthy after {timeout:.0f} s:\n{server.log_tail()}")
                time.sleep(0.25)
    except BaseException:  # also Ctrl-C / SIGTERM while waiting: never leave the server behind
        server.stop()
        raise


def requested_values(flags: list[str]) -> dict[str, str]:
    """``--admit-k 4 --scheduler continuous`` -> ``{"admit_k": "4", "scheduler": "continuous"}``
    (scheduling flags only: ``--scheduler``, ``--max-num-seqs`` and the knobs)."""
    from quanta.cli import KNOB_FLAGS

    wanted = {"--scheduler", "--max-num-seqs", *KNOB_FLAGS}
    out = {}
    for i, f in enumerate(flags):
        if f in wanted and i + 1 < len(flags):
            out[f[2:].replace("-", "_")] = flags[i + 1]
    return out


def verify(requested: dict[str, str], applied: dict | None) -> str | None:
    """None when every requested value equals the applied one, else the reason
    (e.g. ``"requested admit_k=4, server applied admit_k=1"``)."""
    if applied is None:
        return "server reported no applied values (neither /v1/config nor a startup line)"
    bad = [f"requested {k}={v}, server applied {k}={applied.get(k, 'nothing')}"
           for k, v in requested.items() if str(applied.get(k)) != str(v)]
    return "; ".join(bad) or None
