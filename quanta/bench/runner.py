"""One measured run against a server: discover, run the workload, collect.

Works with any OpenAI-compatible server. Where the server also has quanta's
``GET /v1/trace`` and ``quanta:engine_step*`` metrics, the run adds the
server-side figures (trace ITL, step counts, union busy rates, overlap);
elsewhere those are ``None`` and reports print "n/a".
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time

import httpx

from quanta.analysis.intervals import busy_rate, overlap_ratio
from quanta.analysis.requests import RequestSample, client_intervals, client_metrics, probe_metrics
from quanta.analysis.scrape import STEP_SECONDS, STEPS, by_kind, parse_prometheus, resolved_scrape_overlap
from quanta.analysis.server_trace import merge_replica_traces, trace_metrics
from quanta.bench.client import Clock, Target
from quanta.bench.workloads import Workload, execute
from quanta.server import ADMIN_KEY_ENV, API_KEY_ENV


class ServerError(RuntimeError):
    """The server cannot be measured at all (unreachable, not OpenAI-compatible)."""


def _get_json(client: httpx.Client, url: str) -> dict | None:
    try:
        r = client.get(url)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        data = r.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def auth_headers(admin: bool = False) -> dict[str, str]:
    """``Authorization: Bearer`` (OpenAI) and ``x-api-key`` (Anthropic) from ``$QUANTA_API_KEY``; {} when unset.

    The variable may list several keys, comma-separated, as ``quanta serve``
    reads it (one tenant each); the bench sends the first. ``admin``: for
    ``/metrics``, ``/v1/trace`` and ``/v1/config``, the first of
    ``$QUANTA_ADMIN_KEY`` where it is set.
    """
    admin_key = (os.environ.get(ADMIN_KEY_ENV) or "").split(",")[0].strip() if admin else ""
    key = admin_key or (os.environ.get(API_KEY_ENV) or "").split(",")[0].strip()
    return {"Authorization": f"Bearer {key}", "x-api-key": key} if key else {}


#: what to do when a server refuses the bench's requests for want of a key
KEY_HINT = (f"the server wants an API key: set {API_KEY_ENV}=KEY in the environment (quanta bench sends it as "
            f"'Authorization: Bearer KEY'; {ADMIN_KEY_ENV} for /v1/config, /v1/trace and /metrics)")


def key_hint(status: int | str | None) -> str:
    """:data:`KEY_HINT` for an HTTP 401 or 403 (``401`` or ``http_401``), else ``""``."""
    return KEY_HINT if str(status).removeprefix("http_") in ("401", "403") else ""


def discover_model(base_url: str, timeout: float = 10.0) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        ServerError: unreachable, or the answer is not an OpenAI model list.
    """
    url = base_url.rstrip("/") + "/v1/models"
    try:
        with httpx.Client(timeout=timeout, headers=auth_headers()) as c:
            r = c.get(url)
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
    if key_hint(r.status_code):
        raise ServerError(f"{url} answered HTTP {r.status_code}: {key_hint(r.status_code)}")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ServerError(f"{url} answered HTTP {r.status_code} but not an OpenAI model list "
                          f"({r.text[:120]!r}); pass --model to skip discovery") from exc


class ServerProbe:
    """Reads quanta's optional endpoints; every method returns None when absent."""

    def __init__(self, base_url: str, timeout: float = 10.0) -> None:
        self.base = base_url.rstrip("/")
        self.client = httpx.Client(timeout=timeout, headers=auth_headers(admin=True))

    def close(self) -> None:
        self.client.close()

    def config(self) -> dict | None:
        return _get_json(self.client, self.base + "/v1/config")

    def metrics(self) -> list | None:
        try:
            r = self.client.get(self.base + "/metrics")
        except httpx.HTTPError:
            return None
        return parse_prometheus(r.text) if r.status_code == 200 else None

    def next_step(self) -> int | None:
        """Index of the next engine step (the sum of ``engine_steps_total``), or None."""
        m = self.metrics()
        steps = by_kind(m, STEPS) if m else {}
        if steps:
            return int(round(sum(steps.values())))
        data = _get_json(self.client, self.base + "/v1/trace?since=0&limit=1")
        if data is None or not isinstance(data.get("next_step"), int):
            return None
        return data["next_step"]

    def replicas(self) -> int | None:
        """The replica count of a cluster front (``quanta serve --replicas N``), None for one server."""
        cluster = (self.config() or {}).get("cluster")
        n = cluster.get("replicas") if isinstance(cluster, dict) else None
        return n if isinstance(n, int) and n > 0 else None

    def replica_next_steps(self, replicas: int) -> list[int | None]:
        """Each replica's next step index (``/v1/trace?replica=I``), None for one that did not answer."""
        out: list[int | None] = []
        for i in range(replicas):
            data = _get_json(self.client, f"{self.base}/v1/trace?replica={i}&since=0&limit=1")
            step = data.get("next_step") if data else None
            out.append(step if isinstance(step, int) else None)
        return out

    def trace(self, since: int, replica: int | None = None) -> list[dict] | None:
        """Every record from step ``since`` on, page by page (``/v1/trace`` pages by ``next_since``);
        ``replica``: that replica's trace, behind a cluster front."""
        records: list[dict] = []
        where = "" if replica is None else f"replica={replica}&"
        while True:
            data = _get_json(self.client, f"{self.base}/v1/trace?{where}since={since}")
            recs = data.get("records") if data else None
            if not isinstance(recs, list):
                return records or None
            records += recs
            if not recs or not data.get("more") or not isinstance(data.get("next_since"), int):
                return records
            since = data["next_since"]


