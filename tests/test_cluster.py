"""``quanta serve --replicas 2``: two engine replicas on a local Ray behind one endpoint.

One live cluster (the real CLI in a subprocess, ``--api-key``) serves the
official openai and anthropic clients; a replica's process is killed
mid-stream: its stream ends with an error event, the other's finishes, and
Ray Serve starts a new one. Skipped, with Ray's own reason, where Ray is not
installed or cannot start. Without ``--replicas`` nothing imports Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from quanta.bench.server import start
from quanta.cluster.forward import HTTPRequest, ResponseEnd, ResponseStart, call_app
from quanta.cluster.metrics import merge
from quanta.cluster.prompts import RoutingPrompts

KEY, ADMIN_KEY = "cluster-test-key", "cluster-admin-key"
RESTART_TIMEOUT_S = 120.0


def test_serve_without_replicas_imports_no_ray():
    code = ("import sys; from quanta.cli import build_parser; import quanta.server.run, quanta.cluster.routing, "
            "quanta.cluster.front; build_parser().parse_args(['serve']); "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("flag", [["--routing", "round-robin"], ["--ray-address", "auto"], ["--replica-cpus", "2"]])
def test_cluster_flags_need_replicas(flag):
    out = subprocess.run([sys.executable, "-m", "quanta.cli", "serve", *flag], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"quanta serve: error: {flag[0]} needs --replicas"]


def test_metrics_merge_labels_every_replica_sample():
    texts = {}
    for replica in (0, 1):
        registry = CollectorRegistry()
        Counter("quanta:prompt_tokens", "Prefilled prompt tokens.", registry=registry).inc(10 + replica)
        Histogram("quanta:ttft_seconds", "TTFT.", ["kind"], buckets=(0.1, 1.0), registry=registry).labels("a").observe(0.5)
        texts[replica] = generate_latest(registry).decode()
    merged = merge(texts)
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    tokens = {s.labels["replica"]: s.value for s in families["quanta:prompt_tokens"].samples if s.name.endswith("_total")}
    assert tokens == {"0": 10.0, "1": 11.0}
    buckets = [s for s in families["quanta:ttft_seconds"].samples if s.name.endswith("_bucket")]
    assert sorted((s.labels["replica"], s.labels["le"], s.labels["kind"]) for s in buckets) == [
        (r, le, "a") for r in ("0", "1") for le in ("+Inf", "0.1", "1.0")]
    assert merged.count("# TYPE quanta:ttft_seconds histogram") == 1


def test_call_app_stops_a_stream_its_reader_leaves():
    ended = asyncio.Event()
    app = FastAPI()

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            try:
                for i in range(10_000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                ended.set()
        return StreamingResponse(events(), media_type="text/event-stream")

    async def main() -> list:
        parts = call_app(app, HTTPRequest("POST", "/stream", b"", (), b""))
        got = [await anext(parts), await anext(parts), await anext(parts)]
        await parts.aclose()
        await asyncio.wait_for(ended.wait(), 5)
        return got

    start_part, *chunks = asyncio.run(main())
    assert start_part.status == 200 and chunks == [b"data: 0\n\n", b"data: 1\n\n"]


async def _alive(incoming):
    yield ResponseStart(200, ((b"content-type", b"application/json"),))
    yield b'{"status": "ok"}'


async def _silent(incoming):
    await asyncio.Event().wait()
    yield b""


async def _engine_stopped(incoming):  # a replica's own /health when its engine thread has stopped
    yield ResponseStart(503, ((b"content-type", b"application/json"),))
    yield b'{"status": "error", "message": "engine thread stopped"}'


async def _gone(incoming):  # the call fails at once, as when Ray reports the actor dead
    raise ConnectionError("replica actor died\nlong Ray detail")
    yield b""


@functools.cache
def _prompts() -> RoutingPrompts:
    from quanta.model.loader import embedded_model_path
    from quanta.model.tokenizer import Tokenizer

    return RoutingPrompts(Tokenizer.from_path(embedded_model_path()), 2048)


def _front(replicas):
    from quanta.cluster.front import Front
    from quanta.cluster.routing import make_router

    return Front(replicas, make_router("least-loaded", len(replicas)), _prompts(), 8, None, "least-loaded")


def _cluster_get(front, path, method="GET"):
    """``front``'s response to a bodiless request (a forwarded one's ``body`` read), and the seconds it took."""
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def ask():
        route, _, query = path.partition("?")
        scope = {"type": "http", "method": method, "path": route, "query_string": query.encode(), "headers": [], "client": None}
        t0 = time.monotonic()
        response = await front(Request(scope, receive))
        took = time.monotonic() - t0
        if hasattr(response, "body_iterator"):  # a forwarded response: read it here, in its event loop
            response.body = b"".join([chunk async for chunk in response.body_iterator])
        return response, took
    return asyncio.run(ask())


def test_health_is_200_with_every_replica_up():
    response, _ = _cluster_get(_front([_alive, _alive]), "/health")
    assert response.status_code == 200
    assert json.loads(response.body) == {"status": "ok", "replicas": [{"replica": 0, "up": True}, {"replica": 1, "up": True}]}


def test_health_is_503_naming_each_replica_down_and_why(monkeypatch):
    """Ray Serve holds a call to a dead replica until its replacement loads: /health asks every replica at
    once and gives each CLUSTER_ROUTE_TIMEOUT_S, so it answers at once with the silent one down."""
    from quanta.cluster import front as front_module

    timeout = 1.0
    monkeypatch.setattr(front_module, "CLUSTER_ROUTE_TIMEOUT_S", timeout)
    response, took = _cluster_get(_front([_silent, _alive, _engine_stopped, _gone]), "/health")
    assert took < 2 * timeout  # asked together: one timeout, not one per silent replica
    body = json.loads(response.body)
    assert response.status_code == 503 and body["status"] == "degraded"
    assert body["message"] == "3 of 4 replicas down: 0, 2, 3"
    assert body["replicas"] == [
        {"replica": 0, "up": False, "reason": "no answer within 1 s"},
        {"replica": 1, "up": True},
        {"replica": 2, "up": False, "reason": "answered 503: engine thread stopped"},
        {"replica": 3, "up": False, "reason": "ConnectionError: replica actor died"}]
    none, _ = _cluster_get(_front([_gone, _engine_stopped]), "/health")
    assert none.status_code == 503 and json.loads(none.body)["status"] == "error"


def test_cluster_routes_answer_only_get_and_head():
    """POST /health is the replica's answer (405, as on one server), not the front's."""
    async def method_not_allowed(incoming):
        yield ResponseStart(405 if incoming.method == "POST" else 200, ((b"content-type", b"application/json"),))
        yield b'{"detail": "Method Not Allowed"}'

    response, _ = _cluster_get(_front([method_not_allowed]), "/health", "POST")
    assert response.status_code == 405
    head, _ = _cluster_get(_front([_alive]), "/health", "HEAD")
    assert head.status_code == 200


def test_access_line_names_method_route_status_reason_and_replica(caplog):
    async def streamed(incoming):
        yield ResponseStart(404, ((b"content-type", b"application/json"),))
        yield b'{"error": "no such route"}'

    front = _front([streamed, streamed])
    with caplog.at_level(logging.INFO, logger="quanta.access"):
        response, _ = _cluster_get(front, "/v1/nothing?x=1", "POST")
        assert response.status_code == 404 and response.body == b'{"error": "no such route"}'
        _cluster_get(_front([_gone]), "/health")
    lines = [r.getMessage() for r in caplog.records if r.name == "quanta.access"]
    assert re.fullmatch(r"POST /v1/nothing\?x=1 404 Not Found \d+\.\d ms replica=0", lines[0]), lines
    assert re.fullmatch(r"GET /health 503 Service Unavailable \d+\.\d ms", lines[1]), lines


def _left_after_body(front, path: str) -> bytes:
    """A client that reads ``path``'s body from ``front`` until it holds what the replica sent, then
    leaves (the proxy cancels the response) while the replica's stream has not ended yet."""
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def ask() -> bytes:
        scope = {"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": [], "client": None}
        response = await front(Request(scope, receive))
        got = bytearray()

        async def read():
            async for chunk in response.body_iterator:
                got.extend(chunk)
        reader = asyncio.create_task(read())
        for _ in range(500):
            if bytes(got).endswith(b"]}"):
                break
            await asyncio.sleep(0.01)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        return bytes(got)
    return asyncio.run(ask())


