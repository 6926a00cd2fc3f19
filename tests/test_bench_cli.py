"""``quanta bench`` end to end: bad input, an unreachable server, a foreign
OpenAI-compatible server (in-process fake) and small runs against quanta.

No timing assertions: the machine may be busy. Every run is a few requests.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from quanta.bench.server import free_port
from quanta.cli import main


def _bench(*argv: str) -> int:
    return main(["bench", *argv])


@pytest.mark.parametrize("argv, message", [
    (["run", "--base-url", "localhost:8000"], "expected http://HOST:PORT"),
    (["run", "--base-url", "http://127.0.0.1:1", "--num-requests", "0"], "positive integer"),
    (["run", "--base-url", "http://127.0.0.1:1", "--rate", "-2"], "positive number"),
    (["run", "--base-url", "http://127.0.0.1:1", "--workload", "storm"], "invalid choice"),
    (["run", "--base-url", "http://127.0.0.1:1", "--repeats", "2", "--repeats", "3"], "more than once"),
    (["sweep", "--out", "x"], "needs --grid"),
    (["sweep", "--grid", "--admit-k 1 --admit-k 2", "--out", "x"], "more than once"),
    (["sweep", "--grid", "--scheduler continuous --bogus 1", "--out", "x"], "unrecognized arguments: --bogus"),
    (["sweep", "--grid", "--scheduler static", "--baseline", "chunked", "--out", "x"], "not a condition"),
    (["sweep", "--grid", "--scheduler static"], "needs --out"),
    (["sweep", "--grid", "--scheduler static", "--admit-k", "1,2", "--out", "x"], "not both"),
    (["report", "/nonexistent/x.json", "--out", "x"], "cannot read"),
])
def test_bad_input_is_a_clear_message_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _bench(*argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_sweep_dry_run_lists_conditions(capsys):
    assert _bench("sweep", "--scheduler", "continuous", "--admit-k", "1,2", "--dry-run") == 0
    assert "continuous K=2: quanta serve --scheduler continuous --admit-k 2" in capsys.readouterr().err
    assert _bench("sweep", "--grid", "--scheduler static", "--grid", "--scheduler continuous --admit-k 1,8",
                  "--server-flags", "--max-num-seqs 4", "--dry-run") == 0
    err = capsys.readouterr().err
    assert "static: quanta serve --scheduler static --max-num-seqs 4" in err
    assert "continuous K=8" in err and "[invalid: --admit-k (8) is larger than --max-num-seqs (4)" in err


def test_unreachable_server(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert _bench("run", "--base-url", url) == 1
    assert "cannot reach" in capsys.readouterr().err
    # with --model the requests are sent, fail, and are counted per condition
    prefix = tmp_path / "bench_unreachable"
    assert _bench("run", "--base-url", url, "--model", "m", "--num-requests", "3", "--repeats", "1", "--warmup", "0",
                  "--no-progress", "--no-plots", "--out", str(prefix)) == 1
    assert "every request failed (unreachable" in capsys.readouterr().err
    doc = json.loads(prefix.with_suffix(".json").read_text())
    assert doc["conditions"][0]["runs"][0]["metrics"]["client"]["errors"] == {"unreachable": 3}
    assert "**unreachable** x3" in prefix.with_suffix(".md").read_text()


# --- a foreign OpenAI-compatible server: no /v1/trace, no /metrics, 2 tokens per chunk ---

def _fake_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "multi", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        model = body["model"]
        if model == "fail":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        if model == "html":
            return HTMLResponse("<html>not an API</html>")

        async def stream():
            for i in range(4):
                await asyncio.sleep(0.01)
                chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}a t{i}b", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                if model == "truncate" and i == 1:
                    return
            yield 'data: {"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
            yield 'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(_fake_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


def test_foreign_server_tokens_from_usage_and_na_server_columns(fake_server, tmp_path):
    prefix = tmp_path / "bench_foreign"
    assert _bench("run", "--base-url", fake_server, "--num-requests", "4", "--repeats", "2", "--warmup", "1",
                  "--scrape", "0.5", "--no-progress", "--out", str(prefix)) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    run = doc["conditions"][0]["runs"][0]
    c = run["metrics"]["client"]
    assert c["num_ok"] == 4 and c["output_tokens"] == 32  # 8 per request from usage, not 4 chunks
    assert c["itl"]["n"] == 4 * 7 and c["num_estimated"] == 4
    assert run["trace"] is None and run["metrics"]["trace"] is None
    md = prefix.with_suffix(".md").read_text()
    assert "ITL source: client" in md and f"| {fake_server} | n/a | n/a |" in md
    assert doc["conditions"][0]["applied"] is None  # not quanta: no /v1/config, so simulate --compare refuses it
    assert prefix.with_name(prefix.name + "-frontier.png").stat().st_size > 0
    # the saved raw samples are enough to recompute the report
    again = tmp_path / "bench_again"
    assert _bench("report", str(prefix.with_suffix(".json")), "--out", str(again), "--no-plots") == 0
    assert again.with_suffix(".md").read_text().count("| n/a | n/a |") >= 1


@pytest.mark.parametrize("model, condition", [("fail", "http_500"), ("html", "non_openai"), ("truncate", "truncated")])
def test_foreign_server_failures_are_counted_per_condition(fake_server, tmp_path, model, condition):
    prefix = tmp_path / f"bench_{model}"
    assert _bench("run", "--base-url", fake_server, "--model", model, "--num-requests", "2", "--repeats", "1", "--warmup", "0",
                  "--no-progress", "--no-plots", "--out", str(prefix)) == 1
    doc = json.loads(prefix.with_suffix(".json").read_text())
    assert doc["conditions"][0]["runs"][0]["metrics"]["client"]["errors"] == {condition: 2}


# --- quanta itself (the shared session server: batched, 8 slots, max_model_len 512) ---

def test_bench_run_against_quanta_has_server_side_figures(server, tmp_path):
    prefix = tmp_path / "bench_quanta"
    assert _bench("run", "--base-url", server.base_url, "--num-requests", "4", "--max-tokens", "8", "--prompt-words", "16",
                  "--repeats", "2", "--warmup", "1", "--scrape", "0.5", "--no-progress", "--out", str(prefix)) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    for run in doc["conditions"][0]["runs"]:
        m = run["metrics"]
        assert m["client"]["num_ok"] == 4 and m["client"]["output_tokens"] == 32
        t = m["trace"]
        assert t["steps"]["prefill"] >= 1 and t["steps"]["decode"] >= 7
        assert t["decode_tokens"] == 4 * 7  # the first token of each request comes from its prefill
        assert t["itl"]["n"] == 4 * 7
        assert 0.0 <= t["overlap"] <= 1.0 and t["prefill_rate"] > 0
    md = prefix.with_suffix(".md").read_text()
    assert "ITL source: server trace" in md
    assert prefix.with_name(prefix.name + "-itl-cdf.png").exists()
    applied = doc["conditions"][0]["applied"]  # /v1/config: what simulate --compare replays
    assert applied["scheduler"] == "batched" and applied["max_num_seqs"] == 8


def test_simulate_compare_replays_a_bench_run_of_quanta(server, tmp_path, capsys):
    prefix = tmp_path / "bench_for_sim"
    assert _bench("run", "--base-url", server.base_url, "--num-requests", "3", "--max-tokens", "4", "--prompt-words", "12",
                  "--repeats", "1", "--warmup", "0", "--no-progress", "--no-plots", "--out", str(prefix)) == 0
    seed = Path(__file__).resolve().parents[1] / "profiles" / "ds4_m3_ultra_seed.json"
    capsys.readouterr()
    assert main(["simulate", "--profile", str(seed), "--compare", str(prefix.with_suffix(".json"))]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    measured = json.loads(prefix.with_suffix(".json").read_text())["conditions"][0]["figures"][0]
    # same scheduler, same prompt lengths: the simulated engine takes as many decode steps (times differ: M3 profile)
    assert row.startswith(f"| {server.base_url} |") and f"vs {measured['prefill_calls']:g}/{measured['decode_steps']:g}/" in row


def test_probe_and_replay_workloads_against_quanta(server, tmp_path):
    prefix = tmp_path / "bench_probe"
    assert _bench("run", "--base-url", server.base_url, "--workload", "probe", "--sessions", "2", "--session-tokens", "96",
                  "--probe-words", "48", "--probe-delay", "0.2", "--max-tokens", "2", "--prompt-words", "8", "--repeats", "1",
                  "--warmup", "0", "--no-progress", "--no-plots", "--out", str(prefix)) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    probe = doc["conditions"][0]["runs"][0]["metrics"]["probe"]
    assert probe["ok"] and probe["prompt_tokens"] > 48 and probe["prefill_tok_s"] > 0
    assert "## Probe" in prefix.with_suffix(".md").read_text()
    prefix = tmp_path / "bench_replay"
    assert _bench("run", "--base-url", server.base_url, "--workload", "replay", "--endpoint", "chat", "--sessions", "2",
                  "--turns", "2", "--tool-words", "16", "--stagger", "0.2", "--max-tokens", "4", "--prompt-words", "8",
                  "--repeats", "1", "--warmup", "0", "--no-progress", "--no-plots", "--out", str(prefix)) == 0
    samples = json.loads(prefix.with_suffix(".json").read_text())["conditions"][0]["runs"][0]["samples"]
    assert len(samples) == 4 and all(s["error"] is None for s in samples)
    turns = {s["tag"]: s["prompt_tokens"] for s in samples}
    assert turns["session0/turn1"] > turns["session0/turn0"] + 16  # the context grew by the tool output


def test_sweep_starts_verifies_and_stops_a_server_per_condition(tmp_path):
    prefix = tmp_path / "bench_sweep"
    assert _bench("sweep", "--interleave", "--grid", "--scheduler continuous --admit-k 2,8",
                  "--server-flags", "--max-num-seqs 4 --max-model-len 256",
                  "--num-requests", "4", "--max-tokens", "6", "--prompt-words", "8", "--repeats", "2", "--warmup", "0",
                  "--no-progress", "--out", str(prefix)) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    k2, k8 = doc["conditions"]
    assert k2["valid"] and k2["applied"]["admit_k"] == 2 and k2["startup_line"]["admit_k"] == "2"
    assert len(k2["runs"]) == 2 and all(r["metrics"]["client"]["num_ok"] == 4 for r in k2["runs"])
    assert not k8["valid"] and "larger than --max-num-seqs" in k8["invalid_reason"]
    md = prefix.with_suffix(".md").read_text()
    assert "| continuous K=2 |" in md and "## Invalid conditions" in md and "## Pareto frontier" in md
    assert doc["interleaved"] and "interleaved" in md


@pytest.mark.parametrize("workload", [["--workload", "concurrency", "--concurrency", "2"], ["--workload", "poisson", "--rate", "50"],
                                      ["--workload", "gamma", "--rate", "50", "--burstiness", "0.5"]])
def test_open_and_closed_loop_workloads(fake_server, tmp_path, workload):
    prefix = tmp_path / "bench_wl"
    assert _bench("run", "--base-url", fake_server, *workload, "--num-requests", "6", "--repeats", "1", "--warmup", "0",
                  "--no-progress", "--no-plots", "--out", str(prefix)) == 0
    samples = json.loads(prefix.with_suffix(".json").read_text())["conditions"][0]["runs"][0]["samples"]
    assert len(samples) == 6 and all(s["error"] is None and s["completion_tokens"] == 8 for s in samples)
    assert all(s["sent"] >= s["scheduled"] for s in samples)
    if "concurrency" in workload:  # never more than 2 in flight
        for s in samples:
            assert sum(1 for o in samples if o["sent"] <= s["sent"] < o["done"]) <= 2


def test_requests_past_max_duration_count_as_deadline(fake_server, tmp_path):
    prefix = tmp_path / "bench_deadline"
    # every fake response takes at least 40 ms, so none can finish within 1 ms
    assert _bench("run", "--base-url", fake_server, "--workload", "concurrency", "--concurrency", "2", "--num-requests", "5",
                  "--max-duration", "0.001", "--repeats", "1", "--warmup", "0", "--no-progress", "--no-plots", "--out", str(prefix)) == 1
    client = json.loads(prefix.with_suffix(".json").read_text())["conditions"][0]["runs"][0]["metrics"]["client"]
    assert client["num_requests"] == 5 and client["errors"] == {"deadline": 5}


def test_bench_trace_reads_a_trace_file(tmp_path, capsys):
    from test_analysis_trace import STALL_TRACE

    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in STALL_TRACE) + "\n")
    assert _bench("trace", str(path), "--json") == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["overlap"] == pytest.approx(0.5) and figures["itl"]["max"] == pytest.approx(1.2)
    assert _bench("trace", str(path)) == 0  # tables: ITL in ms, times in s, the unit in each header
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "steps: prefill 2, decode 3, mixed 0 (total 5)"
    head = lines.index(next(x for x in lines if x.startswith("ITL ms")))
    assert lines[head].split() == ["ITL", "ms", "n", "mean", "p50", "p90", "p99", "max"]
    assert lines[head + 1].split()[0] == "5" and lines[head + 1].split()[-1] == "1200.00"  # the 1.2 s stall
    (prefill,) = [x.split() for x in lines if x.startswith("prefill ")]
    assert prefill == ["prefill", "30", "2.000", "15.0", "0.83"]  # 30 tokens over 2 s busy, of a 2.4 s wall
    assert lines[-1].startswith("wall s: 2.400,") and lines[-1].endswith(": 0.50")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _bench("trace", str(empty)) == 1
    with pytest.raises(SystemExit) as exc:
        _bench("trace", str(tmp_path / "missing.jsonl"))
    assert exc.value.code == 2


def test_bench_sends_the_first_key_of_a_key_list(monkeypatch):
    """``$QUANTA_API_KEY`` may list several tenants' keys for ``quanta serve``; the bench sends the first."""
    from quanta.bench.runner import auth_headers
    from quanta.server import API_KEY_ENV

    monkeypatch.setenv(API_KEY_ENV, "k-one, k-two")
    assert auth_headers() == {"Authorization": "Bearer k-one", "x-api-key": "k-one"}
    monkeypatch.setenv(API_KEY_ENV, "solo")
    assert auth_headers()["x-api-key"] == "solo"
    monkeypatch.delenv(API_KEY_ENV)
    assert auth_headers() == {}