async def _scraper(base: str, every: float, clock, out: list[dict]) -> None:
    async with httpx.AsyncClient(timeout=max(every, 1.0), headers=auth_headers(admin=True)) as c:
        while True:
            try:
                r = await c.get(base + "/metrics")
                busy = by_kind(parse_prometheus(r.text), STEP_SECONDS) if r.status_code == 200 else {}
                if busy:
                    out.append({"t": clock.now(), "busy": busy})
            except httpx.HTTPError:
                pass
            await asyncio.sleep(every)


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=None if enabled else True, file=sys.stderr, leave=False)


async def _measure(target: Target, w: Workload, max_duration: float, request_timeout: float, scrape_every: float | None,
                   progress: bool, desc: str) -> tuple[list[RequestSample], list[dict], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout, connect=min(request_timeout, 10.0))
    scrapes: list[dict] = []
    with _progress(w.total_requests(), progress, desc) as bar:
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=auth_headers()) as client:
            clock = Clock()
            scraper = None
            if scrape_every:
                scraper = asyncio.ensure_future(_scraper(target.base_url.rstrip("/"), scrape_every, clock, scrapes))
            run = await execute(client, target, w, max_duration, on_done=lambda s: bar.update(1), clock=clock)
            if scraper:
                scraper.cancel()
                await asyncio.gather(scraper, return_exceptions=True)
    return run.samples, scrapes, clock.origin


def measure(target: Target, w: Workload, *, max_duration: float = 600.0, request_timeout: float = 300.0,
            scrape_every: float | None = None, progress: bool = True, desc: str = "bench") -> dict:
    """Run ``w`` once against ``target`` and compute every figure.

    Returns ``{"samples": [...], "trace": records | None, "scrapes": [...], "clock_origin": the client
    clock's start on the host's monotonic clock (a local server's trace times minus it are the samples' times),
    "metrics": {"client", "client_busy", "trace", "scrape_overlap", "probe"?}, "load": (1-min loadavg
    before, after)}``; behind a cluster front (``quanta serve --replicas N``) ``trace`` is None,
    ``replica_traces`` holds each replica's own step trace of the run (None for one that did not answer)
    and the server-side figures come from them merged (:func:`run_trace`).
    """
    sp = ServerProbe(target.base_url)
    load_before = os.getloadavg()[0]
    replica_traces = None
    try:
        replicas = sp.replicas()
        since = sp.next_step() if replicas is None else None
        replica_since = sp.replica_next_steps(replicas) if replicas else []
        samples, scrapes, origin = asyncio.run(_measure(target, w, max_duration, request_timeout, scrape_every, progress, desc))
        if scrape_every:
            m = sp.metrics()
            busy = by_kind(m, STEP_SECONDS) if m else {}
            if busy:
                scrapes.append({"t": max(s.done or 0.0 for s in samples) if samples else 0.0, "busy": busy})
        trace = sp.trace(since) if since is not None else None
        if replicas:
            replica_traces = [sp.trace(s, replica=i) if s is not None else None for i, s in enumerate(replica_since)]
    finally:
        sp.close()
    out = {"samples": [s.to_dict() for s in samples], "trace": trace, "scrapes": scrapes,
           "load": [load_before, os.getloadavg()[0]], "finished_at": time.time(), "clock_origin": origin}
    if replica_traces is not None:
        out["replica_traces"] = replica_traces
    out["metrics"] = compute_metrics(samples, run_trace(out), scrapes, w.kind)
    return out


def run_trace(run: dict) -> list[dict] | None:
    """The step trace a run's server-side figures come from: the server's, or behind a cluster front the
    replicas' own traces merged (:func:`~quanta.analysis.server_trace.merge_replica_traces`); None when
    there is none or a replica's is missing."""
    if run.get("trace") is not None:
        return run["trace"]
    replicas = run.get("replica_traces")
    if not replicas or any(t is None for t in replicas):
        return None
    return merge_replica_traces(replicas)


def compute_metrics(samples: list[RequestSample], trace: list[dict] | None, scrapes: list[dict], kind: str) -> dict:
    """Every figure of one run from its raw data (pure; used again by ``bench report``)."""
    p_iv, d_iv = client_intervals(samples)
    cm = client_metrics(samples)
    scraped, why = resolved_scrape_overlap(scrapes)
    out = {
        "client": cm,
        "client_busy": {"prefill_rate_lower_bound": busy_rate(cm["prompt_tokens"], p_iv),
                        "decode_rate": busy_rate(cm["output_tokens"], d_iv),
                        "overlap": overlap_ratio(p_iv, d_iv) if p_iv else math.nan},
        "trace": trace_metrics(trace) if trace else None,
        "scrape_overlap": scraped,
        "scrape_overlap_note": why,
    }
    if kind == "probe":
        probes = [s for s in samples if s.tag == "probe"]
        out["probe"] = probe_metrics(probes[0], [s for s in samples if s.tag == "session"]) if probes else None
    return out