def test_access_line_of_a_whole_response_is_its_status_when_the_client_leaves_before_the_stream_ends(caplog):
    """Ray's stream of a replica's answer ends a moment after its last part: a client that has the whole
    body may close first. The access line says the status; "client disconnected" only for a client that
    left before the body's end."""
    body = b'{"object": "list", "data": []}'

    async def whole_then_slow(incoming):  # the body's last part, then the stream's end late
        yield ResponseStart(200, ((b"content-type", b"application/json"),))
        yield ResponseEnd(body)
        await asyncio.Event().wait()

    async def cut(incoming):  # part of the body, the rest never comes
        yield ResponseStart(200, ((b"content-type", b"application/json"),))
        yield body[:-2]
        yield b"]}"
        await asyncio.Event().wait()

    with caplog.at_level(logging.INFO, logger="quanta.access"):
        assert _left_after_body(_front([whole_then_slow]), "/v1/models") == body
        assert _left_after_body(_front([cut]), "/v1/models") == body
    lines = [r.getMessage() for r in caplog.records if r.name == "quanta.access"]
    assert re.fullmatch(r"GET /v1/models 200 OK \d+\.\d ms replica=0", lines[0]), lines
    assert re.fullmatch(r"GET /v1/models 200 OK \d+\.\d ms replica=0 \(client disconnected\)", lines[1]), lines


