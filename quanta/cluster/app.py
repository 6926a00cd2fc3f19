"""``quanta serve --replicas N``: N engine replicas as Ray Serve deployments behind one endpoint.

The application is Ray Serve's usual shape for a model server (Ray's own
``ray.serve.llm`` has the same: an ingress deployment in front of model
deployments): deployment ``front`` (:class:`quanta.cluster.front.Front`,
one replica, no CPU reserved) is the HTTP ingress at ``/`` on Ray Serve's
proxy, and deployments ``replica-0`` ... ``replica-{N-1}``
(:class:`quanta.cluster.replica.ReplicaServer`) hold one engine each, with
``--replica-cpus`` CPUs reserved. Each replica is a deployment of its own
(one Ray Serve replica each) so that the router's replica index is stable:
when replica I dies, Ray Serve starts a new one under the same deployment and
index, and quanta's own router (:mod:`quanta.cluster.routing`, the code the
simulator runs too) keeps choosing by index.

Ray is imported only here, and only ``quanta serve --replicas`` imports this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator

from quanta.cluster.forward import HTTPRequest, Part

log = logging.getLogger("quanta.cluster")

#: requests one deployment replica takes at once before Ray Serve queues them (Ray's default, 5, would
#: queue them in the front instead of the engine's scheduler)
MAX_ONGOING_REQUESTS = 4096


class FrontDeployment:
    """The ingress deployment's class: builds a :class:`~quanta.cluster.front.Front` over the replicas' handles."""

    def __init__(self, handles: list, settings: dict) -> None:
        started = time.monotonic()
        from quanta.cluster.front import Front
        from quanta.cluster.prompts import RoutingPrompts
        from quanta.cluster.routing import make_router
        from quanta.logs import configure_logging
        from quanta.model.loader import embedded_model_path
        from quanta.model.tokenizer import Tokenizer

        configure_logging(settings["log_level"], settings["log_format"])
        tokenizer = Tokenizer.from_path(settings["model"] or embedded_model_path())
        if settings["chat_template"] is not None:
            tokenizer.hf.chat_template = settings["chat_template"]
        router = make_router(settings["routing"], len(handles), block_size=settings["block_size"],
                             max_waiting=settings["max_waiting"], load_tokens=settings["load_tokens"])
        self.front = Front([_replica_call(h) for h in handles], router,
                           RoutingPrompts(tokenizer, settings["max_model_len"]), settings["max_num_seqs"],
                           settings["max_request_bytes"], settings["routing"])
        log.info("front ready in %.1f s", time.monotonic() - started)

    async def __call__(self, request):
        return await self.front(request)


def _replica_call(handle):
    """A :data:`quanta.cluster.front.Replica` over a deployment handle (the stream is cancelled if left unread)."""
    streaming = handle.options(stream=True)

    async def call(request: HTTPRequest) -> AsyncIterator[Part]:
        parts = streaming.forward.remote(request)
        finished = False
        try:
            async for part in parts:
                yield part
            finished = True
        finally:
            if not finished:
                parts.cancel()

    return call


def build_application(args: argparse.Namespace, engine_cfg, sched_cfg, options: dict):
    """The Ray Serve application of ``quanta serve --replicas`` (``options``: :func:`build_server`'s)."""
    from ray import serve

    from quanta.cluster.replica import ReplicaServer

    actor = {"num_cpus": args.replica_cpus}
    logs = serve_logging(args.log_level, args.log_format)
    replicas = [
        serve.deployment(ReplicaServer, name=f"replica-{i}", num_replicas=1, ray_actor_options=actor,
                         max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=2,
                         graceful_shutdown_timeout_s=5, logging_config=logs).bind(
            i, engine_cfg, sched_cfg, {**options, "host": args.host}, max(1, int(args.replica_cpus)), args.stats_interval,
            args.log_level, args.log_format)
        for i in range(args.replicas)]
    settings = {"model": engine_cfg.model, "chat_template": options.get("chat_template"), "routing": args.routing,
                "max_waiting": args.routing_max_waiting, "load_tokens": args.routing_load_tokens, "block_size": engine_cfg.block_size,
                "max_model_len": engine_cfg.max_model_len or 2**20, "max_num_seqs": sched_cfg.max_num_seqs,
                "max_request_bytes": options.get("max_request_bytes"), "log_level": args.log_level,
                "log_format": args.log_format}
    front = serve.deployment(FrontDeployment, name="front", num_replicas=1, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=MAX_ONGOING_REQUESTS, logging_config=logs)
    return front.bind(replicas, settings)


def serve_logging(level: str, fmt: str) -> dict:
    """Ray Serve's ``LoggingConfig`` for quanta's deployments, its controller and proxy: ``--log-level``,
    ``--log-format`` (``json``: Ray Serve's JSON encoding), and no Ray access log (it names every request
    ``/``, the application's route prefix; the front logs each one with its route, status and reason)."""
    return {"log_level": level.upper(), "encoding": "JSON" if fmt == "json" else "TEXT", "enable_access_log": False}


def ray_log_env() -> None:
    """How Ray prints its workers' lines here: no ANSI colours (``RAY_COLOR_PREFIX=0``) when stderr is not a
    terminal or ``NO_COLOR`` is set, and every replica's own lines rather than one with a repeat count
    (``RAY_DEDUP_LOGS=0``, read when ``ray`` is imported). A variable already set is left as it is."""
    if not sys.stderr.isatty() or os.environ.get("NO_COLOR"):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def build(args: dict):
    """Ray Serve's application builder, for ``serve run`` and ``serve deploy`` config files:
    ``serve run quanta.cluster.app:build flags="--replicas 2 --routing prefix"``.

    ``flags`` are ``quanta serve``'s (``--replicas`` defaults to 2 here); ``--host``, ``--port`` and
    ``--ray-address`` are Ray's business in this form (``serve run``'s own options, the config file's
    ``http_options``).

    Raises:
        ValueError: flags ``quanta serve`` refuses, with its message.
    """
    from quanta import flags
    from quanta.preflight import read_chat_template

    ray_log_env()
    ns = flags.parse_serve_flags(shlex.split(str(args.get("flags", ""))))
    if ns.replicas is None:
        ns.replicas = 2
    engine_cfg, sched_cfg = flags.configs_from_args(ns)
    chat_template = read_chat_template(ns.chat_template) if ns.chat_template else None
    return build_application(ns, engine_cfg, sched_cfg, flags.server_options(ns, chat_template))


def start_ray(address: str | None, replicas: int, replica_cpus: float) -> None:
    """Connect to the Ray cluster at ``address``, or start one on this machine with room for every replica."""
    import ray

    if address:
        check_reachable(address)
        ray.init(address=address, logging_level=logging.WARNING)
        return
    cores = os.cpu_count() or 1
    need = replicas * replica_cpus
    if need > cores:
        log.warning("%d replicas x %g CPUs is more than this machine's %d cores: they share them", replicas, replica_cpus, cores)
    ray.init(address="local", num_cpus=max(cores, int(need + 0.999)), include_dashboard=False, logging_level=logging.WARNING)


def check_reachable(address: str, timeout: float = 10.0) -> None:
    """Refuse a ``host:port`` or ``ray://host:port`` address nothing listens at (``ray.init`` would wait on
    it without end); ``auto`` and other forms are left to Ray.

    Raises:
        ConnectionError: no connection within ``timeout`` seconds.
    """
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or "/" in hostport:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address} ({exc})") from exc


