"""``quanta serve``: load the model, start the engine thread, run uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass

import uvicorn
import uvloop
from fastapi import FastAPI

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.async_engine import AsyncEngine
from quanta.engine.kv_budget import format_bytes
from quanta.engine.model_executor import default_decode_threads
from quanta.launch import (
    build_engine,
    cpu_summary,
    kv_block_bytes,
    load_model,
    release_load_memory,
    resolve_dtype,
    return_freed_heap,
)
from quanta.logs import uvicorn_log_config
from quanta.server import DEFAULT_MAX_REQUEST_BYTES
from quanta.server.access import AccessPolicy
from quanta.server.app import ServerState, build_app
from quanta.server.connections import connection_cap, guarded_protocol, quiet_accept_errors, raise_fd_limit
from quanta.server.defaults import DEFAULT_MAX_TOKENS, sampling_defaults
from quanta.server.keepalive import CONFIG_KEY as KEEPALIVE_KEY
from quanta.server.keepalive import DEFAULT_KEEPALIVE_S
from quanta.server.live_log import DEFAULT_STATS_INTERVAL_S, LiveLog
from quanta.server.metrics import EngineMetrics

log = logging.getLogger("quanta")


@dataclass
class BuiltServer:
    """One server's parts: the app over a started engine thread, its live log and connection cap."""

    app: FastAPI
    async_engine: AsyncEngine
    live: LiveLog
    connections: int