# --- a server that wants a key, and the report on the terminal ---

@pytest.fixture(scope="module")
def keyed_server():
    app = FastAPI()

    @app.middleware("http")
    async def want_key(request, call_next):
        if request.headers.get("authorization") != "Bearer sesame":
            return JSONResponse({"error": {"message": "invalid API key", "type": "authentication_error"}}, status_code=401)
        return await call_next(request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "keyed", "object": "model"}]}

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "keyed server did not start"
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


def test_a_keyed_server_gets_the_api_key_hint_and_report_prints_by_default(keyed_server, tmp_path, capsys, monkeypatch):
    from quanta.server import API_KEY_ENV

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert _bench("run", "--base-url", keyed_server) == 1
    err = capsys.readouterr().err
    assert "HTTP 401" in err and f"set {API_KEY_ENV}=KEY" in err and "--model" not in err, err
    prefix = tmp_path / "bench_keyed"
    assert _bench("run", "--base-url", keyed_server, "--model", "keyed", "--num-requests", "2", "--repeats", "1",
                  "--warmup", "0", "--no-progress", "--no-plots", "--out", str(prefix)) == 1
    err = capsys.readouterr().err
    assert "every request failed (http_401" in err and f"set {API_KEY_ENV}=KEY" in err, err
    assert _bench("report", str(prefix.with_suffix(".json"))) == 0
    out = capsys.readouterr().out
    assert out.startswith("# quanta bench report") and "**http_401** x2" in out, out[:500]