def test_call_app_ends_with_the_bodys_last_part():
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": []}

    async def main() -> list:
        return [part async for part in call_app(app, HTTPRequest("GET", "/v1/models", b"", (), b""))]

    start_part, *rest = asyncio.run(main())
    assert start_part.status == 200 and rest == [ResponseEnd(b'{"object":"list","data":[]}')]


def test_ray_prints_plain_lines_when_stderr_is_not_a_terminal():
    code = ("import os, sys; from quanta.cluster.app import ray_log_env; ray_log_env(); "
            "print(os.environ.get('RAY_COLOR_PREFIX'), os.environ.get('RAY_DEDUP_LOGS'))")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_COLOR_PREFIX", "RAY_DEDUP_LOGS", "NO_COLOR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.split() == ["0", "0"], out.stderr  # stderr is a pipe here
    kept = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**env, "RAY_COLOR_PREFIX": "1"})
    assert kept.stdout.split() == ["1", "0"], kept.stderr


def test_ray_serve_logging_config_is_ray_valid_without_access_log():
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e '.[cluster]')")
    from ray.serve.schema import LoggingConfig

    from quanta.cluster.app import serve_logging

    json_logs = LoggingConfig(**serve_logging("debug", "json"))
    assert (json_logs.enable_access_log, json_logs.encoding, json_logs.log_level) == (False, "JSON", "DEBUG")
    assert LoggingConfig(**serve_logging("info", "text")).encoding == "TEXT"


def test_an_unreachable_ray_address_is_refused_before_ray_waits_on_it():
    from quanta.cluster.app import check_reachable

    with pytest.raises(ConnectionError, match="nothing answers at 127.0.0.1:1"):
        check_reachable("127.0.0.1:1", timeout=2)
    check_reachable("auto")  # Ray's own forms are Ray's to resolve


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e '.[cluster]')")
    flags = ["--replicas", "2", "--routing", "least-loaded", "--api-key", KEY, "--admin-key", ADMIN_KEY, "--stats-interval", "0",
             "--max-model-len", "2048"]
    log_dir = tmp_path_factory.mktemp("quanta-cluster")
    try:
        proc = start(flags, log_dir, timeout=240)
    except RuntimeError as exc:
        if "Ray could not start" in str(exc):
            pytest.skip(f"Ray cannot start here: {str(exc).splitlines()[0]}")
        raise
    yield proc
    proc.stop()


