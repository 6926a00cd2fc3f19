"""One engine replica: the single server's app over its own engine, answering forwarded requests.

:class:`ReplicaServer` builds exactly what ``quanta serve`` builds
(:func:`quanta.server.run.build_server`) and runs each request the front
forwards through that app (:func:`quanta.cluster.forward.call_app`). Ray Serve
makes it a deployment (:mod:`quanta.cluster.app`); it imports nothing of Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator

from quanta.cluster.forward import HTTPRequest, Part, call_app

log = logging.getLogger("quanta.cluster")


class ReplicaServer:
    """Replica ``index`` of a cluster.

    Args:
        index: the router's replica index.
        engine_cfg, sched_cfg: the configs ``quanta serve``'s flags give.
        options: :func:`quanta.server.run.build_server`'s keyword arguments (keys, limits, defaults...).
        threads: torch and C-kernel threads of this replica (its share of the cores).
        stats_interval: seconds between stats lines in the replica's log (0: none).
        log_level, log_format: as ``quanta serve``'s flags.
    """

    def __init__(self, index: int, engine_cfg, sched_cfg, options: dict, threads: int = 1,
                 stats_interval: float = 0.0, log_level: str = "info", log_format: str = "text") -> None:
        started = time.monotonic()
        os.environ["QUANTA_NATIVE_THREADS"] = str(threads)  # read when the model's C kernels load
        import torch

        from quanta.logs import configure_logging
        from quanta.server.run import build_server

        configure_logging(log_level, log_format)
        imported = time.monotonic()
        torch.set_num_threads(threads)
        self.built = build_server(engine_cfg, sched_cfg, **options)
        self.built.app.state.quanta.config["replica"] = {"index": index, "pid": os.getpid(), "host": socket.gethostname()}
        done = time.monotonic()
        log.info("replica %d ready in %.1f s (imports %.1f s, model and engine %.1f s)", index, done - started,
                 imported - started, done - imported)
        self.stats_interval = stats_interval
        self._stats: asyncio.Task | None = None

    async def forward(self, request: HTTPRequest) -> AsyncIterator[Part]:
        """The app's response to ``request``, part by part."""
        if self._stats is None and self.stats_interval > 0:
            self._stats = asyncio.create_task(self.built.live.run(self.stats_interval))
        async for part in call_app(self.built.app, request):
            yield part

    def __del__(self) -> None:
        built = getattr(self, "built", None)
        if built is not None:
            built.async_engine.stop()