def serve(engine_cfg: EngineConfig, sched_cfg: SchedulerConfig, host: str, port: int,
          log_level: str = "info", log_format: str = "text", stats_interval: float = DEFAULT_STATS_INTERVAL_S,
          **options) -> int:
    """Serve until interrupted; returns the process exit code.

    ``options``: those of :func:`build_server`; ``log_level`` and ``log_format``
    (``text``/``json``) as :mod:`quanta.logs` set them up, for uvicorn's loggers too; ``stats_interval``: seconds
    between stats lines (0: none; :mod:`quanta.server.live_log`, which also writes a line per finished request).
    """
    built = build_server(engine_cfg, sched_cfg, host, **options)
    started = time.monotonic()
    server = _Server(uvicorn.Config(built.app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                                           http=guarded_protocol(built.connections),
                                           log_config=uvicorn_log_config(log_format)))
    try:
        uvloop.run(_serve(server, built, stats_interval))
    finally:
        built.async_engine.stop()
    if server.stopped_by:
        log.info("stopped by %s after serving %.1f s: %s", "/".join(signal.Signals(s).name for s in server.stopped_by),
                 time.monotonic() - started, built.live.run_summary())
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server that, stopped by a signal (Ctrl-C, SIGTERM), returns instead of raising the signal
    again: ``quanta serve`` then ends with its stop line and status 0, the engine thread stopped (uvicorn
    re-raises it: a KeyboardInterrupt and status 130, or death by SIGTERM before the engine stops)."""

    stopped_by: tuple[int, ...] = ()

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self.stopped_by = tuple(self._captured_signals)
            self._captured_signals.clear()


def build_server(engine_cfg: EngineConfig, sched_cfg: SchedulerConfig, host: str,
                 max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, aliases: tuple[str, ...] = (),
                 tool_call_parser: str | None = None, access: AccessPolicy | None = None,
                 max_connections: int | None = None, max_tokens_default: int = DEFAULT_MAX_TOKENS,
                 sampling: dict | None = None, chat_template: str | None = None,
                 reasoning_parser: str | None = None, stream_keepalive: float = DEFAULT_KEEPALIVE_S) -> BuiltServer:
    """Load the model, start the engine thread and build the app that serves it (``quanta serve``'s
    server, and each replica's under :mod:`quanta.cluster`).

    ``max_request_bytes``: request bodies over this size get HTTP 413 (None: no limit).
    ``aliases``: more model ids the routes accept; ``tool_call_parser``: a
    :data:`quanta.server.tool_formats.registry.TOOL_PARSERS` name and ``reasoning_parser`` a
    reasoning format's (None: chosen from the chat template);
    ``access``: API key, allowed hosts, CORS origins (None: no key, only local names and IP literals as ``Host``);
    ``max_connections``: open connections at most (None: the default, within the open-file limit,
    :mod:`quanta.server.connections`); ``max_tokens_default``: the output cap of a request that names none
    (0: the room left); ``sampling``: ``--temperature`` / ``--top-p`` / ``--top-k`` (None: not given), over the
    checkpoint's ``generation_config.json`` (:mod:`quanta.server.defaults`);
    ``chat_template``: Jinja text that replaces the model's chat template (``--chat-template``);
    ``stream_keepalive``: seconds of silence after which a streamed response gets a keep-alive
    (0: none; :mod:`quanta.server.keepalive`).
    """
    connections = connection_cap(max_connections, raise_fd_limit())
    dtype = resolve_dtype(engine_cfg.dtype)
    loaded = load_model(engine_cfg.model, dtype, engine_cfg.quantization, engine_cfg.native_decode,
                        engine_cfg.prompt_weights)
    if chat_template is not None:  # before the server state reads it (the tool-call parser is chosen from it)
        loaded.tokenizer.hf.chat_template = chat_template
    engine = build_engine(loaded, engine_cfg, sched_cfg)
    release_load_memory()
    engine.executor.decode_threads = default_decode_threads()  # leave a core to the event loop and local clients
    name = engine_cfg.served_model_name or loaded.name
    config = {
        "model": name, "dtype": str(dtype).removeprefix("torch."), "max_model_len": engine.max_model_len,
        "scheduler": sched_cfg.name, "max_num_seqs": sched_cfg.max_num_seqs, **sched_cfg.knobs,
        "max_queue": engine_cfg.max_queue, "prefix_cache": engine_cfg.prefix_cache, "block_size": engine_cfg.block_size,
        "kv_cache_dtype": engine.executor.kv.format.name,
        "kv_cache_blocks": engine.executor.kv.num_blocks, "kv_cache_tokens": engine.executor.kv.num_blocks * engine_cfg.block_size,
        "kv_cache_bytes": engine.executor.kv.num_blocks * kv_block_bytes(loaded.config, engine_cfg, loaded.model.dtype),
        "weight_bytes": loaded.model.weight_bytes(),
        "max_request_bytes": max_request_bytes, "aliases": list(aliases),
        "tool_call_parser": tool_call_parser, "reasoning_parser": reasoning_parser, "quantization": engine_cfg.quantization,
        "prompt_weights": engine_cfg.prompt_weights, "kernels": loaded.kernels,
        "cpu_flags": cpu_summary(), "decode_threads": engine.executor.decode_threads,
        "prefill_threads": engine.executor.prefill_threads,
        "max_connections": connections,
        "api_key": bool(access and access.api_keys), "admin_key": bool(access and access.admin_keys),
        "cors_origins": list(access.cors_origins) if access else [],
        "chat_template_flag": chat_template is not None,
        "max_tokens_default": max_tokens_default,
        "sampling_defaults": sampling_defaults(engine_cfg.model, sampling or {}),
        KEEPALIVE_KEY: stream_keepalive,
    }
    log.info("requests without an output cap get %s; sampling defaults: %s",
             f"max_tokens {max_tokens_default}" if max_tokens_default else "the room left",
             config["sampling_defaults"] or "the protocols' own")
    log.info("%s max_model_len=%d block_size=%d kv_cache_tokens=%d (%s, %s a token) kv_cache_dtype=%s weights=%s "
             "dtype=%s prefix_cache=%s quantization=%s kernels: %s; cpu: %s; torch threads: decode %d, prefill %d",
             sched_cfg.describe(), engine.max_model_len, engine_cfg.block_size, config["kv_cache_tokens"],
             format_bytes(config["kv_cache_bytes"]), format_bytes(config["kv_cache_bytes"] // config["kv_cache_tokens"]),
             config["kv_cache_dtype"], format_bytes(config["weight_bytes"]),
             config["dtype"],
             "on" if engine_cfg.prefix_cache else "off",
             engine_cfg.quantization, loaded.kernels, config["cpu_flags"], config["decode_threads"], config["prefill_threads"])
    async_engine = AsyncEngine(engine, engine_cfg.max_queue, on_idle=return_freed_heap)
    metrics = EngineMetrics(lambda: async_engine.num_running, lambda: async_engine.num_waiting, engine_cfg.prefix_cache,
                            async_engine.kv_blocks)
    metrics.live = live = LiveLog(lambda: async_engine.num_running, lambda: async_engine.num_waiting,
                                  sched_cfg.max_num_seqs, time.monotonic, async_engine.kv_blocks, async_engine)

    def observe_output(out) -> None:
        metrics.observe_output(out)
        live.observe_output(out)

    def observe_abort(cause: str, phase: str) -> None:
        metrics.observe_abort(cause, phase)
        live.observe_abort(cause, phase)

    async_engine.on_output = observe_output
    async_engine.on_abort = observe_abort
    engine.step_listeners += [metrics.observe_step, live.observe_step]
    async_engine.start()
    app = build_app(ServerState(async_engine, loaded.tokenizer, name, engine.max_model_len, config, metrics, max_request_bytes,
                                aliases, tool_call_parser, access or AccessPolicy(bound_host=host), reasoning_parser))
    return BuiltServer(app, async_engine, live, connections)


async def _serve(server: uvicorn.Server, built: BuiltServer, stats_interval: float) -> None:
    asyncio.get_running_loop().set_exception_handler(quiet_accept_errors)
    stats = asyncio.create_task(built.live.run(stats_interval)) if stats_interval > 0 else None
    ending = asyncio.create_task(_end_requests_on_exit(server, built.async_engine))
    try:
        await server.serve()
    finally:
        ending.cancel()
        if stats is not None:
            stats.cancel()


async def _end_requests_on_exit(server: uvicorn.Server, engine: AsyncEngine) -> None:
    """Once uvicorn is told to stop (Ctrl-C, SIGTERM), end the requests in flight with the server's
    503 / error event, so their handlers finish within uvicorn's graceful shutdown instead of being
    cancelled mid-answer (a traceback per request, a cut stream, a bare 500)."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    in_flight = engine.num_running + engine.num_waiting
    if in_flight:
        log.info("shutting down: ending %d request(s) in flight with 503 / an error event", in_flight)
    engine.shut_down()