def _replica_pids(base: str) -> list[int]:
    config = httpx.get(base + "/v1/config", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).json()
    replicas = config["cluster"]["replica_configs"]
    return [replicas[str(i)]["replica"]["pid"] for i in range(config["cluster"]["replicas"])]


def test_official_clients_keys_errors_and_metrics(cluster):
    oa = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=KEY)
    model = oa.models.list().data[0].id
    chunks = list(oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                             max_tokens=8, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    ant = anthropic.Anthropic(base_url=cluster.base_url, api_key=KEY)
    message = ant.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "Say hi."}])
    assert message.content[0].text and message.usage.output_tokens >= 1
    with pytest.raises(openai.BadRequestError) as bad:  # the single server's 400, naming the field
        oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=cluster.base_url, api_key="wrong").messages.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": "x"}])
    refused = httpx.get(cluster.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"  # the replicas' own answer
    metrics = httpx.get(cluster.base_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).text
    running = sorted(line.split()[0] for line in metrics.splitlines() if line.startswith("quanta:num_requests_running{"))
    assert running == ['quanta:num_requests_running{replica="0"}', 'quanta:num_requests_running{replica="1"}']
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    trace = httpx.get(cluster.base_url + "/v1/trace?replica=1", headers=admin, timeout=30)
    assert trace.status_code == 200, trace.text
    assert httpx.post(cluster.base_url + "/health", json={}, timeout=30).status_code == 405  # the replica's answer, as on one server
    for query, status in (("", 400), ("?replica=abc", 400), ("?replica=-1", 400), ("?replica=2", 404)):
        wrong = httpx.get(cluster.base_url + "/v1/trace" + query, headers=admin, timeout=30)
        assert wrong.status_code == status, (query, wrong.text)
        assert wrong.json()["error"]["param"] == "replica"


def test_bench_run_keeps_each_replicas_own_step_trace(cluster, monkeypatch):
    from quanta.bench.client import Target
    from quanta.bench.runner import measure
    from quanta.bench.workloads import Workload

    monkeypatch.setenv("QUANTA_API_KEY", KEY)
    monkeypatch.setenv("QUANTA_ADMIN_KEY", ADMIN_KEY)
    model = httpx.get(cluster.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    target = Target(cluster.base_url, model["data"][0]["id"], ignore_eos=True)
    run = measure(target, Workload(kind="burst", num_requests=4, prompt_words=12, max_tokens=3), progress=False)
    assert run["trace"] is None and len(run["replica_traces"]) == 2
    emitted = [sum(sum(r["num_emitted"]) for r in t) for t in run["replica_traces"]]
    assert sum(emitted) == 4 * 3 and all(emitted), emitted  # least-loaded spreads the burst; every token is in a trace
    assert all(r["positions"] is not None for t in run["replica_traces"] for r in t)
    steps = run["metrics"]["trace"]["steps"]  # server-side figures from the replicas' traces merged
    assert sum(steps.values()) == sum(len(t) for t in run["replica_traces"])


def test_front_renders_the_prompt_ids_the_replicas_compute(cluster):
    from quanta.model.loader import embedded_model_path
    from quanta.model.tokenizer import Tokenizer

    prompts = RoutingPrompts(Tokenizer.from_path(embedded_model_path()), 2048)
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List three <|im_end|> colors."}]
    chat = {"messages": messages, "max_tokens": 4}
    served = httpx.post(cluster.base_url + "/tokenize", json={"messages": messages}, headers=auth, timeout=60).json()["tokens"]
    assert asyncio.run(prompts.tokens("/v1/chat/completions", json.dumps(chat).encode())) == served
    anthropic_body = {"system": "Be brief.", "messages": messages[1:], "max_tokens": 4}
    count = httpx.post(cluster.base_url + "/v1/messages/count_tokens", json=anthropic_body, headers=auth, timeout=60).json()
    assert len(asyncio.run(prompts.tokens("/v1/messages", json.dumps(anthropic_body).encode()))) == count["input_tokens"]
    assert asyncio.run(prompts.tokens("/v1/chat/completions", b'{"messages": []}')) is None  # the replica's 400, not the front's


def _running(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).text
    return {line.split('replica="')[1].split('"')[0]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith("quanta:num_requests_running{")}


def test_client_that_leaves_frees_its_replica_slot(cluster):
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", cluster.base_url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        replica = response.headers["x-quanta-replica"]
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert _running(cluster.base_url)[replica] == 1
    deadline = time.monotonic() + 15
    while _running(cluster.base_url)[replica] and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _running(cluster.base_url)[replica] == 0


def _stream(client: openai.OpenAI, model: str, text: str, max_tokens: int, first: threading.Event, out: dict) -> None:
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], stream=True,
                                                max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        for chunk in stream:
            first.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                out["finish"] = chunk.choices[0].finish_reason
    except openai.APIError as exc:
        out["error"] = str(exc)
    finally:
        first.set()


def test_killed_replica_errors_its_stream_and_is_replaced(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=KEY, timeout=120)
    model = client.models.list().data[0].id
    pids = _replica_pids(cluster.base_url)
    long, short = {}, {}
    started = [threading.Event(), threading.Event()]
    # least-loaded with nothing in flight: the first stream goes to replica 0, the second to replica 1
    threads = [threading.Thread(target=_stream, args=(client, model, "Count to ten.", 4000, started[0], long)),
               threading.Thread(target=_stream, args=(client, model, "Name a color.", 64, started[1], short))]
    threads[0].start()
    assert started[0].wait(60)
    threads[1].start()
    assert started[1].wait(60)
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(90)
    assert "stopped mid-stream" in long.get("error", ""), long
    assert short == {"finish": "length"}, short
    deadline, degraded = time.monotonic() + RESTART_TIMEOUT_S, []
    while time.monotonic() < deadline:  # replica 0's replacement loads the model: /health is 503 naming it until then
        health = httpx.get(cluster.base_url + "/health", timeout=30)
        if health.status_code == 200:
            break
        degraded.append((health.status_code, [(r["replica"], r["up"], bool(r.get("reason"))) for r in health.json()["replicas"]]))
        time.sleep(1)
    assert health.json() == {"status": "ok", "replicas": [{"replica": 0, "up": True}, {"replica": 1, "up": True}]}
    assert degraded and degraded[0] == (503, [(0, False, True), (1, True, False)]), degraded
    new = _replica_pids(cluster.base_url)
    assert new[1] == pids[1] and new[0] != pids[0]
    reply = client.completions.create(model=model, prompt="One, two,", max_tokens=4, temperature=0)
    assert reply.choices[0].text


def test_cluster_log_is_plain_with_real_routes_and_stops_in_one_line(cluster):
    """Runs last (it stops the module's cluster): the log file has no ANSI colour codes, one access line
    per request with its method, route, status and reason, no Ray access line naming every route ``/``;
    Ctrl-C ends it with one line and exit code 0."""
    httpx.get(cluster.base_url + "/v1/trace?replica=2", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    httpx.post(cluster.base_url + "/v1/completions", json={"prompt": "One,", "max_tokens": 2},
               headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    time.sleep(2)  # Ray forwards the replicas' lines to the driver's stderr in batches
    log_text = cluster.log_path.read_text(errors="replace")
    assert "\x1b[" not in log_text
    assert re.search(r"quanta\.access: GET /v1/trace\?replica=2 404 Not Found \d+\.\d ms\n", log_text)
    assert re.search(r"quanta\.access: POST /v1/completions 200 OK \d+\.\d ms replica=[01]\n", log_text)
    assert not re.search(r" -- (GET|POST|HEAD) / \d{3} ", log_text)  # Ray Serve's own access lines
    before = len(log_text)
    cluster.proc.send_signal(signal.SIGINT)
    assert cluster.proc.wait(timeout=60) == 0
    tail = cluster.log_path.read_text(errors="replace")[before:].strip().splitlines()
    assert len(tail) == 1 and re.search(r"INFO quanta\.cluster: cluster stopped: 2 replicas and the local Ray, in [\d.]+ s$",
                                         tail[0]), tail