class RayStartError(RuntimeError):
    """Ray could not be started or reached (``quanta serve`` says so in one line, exit code 2)."""


def serve_cluster(args: argparse.Namespace, engine_cfg, sched_cfg, options: dict) -> int:
    """Start (or join) Ray, deploy the application at ``--host``:``--port`` and serve until SIGINT or SIGTERM;
    then stop what this process started and say so in one line (exit code 0).

    Raises:
        RayStartError: Ray did not start (or ``--ray-address`` did not answer).
    """
    ray_log_env()
    import ray
    from ray import serve

    _on_stop_signals()  # Ctrl-C and SIGTERM: the finally below stops what this process started
    started = time.monotonic()
    native = threading.Thread(target=build_native_once, name="quanta-native-build", daemon=True)
    native.start()  # while Ray starts (mostly waiting on its processes), not in every replica at once after
    try:
        try:
            start_ray(args.ray_address, args.replicas, args.replica_cpus)
        except Exception as exc:  # Ray's own errors vary: a missing binary, a refused address, no room
            raise RayStartError(f"Ray could not start{' at ' + args.ray_address if args.ray_address else ''}: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        _on_stop_signals()  # again: ray.init installs a SIGTERM handler of its own, which dumps a stack and exits
        log.info("Ray %s in %.1f s", "joined" if args.ray_address else "started", time.monotonic() - started)
        if args.log_level != "debug":  # "Connecting to existing Serve app ... will not be applied" (serve.run's own
            logging.getLogger("ray.serve").setLevel(logging.WARNING)  # start, after ours): quanta's lines say what started
        serve.start(http_options={"host": args.host, "port": args.port},
                    logging_config=serve_logging(args.log_level, args.log_format))
        log.info("Ray Serve's controller and proxy up at %.1f s", time.monotonic() - started)
        native.join()
        serve.run(build_application(args, engine_cfg, sched_cfg, options), name="quanta", route_prefix="/")
        log.info("serving %d replicas (routing %s) on http://%s:%d, %.1f s after start", args.replicas, args.routing,
                 args.host, args.port, time.monotonic() - started)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        _stop(args, ray, serve)
    return 0


def build_native_once() -> None:
    """Build quanta's C kernels for this machine if its cache has no copy yet, so that the replicas on this
    node load the one library rather than each compiling it (on a first run, two replicas compiling at
    once added about 10 s to each one's start here). A failure is left to the replicas to report."""
    from quanta.model.native import NativeUnavailable, build

    t0 = time.monotonic()
    try:
        lib = build()
    except NativeUnavailable:
        return
    if time.monotonic() - t0 > 1.0:
        log.info("built the C kernels for this machine in %.1f s: %s", time.monotonic() - t0, lib.name)


def _on_stop_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt (also where the shell that started this process ignores SIGINT,
    as it does for a background job)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop(args: argparse.Namespace, ray, serve) -> None:
    """Stop the application (and a local Ray) with Ray's own shutdown chatter off; one line says so."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the shutdown into a traceback
        signal.signal(sig, signal.SIG_IGN)
    t0 = time.monotonic()
    if not ray.is_initialized():
        return
    worker = sys.modules.get("ray._private.worker")
    if worker is not None and hasattr(worker, "_worker_logs_enabled"):
        worker._worker_logs_enabled = False  # the controller's removal lines and raylet's retry of a killed actor
    if args.ray_address:  # someone else's cluster: it keeps running, with the application (`serve shutdown` removes it)
        ray.shutdown()
        log.info("stopped; the application stays deployed on the Ray cluster at %s", args.ray_address)
        return
    serve.shutdown()
    ray.shutdown()
    log.info("cluster stopped: %d replicas and the local Ray, in %.1f s", args.replicas, time.monotonic() - t0)
