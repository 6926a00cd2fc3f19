"""Start, verify and stop a local server subprocess (for sweeps).

The server runs on 127.0.0.1 on a free port; its output goes to a log file.
Startup and shutdown are bounded; the process is stopped by its PID
(SIGTERM, then SIGKILL). :func:`start` runs ``quanta serve``;
:func:`launch` runs any command (``quanta bench sweep --server-cmd``).
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

STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0
_STARTUP_LINE = re.compile(r"scheduler=(\S+) max_num_seqs=\d+.*")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A running server subprocess.

    Attributes:
        base_url: ``http://127.0.0.1:PORT``.
        command: the argv it was started with.
        log_path: its stdout and stderr.
        group: the process leads its own process group, and :meth:`stop`
            signals the whole group (a server that forks workers, as vLLM
            does, leaves none behind).
    """

    base_url: str
    command: list[str]
    log_path: Path
    proc: subprocess.Popen = field(repr=False)
    group: bool = False

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def last_line(self) -> str:
        """The last non-empty line of the log, or ``no output``."""
        lines = [ln.strip() for ln in self.log_tail(4000).splitlines() if ln.strip()]
        return lines[-1][:200] if lines else "no output"

    def startup_values(self) -> dict[str, str] | None:
        """``key=value`` pairs of quanta's startup line (``scheduler=... max_num_seqs=...``), or None."""
        for line in self.log_tail(1_000_000).splitlines():
            m = _STARTUP_LINE.search(line)
            if m:
                return dict(kv.split("=", 1) for kv in m.group(0).split() if "=" in kv)
        return None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig) if self.group else os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """SIGTERM by PID (the process group with ``group``), wait (bounded), then SIGKILL."""
        if self.proc.poll() is not None:
            if self.group:  # the leader is gone; children it left in its group still get the signal
                self._signal(signal.SIGKILL)
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)


def launch(command: list[str], base_url: str, health_url: str, log_path: Path, timeout: float = STARTUP_TIMEOUT_S,
           group: bool = False) -> ServerProcess:
    """Start ``command`` (no shell) and wait until ``health_url`` answers 200.

    Raises:
        RuntimeError: the command cannot be run, the process exited, or it
            stayed unhealthy past ``timeout`` seconds (it is stopped; the
            message carries the log tail).
    """
    name = Path(command[0]).name
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        try:
            proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=group,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except OSError as exc:
            raise RuntimeError(f"cannot run {name}: {exc}") from exc
    server = ServerProcess(base_url, list(command), log_path, proc, group)
    deadline = time.monotonic() + timeout
    import httpx  # here, not at the top: ``quanta --help`` and ``--version`` import this module

    try:
        with httpx.Client(timeout=5.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {proc.returncode} ({server.last_line()})\n"
                                       f"--- log tail ---\n{server.log_tail()}")
                try:
                    if client.get(health_url).status_code == 200:
                        return server
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not healthy at {health_url} after {timeout:.0f} s ({server.last_line()})\n"
                                       f"--- log tail ---\n{server.log_tail()}")
                time.sleep(0.25)
    except BaseException:  # also Ctrl-C / SIGTERM while waiting: never leave the server behind
        server.stop()
        raise


def start(flags: list[str], log_dir: Path, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
    """Start ``python -m quanta.cli serve`` with ``flags`` and wait until ``/health`` is 200.

    Raises:
        RuntimeError: as :func:`launch`.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "quanta.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    base = f"http://127.0.0.1:{port}"
    return launch(cmd, base, base + "/health", log_dir / f"quanta-serve-{port}.log", timeout)


def requested_values(flags: list[str]) -> dict[str, str]:
    """``--admit-k 4 --scheduler continuous`` -> ``{"admit_k": "4", "scheduler": "continuous"}``
    (scheduling flags only: ``--scheduler``, ``--max-num-seqs`` and the knobs)."""
    from quanta.flags import SCHEDULER_FLAGS

    wanted = set(SCHEDULER_FLAGS)
    out = {}
    for i, f in enumerate(flags):
        if f in wanted and i + 1 < len(flags):
            out[f[2:].replace("-", "_")] = flags[i + 1]
    return out


def same_value(requested: str, applied) -> bool:
    """``"64"`` equals ``64``, ``"0.5"`` equals ``0.50``, ``"true"`` equals ``True``; else string equality."""
    a = str(applied).strip()
    if isinstance(applied, bool) or a.lower() in ("true", "false"):
        return requested.strip().lower() == a.lower()
    try:
        return float(requested) == float(a)
    except ValueError:
        return requested.strip() == a


def verify(requested: dict[str, str], applied: dict | None) -> str | None:
    """None when every requested value equals the applied one, else the reason
    (e.g. ``"requested admit_k=4, server applied admit_k=1"``)."""
    if applied is None:
        return "server reported no applied values (neither /v1/config nor a startup line)"
    bad = [f"requested {k}={v}, server applied {k}={applied.get(k, 'nothing')}"
           for k, v in requested.items() if k not in applied or not same_value(str(v), applied[k])]
    return "; ".join(bad) or None
