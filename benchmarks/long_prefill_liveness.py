"""Streams through a long cold prefill: first bytes, silence, and a dropped request's retry.

Starts ``quanta serve`` on the embedded model (``--max-model-len``, ``--stream-keepalive``,
two KV slots of the full length), then for each protocol (chat completions, Anthropic
messages, Responses; ``--protocols`` may add ``completions``) sends a streamed request of a
``--tokens``-token prompt that no earlier request shares (a fresh first block), and measures:

- first bytes: seconds from the request to the first write of the response (the larger of the
  cold stream's and the retry's);
- max gap: the longest silence until the first output token (from the request to the first
  write, then between consecutive writes), over the cold stream and the retry: at most
  ``--stream-keepalive`` plus scheduling;
- cold TTFT: seconds to the first output event (the whole cold prefill);
- drop and retry (another fresh prompt of the same length): the client drops the stream after
  ``--drop-after`` seconds and at once sends the same request again; ``freed`` is the time
  from the drop until ``/metrics`` counts the abort (the engine applied it: the running step of
  only that request stops at its next decoder block), ``retry TTFT`` the second request's time to its first output event, against
  ``cold - drop`` (what is left of the cold prefill: the retry resumes from the prefix cache,
  whose ``cached`` tokens its usage reports).

Prints the machine's CPU (model name and the server's kernel flags) and one row per protocol.
Never run in CI: at the defaults (60,000 tokens, drop after 60 s) each protocol costs two cold
prefills of minutes. A reduced run: ``--tokens 8000 --max-model-len 9000 --drop-after 10``.

``--cold`` and ``--drop`` split the protocols: ``--cold chat --drop messages`` streams two
protocols through a full prefill each for the price of two prefills, the retry held against the
chat cold run (the prefill is the same work on every protocol).

Usage: ``python benchmarks/long_prefill_liveness.py [--tokens 60000] [--max-model-len 65536]
[--drop-after 60] [--stream-keepalive 10] [--protocols chat,messages,responses]
[--cold P,..] [--drop P,..]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from quanta.bench.server import start

ABORTS = re.compile(r'^quanta:request_aborts_total\{cause="disconnect",phase="(?:prefill|queued)"\} (\S+)$', re.M)


def _request(protocol: str, model: str, text: str) -> tuple[str, dict]:
    """The route and streamed body of one request (one output token, 16 for Responses' minimum)."""
    if protocol == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                                        "stream": True, "stream_options": {"include_usage": True}}
    if protocol == "completions":
        return "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1, "stream": True,
                                   "stream_options": {"include_usage": True}}
    if protocol == "messages":
        return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                                "stream": True}
    return "/v1/responses", {"model": model, "input": text, "max_output_tokens": 16, "stream": True}


def _events(writes: list[tuple[float, bytes]]) -> list[tuple[float, str]]:
    """SSE blocks with the time of the write that completed each."""
    blocks, buffer = [], ""
    for t, chunk in writes:
        buffer += chunk.decode(errors="replace")
        *done, buffer = buffer.split("\n\n")
        blocks += [(t, b) for b in done if b]
    return blocks


def _is_output(block: str) -> bool:
    """Whether an SSE block carries output: not a keep-alive (a comment, ``ping``, an empty chat
    delta or completion text, ``response.in_progress``), nor an opening event or the role chunk."""
    if block.startswith(":") or block.startswith("event: ping") or "data: [DONE]" in block:
        return False
    data = json.loads(block.split("data: ", 1)[1]) if "data: {" in block else {}
    if data.get("type") in ("message_start", "response.created", "response.in_progress"):
        return False
    choices = data.get("choices")
    if not choices:
        return bool(data) and "usage" not in data
    choice = choices[0]
    delta = choice.get("delta", {})
    said = choice.get("text") or any(v for k, v in delta.items() if k != "role")
    return bool(said or choice.get("finish_reason"))


def _cached(blocks: list[tuple[float, str]]) -> int | None:
    """Prompt tokens the usage in the stream reports as served from the prefix cache."""
    for _, block in reversed(blocks):
        if "data: {" not in block:
            continue
        data = json.loads(block.split("data: ", 1)[1])
        usage = data.get("usage") or (data.get("response") or {}).get("usage")
        if not usage:
            continue
        if "cache_read_input_tokens" in usage:
            return usage["cache_read_input_tokens"]
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        return details.get("cached_tokens")
    return None


async def _stream(base: str, path: str, body: dict, drop_after: float | None = None) -> dict:
    """One streamed request: its timed writes, and the drop time if it was dropped."""
    writes: list[tuple[float, bytes]] = []
    t0 = time.monotonic()
    dropped = None
    async with httpx.AsyncClient(timeout=None) as client, client.stream("POST", base + path, json=body) as response:
        async def read() -> None:
            async for chunk in response.aiter_raw():
                writes.append((time.monotonic() - t0, chunk))
        try:
            await asyncio.wait_for(read(), drop_after)
        except TimeoutError:
            dropped = time.monotonic() - t0
    blocks = _events(writes)
    first = next((t for t, b in blocks if _is_output(b)), None)
    head = [0.0] + [t for t, _ in writes if first is None or t <= first]
    return {"first_bytes": writes[0][0] if writes else None, "ttft": first, "dropped": dropped,
            "max_gap": max((b - a for a, b in zip(head, head[1:], strict=False)), default=None),
            "cached": _cached(blocks)}


