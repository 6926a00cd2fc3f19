"""Queue accounting and half-closed connections, against a live ``quanta serve``
(issue 12).

- ``--max-num-seqs 8 --max-queue 16``: 24 concurrent long requests all fit (8
  slots + 16 waiting), the 25th gets 429.
- A client that sends a whole request and then shuts down its writing side
  (``shutdown(SHUT_WR)``) is aborted deliberately: the connection closes, the
  slot is freed, the server keeps serving (raw socket).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

SLOTS, QUEUE = 8, 16


@pytest.fixture(scope="module")
def queued(launch_server):
    handle = launch_server("--max-model-len", "512", "--max-num-seqs", str(SLOTS), "--max-queue", str(QUEUE))
    yield handle
    handle.stop()


def _long_body(model: str) -> dict:
    return {"model": model, "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}


async def _fill_then_one_more(base: str, model: str) -> tuple[list[int], int]:
    """Status codes of SLOTS + QUEUE concurrent streams, and of one more request while they run."""
    limits = httpx.Limits(max_connections=SLOTS + QUEUE + 4)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        requests = [client.build_request("POST", "/v1/completions", json=_long_body(model)) for _ in range(SLOTS + QUEUE)]
        responses = await asyncio.gather(*(client.send(r, stream=True) for r in requests))
        try:
            extra = await client.post("/v1/completions", json={**_long_body(model), "stream": False})
            return [r.status_code for r in responses], extra.status_code
        finally:
            for r in responses:
                await r.aclose()  # disconnects: the server aborts them


def test_slots_plus_queue_requests_all_fit_and_one_more_gets_429(queued):
    codes, extra = asyncio.run(_fill_then_one_more(queued.base_url, queued.model))
    assert codes.count(429) == 0, codes
    assert codes == [200] * (SLOTS + QUEUE)
    assert extra == 429


def _half_closed_exchange(port: int, body: dict) -> bytes:
    """Send ``body`` to /v1/completions, shut down the writing side, read until EOF."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head + payload)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _gauge(base: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} missing from /metrics")


def _wait_idle(base: str, timeout: float, why: str) -> None:
    """Until no request runs or waits (``why``: the failure when ``timeout`` seconds pass first). A stream
    whose client has gone is aborted by the server after it notices, and until then it holds its place."""
    deadline = time.monotonic() + timeout
    while _gauge(base, "quanta:num_requests_running") > 0 or _gauge(base, "quanta:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [False, True])
def test_a_half_closed_client_is_aborted_deliberately(queued, stream):
    """A FIN after the request reads as a client that gave up (it cannot be told from a
    full close): the connection closes at once and the request leaves its slot."""
    _wait_idle(queued.base_url, 60, "the server kept requests whose clients had gone")
    started = time.monotonic()
    reply = _half_closed_exchange(queued.port, {"model": queued.model, "prompt": "Hello", "max_tokens": 400,
                                                "ignore_eos": True, "stream": stream})
    # closed before any of the answer: nothing, or (a stream whose head was written before the FIN was read) a bare head
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert reply == b"" or (head.startswith(b"HTTP/1.1 200") and b"data:" not in rest and b'"text"' not in rest), reply[:300]
    assert time.monotonic() - started < 30  # closed long before 400 tokens could be generated
    _wait_idle(queued.base_url, 30, "the half-closed request kept its slot")
    done = httpx.post(queued.base_url + "/v1/completions", timeout=60,
                      json={"model": queued.model, "prompt": "Hello", "max_tokens": 2})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
