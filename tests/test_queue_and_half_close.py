"""Queue accounting and half-closed connections, against a live ``quanta serve``
(issue 12).

- ``--max-num-seqs 8 --max-queue 16``: 24 concurrent long requests all fit (8
  slots + 16 waiting), the 25th gets 429.
- A client that sends a whole request and then shuts down its writing side
  (``shutdown(SHUT_WR)``) still gets its answer (raw socket).
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

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


@pytest.mark.parametrize("stream", [False, True])
def test_a_half_closed_client_gets_its_answer(queued, stream):
    reply = _half_closed_exchange(queued.port, {"model": queued.model, "prompt": "Hello", "max_tokens": 4,
                                                "ignore_eos": True, "stream": stream})
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply[:500]
    assert (b"data: [DONE]" in body) if stream else (b'"finish_reason":"length"' in body.replace(b" ", b"")), body[-500:]


def test_a_half_close_mid_body_closes_without_an_answer(queued):
    """An EOF before the declared body is complete is no request: the server closes."""
    with socket.create_connection(("127.0.0.1", queued.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(65536) == b""
    assert httpx.get(queued.base_url + "/health", timeout=10).status_code == 200
