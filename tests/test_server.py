"""End-to-end tests of ``quanta serve`` through the official ``openai`` client.

All expected texts are derived inside the tests from the server's own greedy
output; only invariants (usage arithmetic, determinism, stream == non-stream,
stop-string truncation, slot accounting) are asserted.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quanta.engine.kv_budget import format_bytes

COMPLETION_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]
LONG_PROMPT = "Once upon a time"  # a prompt for requests that are cut short


# --------------------------------------------------------------------------- helpers


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=60, max_retries=0)


def scrape(server) -> dict[str, float]:
    """``/metrics`` as {sample name with sorted labels: value}."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_for(server, predicate, what: str, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until ``predicate(samples)`` holds (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if predicate(samples):
            return samples
        if time.monotonic() > deadline:
            running, waiting = samples.get("quanta:num_requests_running"), samples.get("quanta:num_requests_waiting")
            pytest.fail(f"timed out after {timeout} s waiting for {what} (running={running}, waiting={waiting})")
        time.sleep(0.1)


def wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    return wait_for(
        server,
        lambda m: m["quanta:num_requests_running"] == 0 and m["quanta:num_requests_waiting"] == 0,
        "no running or waiting requests", timeout,
    )


def token_prompt(n: int, offset: int = 0) -> list[int]:
    """A prompt of exactly ``n`` ordinary token ids (well inside the vocabulary)."""
    return [1000 + offset * 37 + 13 * j for j in range(n)]


def usage_counts(usage) -> dict:
    """A usage object without ``prompt_tokens_details``: its ``cached_tokens``
    depends on what earlier requests left in the KV slots (prefix reuse)."""
    return {k: v for k, v in usage.model_dump().items() if k != "prompt_tokens_details"}


def check_usage(usage, max_tokens: int, finish_reason: str) -> None:
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish_reason in {"stop", "length"}
    if finish_reason == "length":
        assert usage.completion_tokens == max_tokens
    else:
        assert 1 <= usage.completion_tokens <= max_tokens


def collect_completion_stream(stream) -> tuple[str, list, list]:
    """(text, finish reasons per choice-bearing chunk, all chunks)."""
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].text for c in with_choices)
    return text, [c.choices[0].finish_reason for c in with_choices], chunks


def collect_chat_stream(stream) -> tuple[str, list, list]:
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    return text, [c.choices[0].finish_reason for c in with_choices], chunks


def check_stream_shape(chunks: list, finish_reasons: list, expected_reason: str, usage=None) -> None:
    """One finish_reason, on the last choice chunk; one id; usage only in the final chunk."""
    assert finish_reasons, "the stream carried no choices"
    assert finish_reasons[-1] == expected_reason
    assert all(r is None for r in finish_reasons[:-1]), finish_reasons
    assert len({c.id for c in chunks}) == 1
    if usage is None:
        assert all(c.usage is None for c in chunks)
    else:
        final = chunks[-1]
        assert final.choices == [] and final.usage is not None
        assert usage_counts(final.usage) == usage_counts(usage)
        assert all(c.usage is None for c in chunks[:-1])


# --------------------------------------------------------------------------- basics


def test_models_lists_the_served_model(server):
    models = client_for(server).models.list()
    ids = [m.id for m in models.data]
    assert ids == [server.model]
    raw = httpx.get(server.base_url + "/v1/models", timeout=10).json()
    assert raw["data"][0]["max_model_len"] == 512


