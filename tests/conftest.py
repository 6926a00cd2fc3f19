"""Shared fixtures: a real ``quanta serve`` subprocess on 127.0.0.1.

The session-wide ``server`` runs the embedded SmolLM2 with deliberately
non-default scheduler knobs (so tests can see the flags were honoured).
Tests that need other flags start their own through the ``launch_server``
fixture. Every wait is bounded; the server's output
goes to a log file whose tail is included in failure messages.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0

#: Flags of the session server. Knob values differ from the defaults
#: (2048/2048/4096) so the startup-line and /v1/config tests can tell that
#: the flags reached the scheduler.
SESSION_SERVER_FLAGS = (
    "--max-model-len", "512",
    "--max-num-seqs", "8",
    "--scheduler", "batched",
    "--prefill-quantum", "256",
    "--mixed-prefill-quantum", "128",
    "--prefill-cap", "1024",
)


@dataclass
class ServerHandle:
    base_url: str
    port: int
    model: str
    pid: int
    log_path: Path
    flags: tuple[str, ...]
    proc: subprocess.Popen = field(repr=False)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log()[-chars:]

    def stop(self) -> None:
        """SIGTERM the server by its PID, wait, then SIGKILL."""
        _terminate(self.proc)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_dir: Path, *flags: str) -> ServerHandle:
    """Start ``quanta serve`` with ``flags`` and wait (bounded) until it is healthy."""
    port = free_port()
    log_path = log_dir / f"quanta-serve-{port}.log"
    cmd = [sys.executable, "-m", "quanta.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        with httpx.Client(timeout=5.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"quanta serve exited with code {proc.returncode} before becoming healthy")
                try:
                    if client.get(base_url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"quanta serve not healthy after {STARTUP_TIMEOUT_S:.0f} s")
                time.sleep(0.25)
            models = client.get(base_url + "/v1/models").json()
    except Exception as exc:
        _terminate(proc)
        pytest.fail(f"{exc}\n$ {' '.join(cmd)}\n--- server log ---\n{log_path.read_text(errors='replace')[-8000:]}", pytrace=False)
    return ServerHandle(base_url, port, models["data"][0]["id"], proc.pid, log_path, tuple(flags), proc)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> ServerHandle:
    """The shared server (flags: :data:`SESSION_SERVER_FLAGS`)."""
    handle = start_server(tmp_path_factory.mktemp("quanta-server"), *SESSION_SERVER_FLAGS)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def launch_server(tmp_path_factory):
    """``launch_server(*flags)`` starts another server; the caller stops it
    with ``handle.stop()`` (any still running stop at session end)."""
    started: list[ServerHandle] = []

    def launch(*flags: str) -> ServerHandle:
        handle = start_server(tmp_path_factory.mktemp("quanta-server"), *flags)
        started.append(handle)
        return handle

    yield launch
    for handle in started:
        handle.stop()
