"""Shared fixtures: a real ``quanta serve`` subprocess on 127.0.0.1.

The session-wide ``server`` runs the embedded SmolLM2 with deliberately
non-default scheduler knobs (so tests can see the flags were honoured).
Tests that need other flags start their own through the ``launch_server``
fixture. Every wait is bounded; the server's output
goes to a log file whose tail is included in failure messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from quanta.bench.server import ServerProcess, start

STARTUP_TIMEOUT_S = 120.0

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
    process: ServerProcess = field(repr=False)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log()[-chars:]

    def stop(self) -> None:
        """SIGTERM the server by its PID, wait, then SIGKILL."""
        self.process.stop()


def start_server(log_dir: Path, *flags: str) -> ServerHandle:
    """Start ``quanta serve`` with ``flags`` (:func:`quanta.bench.server.start`) and read its model id."""
    try:
        proc = start(list(flags), log_dir, timeout=STARTUP_TIMEOUT_S)
    except RuntimeError as exc:
        pytest.fail(f"{exc}\nflags: {' '.join(flags)}", pytrace=False)
    try:
        models = httpx.get(proc.base_url + "/v1/models", timeout=30).json()
    except Exception as exc:
        proc.stop()
        pytest.fail(f"/v1/models failed: {exc}\n--- server log ---\n{proc.log_tail(8000)}", pytrace=False)
    port = int(proc.base_url.rsplit(":", 1)[1])
    return ServerHandle(proc.base_url, port, models["data"][0]["id"], proc.proc.pid, proc.log_path, tuple(flags), proc)


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