def test_startup_line_and_config_show_the_flags(server):
    flags = dict(zip(server.flags[::2], server.flags[1::2]))
    expected = {
        "scheduler": flags["--scheduler"],
        "max_num_seqs": int(flags["--max-num-seqs"]),
        "prefill_quantum": int(flags["--prefill-quantum"]),
        "mixed_prefill_quantum": int(flags["--mixed-prefill-quantum"]),
        "prefill_cap": int(flags["--prefill-cap"]),
    }
    line = " ".join(f"{k}={v}" for k, v in expected.items())
    assert line in server.log(), f"startup line {line!r} missing from the log:\n{server.log_tail()}"
    config = httpx.get(server.base_url + "/v1/config", timeout=10).json()
    assert {k: config.get(k) for k in expected} == expected
    assert config["max_model_len"] == int(flags["--max-model-len"])
    assert config["model"] == server.model
    per_token = config["kv_cache_bytes"] // config["kv_cache_tokens"]
    assert per_token * config["kv_cache_tokens"] == config["kv_cache_bytes"] > 0 and config["weight_bytes"] > 0
    sizes = f"kv_cache_tokens={config['kv_cache_tokens']} ({format_bytes(config['kv_cache_bytes'])}, {format_bytes(per_token)} a token)"
    assert sizes in server.log() and f"weights={format_bytes(config['weight_bytes'])}" in server.log(), server.log_tail()


# --------------------------------------------------------------------------- completions / chat