def _aborts(base: str) -> float:
    found = ABORTS.findall(httpx.get(base + "/metrics", timeout=30).text)
    return sum(float(v) for v in found)


async def _drop_and_retry(base: str, path: str, body: dict, drop_after: float) -> dict:
    before = _aborts(base)
    dropped = await _stream(base, path, body, drop_after)
    if dropped["dropped"] is None:
        return {"freed": None, "retry": None, "drop": None}
    t_drop = time.monotonic()
    retry = asyncio.ensure_future(_stream(base, path, body))  # sent again at once
    freed = None
    while freed is None and not retry.done():
        if await asyncio.to_thread(_aborts, base) > before:
            freed = time.monotonic() - t_drop
        else:
            await asyncio.sleep(0.05)
    return {"freed": freed, "retry": await retry, "drop": dropped["dropped"]}


def _prompt_text(base: str, tokens: int) -> str:
    """Text of about ``tokens`` chat-template tokens, behind a fresh first block."""
    words = " ".join(f"w{i}" for i in range(tokens // 4 + 16))
    count = httpx.post(base + "/tokenize", json={"prompt": words}, timeout=120).json()["count"]
    cut = words[: int(len(words) * tokens / count)]
    return uuid.uuid4().hex + " " + cut


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


async def _cold(base: str, model: str, protocol: str, tokens: int) -> dict:
    path, body = _request(protocol, model, _prompt_text(base, tokens))
    return await _stream(base, path, body)


async def _dropped(base: str, model: str, protocol: str, args) -> dict:
    path, body = _request(protocol, model, _prompt_text(base, args.tokens))
    return await _drop_and_retry(base, path, body, args.drop_after)


def _row(protocol: str, cold: dict | None, reference: dict | None, dr: dict | None) -> list[str]:
    """One protocol's figures; ``reference`` is the cold run its retry is held against."""
    cold, dr = cold or {}, dr or {}
    retry = dr.get("retry") or {}
    ref_ttft = (reference or {}).get("ttft")
    left = ref_ttft - dr["drop"] if ref_ttft is not None and dr.get("drop") is not None else None
    gaps = [g for g in (cold.get("max_gap"), retry.get("max_gap")) if g is not None]
    firsts = [f for f in (cold.get("first_bytes"), retry.get("first_bytes")) if f is not None]
    return [protocol, _fmt(max(firsts), 3) if firsts else "-", _fmt(max(gaps)) if gaps else "-",
            _fmt(cold.get("ttft"), 1), _fmt(dr.get("drop"), 1), _fmt(dr.get("freed")),
            _fmt(retry.get("ttft"), 1), _fmt(left, 1), _fmt(retry.get("cached"))]


async def _run(base: str, model: str, args) -> list[list[str]]:
    """Cold prefills on ``--cold`` protocols, drop-and-retry on ``--drop`` ones; a retry is held
    against its own protocol's cold run, else the first one measured (the prefill is the same work)."""
    colds: dict[str, dict] = {}
    rows = []
    for protocol in dict.fromkeys(args.cold + args.drop):
        if protocol in args.cold:
            colds[protocol] = await _cold(base, model, protocol, args.tokens)
        dr = await _dropped(base, model, protocol, args) if protocol in args.drop else None
        reference = colds.get(protocol) or next(iter(colds.values()), None)
        rows.append(_row(protocol, colds.get(protocol), reference, dr))
        print("  " + " | ".join(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=60000)
    parser.add_argument("--max-model-len", type=int, default=65536)
    parser.add_argument("--drop-after", type=float, default=60.0)
    parser.add_argument("--stream-keepalive", type=float, default=10.0)
    parser.add_argument("--protocols", default="chat,messages,responses",
                        help="protocols that get both a cold run and a drop-and-retry")
    parser.add_argument("--cold", help="protocols that get a cold run (default: --protocols)")
    parser.add_argument("--drop", help="protocols that get a drop-and-retry (default: --protocols; '' for none)")
    args = parser.parse_args()
    args.cold = [p for p in (args.protocols if args.cold is None else args.cold).split(",") if p]
    args.drop = [p for p in (args.protocols if args.drop is None else args.drop).split(",") if p]
    flags = ["--max-model-len", str(args.max_model_len), "--stream-keepalive", str(args.stream_keepalive),
             "--max-num-seqs", "2", "--kv-cache-tokens", str(2 * args.max_model_len)]
    server = start(flags, Path(tempfile.mkdtemp(prefix="liveness-")), timeout=300)
    try:
        model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        config = httpx.get(server.base_url + "/v1/config", timeout=30).json()
        print(f"cpu: {_cpu_model()}; kernel flags: {config.get('cpu_flags')}; prefill quantum "
              f"{config.get('prefill_quantum')}, keep-alive {args.stream_keepalive:g} s, prompt ~{args.tokens} tokens, "
              f"drop after {args.drop_after:g} s")
        header = ["protocol", "first bytes s", "max gap s", "cold TTFT s", "drop at s", "freed after s",
                  "retry TTFT s", "cold - drop s", "retry cached"]
        print("  " + " | ".join(header), flush=True)
        asyncio.run(_run(server.base_url, model, args))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
