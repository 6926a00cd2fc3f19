"""Stopping ``quanta serve`` (SIGINT, as Ctrl-C sends it) while requests run: each ends with the
server's answer (a streamed one with its error event and ``[DONE]``, a non-streamed one with a 503
error body), the server exits within uvicorn's graceful-shutdown window with status 0 and one stop
line naming the signal and the run's totals, and its log carries no traceback."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

LONG = {"messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
        "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_ctrl_c_ends_requests_in_flight_with_their_error_and_no_traceback(launch_server):
    live = launch_server("--max-model-len", "1024", "--max-num-seqs", "2")
    results: dict = {}

    def streamed() -> None:
        with httpx.stream("POST", live.base_url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=60) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    def whole() -> None:
        r = httpx.post(live.base_url + "/v1/chat/completions", json=LONG, timeout=60)
        results["whole"] = (r.status_code, r.json())

    threads = [threading.Thread(target=streamed), threading.Thread(target=whole)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while "generation" not in results and time.monotonic() < deadline:  # both decoding
        if httpx.get(live.base_url + "/metrics", timeout=10).text.count("quanta:num_requests_running 2.0"):
            results["generation"] = True
        time.sleep(0.1)
    live.process.proc.send_signal(signal.SIGINT)
    for t in threads:
        t.join(30)
    assert live.process.proc.wait(30) == 0
    events = results["stream"]
    assert events[-1] == "data: [DONE]" and "shutting down" in json.loads(events[-2][6:])["error"]["message"], events[-3:]
    status, body = results["whole"]
    assert status == 503 and "shutting down" in body["error"]["message"], body
    log = live.log()
    assert "Traceback" not in log and "Event loop is closed" not in log, log[-4000:]
    assert "timeout graceful shutdown exceeded" not in log, log[-4000:]
    assert log.count("finish abort") == 2, log[-4000:]  # each request still gets its line
    assert "stopped by SIGINT after serving" in log and "2 request(s) (2 aborted)" in log, log[-4000:]
    assert "interrupted" not in log, log[-4000:]


def test_sigterm_stops_with_status_0_and_the_stop_line(launch_server):
    live = launch_server("--max-model-len", "512", "--max-num-seqs", "1")
    r = httpx.post(live.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    live.process.proc.send_signal(signal.SIGTERM)
    assert live.process.proc.wait(30) == 0  # uvicorn alone would re-raise SIGTERM: death by the signal
    stop = [line for line in live.log().splitlines() if "stopped by" in line]
    assert len(stop) == 1 and "stopped by SIGTERM" in stop[0], stop
    assert "1 request(s) (0 aborted), 1 prompt and 3 generated tokens" in stop[0], stop