def test_completion_greedy_stream_matches_non_stream(server):
    client = client_for(server)
    req = dict(model=server.model, prompt=COMPLETION_PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(**req)
    choice = first.choices[0]
    assert choice.text.strip(), "greedy completion is empty"
    assert choice.finish_reason == "length"  # ignore_eos: only the length limit ends it
    check_usage(first.usage, 12, choice.finish_reason)
    assert first.object == "text_completion" and first.model == server.model

    second = client.completions.create(**req)
    assert second.choices[0].text == choice.text, "greedy decoding is not deterministic"
    assert usage_counts(second.usage) == usage_counts(first.usage)

    text, reasons, chunks = collect_completion_stream(
        client.completions.create(**req, stream=True, stream_options={"include_usage": True})
    )
    assert text == choice.text
    check_stream_shape(chunks, reasons, "length", usage=first.usage)

    text, reasons, chunks = collect_completion_stream(client.completions.create(**req, stream=True))
    assert text == choice.text
    check_stream_shape(chunks, reasons, "length", usage=None)


def test_null_sampling_fields_mean_their_defaults(server):
    """OpenAI allows null for optional fields (the client sends it for ``temperature=None``)."""
    body = {"model": server.model, "prompt": COMPLETION_PROMPT, "max_tokens": 3, "temperature": None, "top_p": None,
            "n": None, "presence_penalty": None, "stop": None, "seed": None}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_token_id_prompt_usage_counts_exactly(server):
    client = client_for(server)
    ids = token_prompt(9)
    out = client.completions.create(model=server.model, prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == 3
    assert out.usage.total_tokens == len(ids) + 3


def test_text_prompt_usage_is_the_same_streaming_and_not(server):
    """prompt_tokens is the server's own tokenization: both paths must agree,
    and it must not depend on max_tokens."""
    client = client_for(server)
    short = client.completions.create(model=server.model, prompt=COMPLETION_PROMPT, max_tokens=1, temperature=0)
    *_, final = client.completions.create(
        model=server.model, prompt=COMPLETION_PROMPT, max_tokens=2, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    assert final.usage is not None
    assert final.usage.prompt_tokens == short.usage.prompt_tokens > 0


def test_chat_greedy_stream_matches_non_stream(server):
    client = client_for(server)
    req = dict(model=server.model, messages=CHAT_MESSAGES, max_tokens=12, temperature=0)
    first = client.chat.completions.create(**req)
    choice = first.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip(), "greedy chat reply is empty"
    check_usage(first.usage, 12, choice.finish_reason)
    assert first.object == "chat.completion"

    second = client.chat.completions.create(**req)
    assert second.choices[0].message.content == choice.message.content
    assert second.choices[0].finish_reason == choice.finish_reason
    assert usage_counts(second.usage) == usage_counts(first.usage)

    text, reasons, chunks = collect_chat_stream(
        client.chat.completions.create(**req, stream=True, stream_options={"include_usage": True})
    )
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    check_stream_shape(chunks, reasons, choice.finish_reason, usage=first.usage)

    text, reasons, chunks = collect_chat_stream(client.chat.completions.create(**req, stream=True))
    assert text == choice.message.content
    check_stream_shape(chunks, reasons, choice.finish_reason, usage=None)


def test_chat_max_completion_tokens_limits_length(server):
    out = client_for(server).chat.completions.create(
        model=server.model, messages=CHAT_MESSAGES, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_raw_sse_ends_with_done(server, endpoint):
    body = {"model": server.model, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    if endpoint == "completions":
        body["prompt"] = COMPLETION_PROMPT
    else:
        body["messages"] = CHAT_MESSAGES
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/v1/{endpoint}", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in resp.iter_lines() if line.strip()]
    assert lines, "empty SSE body"
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    assert lines.count("data: [DONE]") == 1
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- stop strings


@pytest.fixture(scope="module")
def greedy_text(server) -> str:
    """The unconstrained greedy continuation the stop-string tests cut."""
    out = client_for(server).completions.create(
        model=server.model, prompt=COMPLETION_PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def _stop_string(text: str, kind: str) -> str:
    words = list(re.finditer(r"[A-Za-z]{2,}", text))
    if kind == "word":
        if len(words) < 2:
            pytest.skip(f"greedy output has fewer than two words: {text!r}")
        return words[1].group()
    if len(words) < 3:
        pytest.skip(f"greedy output has fewer than three words: {text!r}")
    return text[words[1].start():words[2].end()]  # spans several tokens, with the space


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", ["word", "two-words"])
def test_stop_string_truncates_before_it(server, greedy_text, kind, stream):
    stop = _stop_string(greedy_text, kind)
    expected = greedy_text[:greedy_text.find(stop)]
    req = dict(
        model=server.model, prompt=COMPLETION_PROMPT, max_tokens=16, temperature=0,
        stop=[stop, "@@never-appears@@"], extra_body={"ignore_eos": True},
    )
    client = client_for(server)
    if stream:
        text, reasons, chunks = collect_completion_stream(
            client.completions.create(**req, stream=True, stream_options={"include_usage": True})
        )
        check_stream_shape(chunks, reasons, "stop", usage=chunks[-1].usage)
        usage = chunks[-1].usage
    else:
        out = client.completions.create(**req)
        text, reasons, usage = out.choices[0].text, [out.choices[0].finish_reason], out.usage
    assert text == expected, f"stop {stop!r} in {greedy_text!r}"
    assert stop not in text
    assert reasons[-1] == "stop"
    assert usage.completion_tokens <= 16


# --------------------------------------------------------------------------- concurrency and cancellation


def test_eight_concurrent_streams_complete_with_exact_usage(server):
    wait_idle(server)
    n, max_tokens = 8, 16
    earlier = httpx.get(server.base_url + "/v1/trace", timeout=10).json()["records"]
    since = earlier[-1]["step"] + 1 if earlier else 0
    barrier = threading.Barrier(n, timeout=30)
    results: list[dict | None] = [None] * n
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            client = client_for(server)
            ids = token_prompt(4 + i, offset=i)
            barrier.wait()
            text, reasons, chunks = collect_completion_stream(client.completions.create(
                model=server.model, prompt=ids, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            ))
            results[i] = {"prompt_len": len(ids), "text": text, "reasons": reasons, "chunks": chunks}
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a streaming client did not finish within 120 s"
    assert not errors, errors
    for r in results:
        usage = r["chunks"][-1].usage
        check_stream_shape(r["chunks"], r["reasons"], "length", usage=usage)
        assert usage.prompt_tokens == r["prompt_len"]
        assert usage.completion_tokens == max_tokens
        assert r["text"]
    # the requests really shared decode steps
    records = httpx.get(server.base_url + "/v1/trace", params={"since": since}, timeout=10).json()["records"]
    widest = max((len(rec["seq_ids"]) for rec in records if rec["kind"] == "decode"), default=0)
    assert widest >= 4, f"the 8 concurrent requests never decoded together (widest decode step: {widest})"
    wait_idle(server)


def test_cancelled_stream_frees_its_slot(server):
    before = wait_idle(server)
    client = client_for(server)
    stream = client.completions.create(
        model=server.model, prompt=LONG_PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )
    try:
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        during = scrape(server)
        assert during["quanta:num_requests_running"] == 1
    finally:
        stream.close()
    after = wait_for(server, lambda m: m["quanta:num_requests_running"] == 0, "the cancelled request to leave its slot", 20)
    aborts = 'quanta:request_success_total{finished_reason="abort"}'
    assert after.get(aborts, 0) == before.get(aborts, 0) + 1
    assert after["quanta:generation_tokens_total"] - before["quanta:generation_tokens_total"] < 400
    assert after["quanta:e2e_request_latency_seconds_count"] == before["quanta:e2e_request_latency_seconds_count"]

    out = client.completions.create(model=server.model, prompt=LONG_PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"


def test_timed_out_non_streaming_request_frees_its_slot(server):
    before = wait_idle(server)
    body = {"model": server.model, "prompt": LONG_PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=1.5))
    after = wait_for(server, lambda m: m["quanta:num_requests_running"] == 0, "the abandoned request to leave its slot", 20)
    aborts = 'quanta:request_success_total{finished_reason="abort"}'
    assert after.get(aborts, 0) == before.get(aborts, 0) + 1
    generated = after["quanta:generation_tokens_total"] - before["quanta:generation_tokens_total"]
    assert 0 < generated < 400
    out = client_for(server).completions.create(
        model=server.model, prompt=LONG_PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 4


# --------------------------------------------------------------------------- metrics


METRIC_NAMES = [
    "quanta:num_requests_running",
    "quanta:num_requests_waiting",
    "quanta:prompt_tokens_total",
    "quanta:generation_tokens_total",
    "quanta:time_to_first_token_seconds_count",
    "quanta:time_to_first_token_seconds_sum",
    "quanta:inter_token_latency_seconds_count",
    "quanta:inter_token_latency_seconds_sum",
    "quanta:e2e_request_latency_seconds_count",
    "quanta:e2e_request_latency_seconds_sum",
]


def test_metrics_names_and_counters_move(server):
    resp = httpx.get(server.base_url + "/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    before = wait_idle(server)
    missing = [name for name in METRIC_NAMES if name not in before]
    assert not missing, f"missing metrics: {missing}"
    assert any(k.startswith("quanta:time_to_first_token_seconds_bucket") for k in before)

    prompt_len, max_tokens = 7, 5
    out = client_for(server).completions.create(
        model=server.model, prompt=token_prompt(prompt_len, offset=3), max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == max_tokens
    after = wait_idle(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("quanta:prompt_tokens_total") == prompt_len
    assert delta("quanta:generation_tokens_total") == max_tokens
    assert delta("quanta:time_to_first_token_seconds_count") == 1
    assert delta("quanta:e2e_request_latency_seconds_count") == 1
    assert delta("quanta:inter_token_latency_seconds_count") == max_tokens - 1
    assert delta('quanta:request_success_total{finished_reason="length"}') == 1
    for name in ("quanta:time_to_first_token_seconds_sum", "quanta:inter_token_latency_seconds_sum",
                 "quanta:e2e_request_latency_seconds_sum"):
        assert delta(name) > 0, name
    # the request's end-to-end time covers its first token
    assert delta("quanta:e2e_request_latency_seconds_sum") >= delta("quanta:time_to_first_token_seconds_sum")


# --------------------------------------------------------------------------- --max-queue


QUEUE_MODEL_NAME = "quanta-queue-test"


@pytest.fixture(scope="module")
def queue_server(launch_server):
    handle = launch_server(
        "--max-num-seqs", "1", "--max-queue", "1", "--max-model-len", "256", "--served-model-name", QUEUE_MODEL_NAME,
    )
    yield handle
    handle.stop()


def _open_stream(http: httpx.Client, server, max_tokens: int):
    body = {
        "model": server.model, "prompt": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }
    cm = http.stream("POST", server.base_url + "/v1/completions", json=body)
    resp = cm.__enter__()
    return cm, resp


def _finish_stream(resp, lines_iter) -> dict:
    lines = [line for line in lines_iter if line.strip()]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return json.loads(lines[-2][len("data: "):])["usage"]


def test_max_queue_rejects_with_429_and_others_complete(queue_server):
    server = queue_server
    assert server.model == QUEUE_MODEL_NAME
    assert "scheduler=batched max_num_seqs=1 prefill_quantum=2048 mixed_prefill_quantum=2048 prefill_cap=4096" in server.log()
    config = httpx.get(server.base_url + "/v1/config", timeout=10).json()
    assert config["max_queue"] == 1 and config["max_num_seqs"] == 1 and config["model"] == QUEUE_MODEL_NAME

    client = client_for(server)
    with httpx.Client(timeout=60) as http_a, httpx.Client(timeout=60) as http_b:
        cm_a, resp_a = _open_stream(http_a, server, max_tokens=40)
        cm_b = None
        try:
            assert resp_a.status_code == 200
            lines_a = resp_a.iter_lines()
            assert next(line for line in lines_a if line.startswith("data: "))  # A holds the only slot
            cm_b, resp_b = _open_stream(http_b, server, max_tokens=6)
            assert resp_b.status_code == 200
            wait_for(server, lambda m: m["quanta:num_requests_waiting"] == 1 and m["quanta:num_requests_running"] == 1,
                     "one running and one waiting request", 15)

            body = {"model": server.model, "prompt": LONG_PROMPT, "max_tokens": 2}
            rejected = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
            assert rejected.status_code == 429, rejected.text
            error = rejected.json()["error"]
            assert isinstance(error["message"], str) and error["message"]
            assert error["type"] == "rate_limit_error"
            assert "param" in error and "code" in error
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model=server.model, messages=CHAT_MESSAGES, max_tokens=2)

            usage_a = _finish_stream(resp_a, lines_a)
            usage_b = _finish_stream(resp_b, resp_b.iter_lines())
        finally:
            cm_a.__exit__(None, None, None)
            if cm_b is not None:
                cm_b.__exit__(None, None, None)
    assert usage_a["completion_tokens"] == 40
    assert usage_b["completion_tokens"] == 6
    wait_idle(server)
    out = client.completions.create(model=server.model, prompt=LONG_PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    # the served name replaced the file name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=LONG_PROMPT, max_tokens=1)


async def _burst(server, count: int, max_tokens: int) -> list[int]:
    """``count`` simultaneous non-streaming requests; their status codes."""
    body = {"model": server.model, "prompt": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        responses = await asyncio.gather(*[http.post(server.base_url + "/v1/completions", json=body) for _ in range(count)])
    return sorted(r.status_code for r in responses)


def test_max_queue_holds_under_a_burst(queue_server):
    """Simultaneous arrivals must not slip past --max-queue (1 slot + 1 queue place)."""
    server = queue_server
    wait_idle(server)
    # idle: one request takes the slot, one waits, the third is refused
    assert asyncio.run(_burst(server, 3, max_tokens=16)) == [200, 200, 429]
    wait_idle(server)
    # busy: while a long request holds the slot, only one of three may wait
    with httpx.Client(timeout=60) as http:
        cm, resp = _open_stream(http, server, max_tokens=40)
        try:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert asyncio.run(_burst(server, 3, max_tokens=2)) == [200, 429, 429]
            assert _finish_stream(resp, lines)["completion_tokens"] == 40
        finally:
            cm.__exit__(None, None, None)
    wait_idle(server)
