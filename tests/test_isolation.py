"""One failing request never hurts another.

An in-process server (:mod:`inprocess_server`: the real embedded model, uvicorn
on 127.0.0.1) lets a test poison a request after the API validated it. A
healthy stream running at the same time must finish with all its tokens; the
poisoned request must get an error (an SSE error event, or a 500 naming an
error id) and never the raw exception text. Also: body limits, Anthropic
routes' input checks, and where tokenization runs.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
import torch

from inprocess_server import CRASH_SEED, POISON_TOP_K, SECRET, PoisoningEngine, serve_in_process
from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.sampling import SamplingParams
from quanta.engine.stop_strings import TextState
from quanta.launch import build_engine, load_model
from quanta.server import limits

MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 2 * 2**20
HEALTHY_TOKENS = 24


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32)


@pytest.fixture(scope="module")
def live(loaded):
    """(base URL, model name, ServerState) of an in-process server."""
    with serve_in_process(loaded, MAX_MODEL_LEN, MAX_REQUEST_BYTES) as server:
        yield server.base, server.model, server.state


class HealthyStream(threading.Thread):
    """A streaming completion through the official client, on its own thread."""

    def __init__(self, base: str, model: str) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = model
        self.started = threading.Event()
        self.texts: list[str] = []
        self.reasons: list[str | None] = []
        self.usage = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=self.model, prompt="Once upon a time", max_tokens=HEALTHY_TOKENS, temperature=0.7, seed=1,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices:
                    self.texts.append(chunk.choices[0].text)
                    self.reasons.append(chunk.choices[0].finish_reason)
                    self.started.set()
                if chunk.usage is not None:
                    self.usage = chunk.usage
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()

    def check(self) -> None:
        self.join(timeout=120)
        assert not self.is_alive(), "the healthy stream did not finish"
        assert self.error is None, repr(self.error)
        assert self.reasons[-1] == "length" and all(r is None for r in self.reasons[:-1])
        assert self.usage is not None and self.usage.completion_tokens == HEALTHY_TOKENS
        assert "".join(self.texts)


def _healthy(live) -> HealthyStream:
    base, model, _ = live
    stream = HealthyStream(base, model)
    stream.start()
    assert stream.started.wait(60) and stream.error is None, repr(stream.error)
    return stream


def test_a_poisoned_stream_gets_an_error_event_and_a_concurrent_stream_finishes(live):
    base, model, _ = live
    healthy = _healthy(live)
    body = {"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "top_k": POISON_TOP_K, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {") and '"error"' in line]
    assert len(errors) == 1, lines
    message = errors[0]["error"]["message"]
    assert "error id" in message and "Overflow" not in message and "2**64" not in message
    assert lines[-1] == "data: [DONE]"
    healthy.check()


def test_the_official_clients_raise_on_a_poisoned_stream(live):
    base, model, _ = live
    healthy = _healthy(live)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError, match="error id"):
        for _ in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=1.0,
            extra_body={"top_k": POISON_TOP_K}, stream=True,
        ):
            pass
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError, match="error id"):
        with claude.messages.stream(model=model, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                    extra_body={"temperature": 1.0, "top_k": POISON_TOP_K}) as stream:
            stream.get_final_message()
    healthy.check()


def test_a_poisoned_request_gets_a_500_with_an_error_id(live):
    base, model, _ = live
    healthy = _healthy(live)
    resp = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "top_k": POISON_TOP_K})
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert "error id" in error["message"] and "Overflow" not in error["message"]
    assert error["type"] == "server_error"
    healthy.check()


def test_an_unexpected_exception_is_logged_and_answered_with_an_id(live, caplog):
    base, model, _ = live
    with caplog.at_level(logging.ERROR, logger="quanta.server"):
        resp = httpx.post(base + "/v1/completions", timeout=60, json={"model": model, "prompt": "Hi", "seed": CRASH_SEED})
        anth = httpx.post(base + "/v1/messages", timeout=60, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 500
    assert SECRET not in resp.text and "KeyError" not in resp.text
    error_id = resp.json()["error"]["message"].split("error id ")[1].split(";")[0]
    assert any(error_id in r.getMessage() and r.exc_info and SECRET in str(r.exc_info[1]) for r in caplog.records)
    assert anth.status_code == 200  # the server goes on


def test_a_failing_detokenizer_fails_its_request_alone(loaded):
    """The engine loop itself, no server: one request's text state raises mid-generation."""
    engine = build_engine(loaded, EngineConfig(max_model_len=MAX_MODEL_LEN), SchedulerConfig("batched", 4, {}))
    params = lambda: SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)  # noqa: E731
    healthy = engine.add_request(loaded.tokenizer.encode("The capital of France is"), params())
    poisoned = engine.add_request(loaded.tokenizer.encode("Once upon a time"), params())

    class BrokenDetokenizer:
        calls = 0

        def add(self, token_id: int) -> str:
            BrokenDetokenizer.calls += 1
            if BrokenDetokenizer.calls == 3:
                raise UnicodeError("detokenizer broke")
            return "x"

        def flush(self) -> str:
            return ""

    engine._text[poisoned.seq_id] = TextState(BrokenDetokenizer(), None)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    bad = [o for o in outputs if o.seq_id == poisoned.seq_id]
    assert bad[-1].finished and bad[-1].finish_reason == "error" and "error id" in bad[-1].error
    assert len(poisoned.output_token_ids) == 3
    good = [o for o in outputs if o.seq_id == healthy.seq_id]
    assert good[-1].finish_reason == "length" and len(healthy.output_token_ids) == 10
    assert not engine.sequences and not engine.scheduler.running


def test_tokenization_runs_off_the_event_loop(live, monkeypatch):
    base, model, state = live
    PoisoningEngine.tokenized_on.clear()
    encode_text = state.tokenizer.encode_text  # client text; the template's parts go through tokenizer.encode

    def recording_encode_text(*args, **kwargs):
        PoisoningEngine.tokenized_on.append(threading.current_thread().name)
        return encode_text(*args, **kwargs)

    monkeypatch.setattr(state.tokenizer, "encode_text", recording_encode_text)
    resp = httpx.post(base + "/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200
    chat = httpx.post(base + "/v1/messages/count_tokens", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]})
    assert chat.status_code == 200
    assert len(PoisoningEngine.tokenized_on) >= 3  # the completion, the chat template's parts, the prefill
    assert all(name.startswith("quanta-prompt") for name in PoisoningEngine.tokenized_on), PoisoningEngine.tokenized_on


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"])
def test_a_body_over_the_limit_gets_413_with_the_routes_error_body(live, path):
    base, model, _ = live
    text = "a" * (MAX_REQUEST_BYTES + 10)
    body = {"model": model, "prompt": text, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    resp = httpx.post(base + path, json=body, timeout=60)
    assert resp.status_code == 413, resp.text
    payload = resp.json()
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error" and payload["error"]["type"] == "request_too_large"
        message = payload["error"]["message"]
    else:
        message = payload["error"]["message"]
    assert str(MAX_REQUEST_BYTES) in message and "--max-request-bytes" in message


def test_a_chunked_body_over_the_limit_gets_413(live):
    base, model, _ = live

    def chunks():
        yield b'{"model": "' + model.encode() + b'", "prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 2**16 + 2):
            yield b"a" * 2**16
        yield b'"}'

    resp = httpx.post(base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == 413
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_a_body_that_trickles_past_the_deadline_gets_408(live, monkeypatch):
    """The head arrived, the body does not: the connection is answered and closed, not held."""
    base, model, _ = live
    monkeypatch.setattr(limits, "BODY_TIMEOUT_S", 1.0)
    host, port = base.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n").encode()
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + b'{"model": "' + model.encode() + b'"')  # and no more
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply, reply[:300]
    assert time.monotonic() - start < 10
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def _anthropic_cases(model: str) -> list[tuple[str, str, object, list[str]]]:
    """(id, path, body (str = raw bytes), message fragments) answered 400 with Anthropic's body."""
    msg = lambda **kw: {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **kw}  # noqa: E731
    deep = "[" * 100_000 + "]" * 100_000
    return [
        ("nested-json-messages", "/v1/messages", deep, ["nested too deeply"]),
        ("nested-json-count-tokens", "/v1/messages/count_tokens", deep, ["nested too deeply"]),
        ("nested-json-in-a-field", "/v1/messages", '{"model": "m", "max_tokens": 4, "messages": ' + deep + "}", ["nested too deeply"]),
        ("lone-surrogate-message", "/v1/messages",
         f'{{"model": "{model}", "max_tokens": 4, "messages": [{{"role": "user", "content": "a\\ud800b"}}]}}', ["surrogate"]),
        ("lone-surrogate-system", "/v1/messages/count_tokens",
         f'{{"model": "{model}", "system": "\\udfff", "messages": [{{"role": "user", "content": "hi"}}]}}', ["surrogate"]),
        ("too-many-stop-sequences", "/v1/messages", msg(stop_sequences=["x" * 60] * 20_000), ["stop_sequences", "32"]),
        ("max-tokens-digit-string", "/v1/messages", msg(max_tokens="4"), ["max_tokens"]),
        ("max-tokens-null", "/v1/messages", msg(max_tokens=None), ["max_tokens", "required"]),
        ("temperature-nan", "/v1/messages",
         f'{{"model": "{model}", "max_tokens": 4, "temperature": NaN, "messages": [{{"role": "user", "content": "hi"}}]}}',
         ["temperature"]),
        ("top-k-bool", "/v1/messages", msg(top_k=True), ["top_k"]),
        ("prompt-chars-beyond-context", "/v1/messages", msg(messages=[{"role": "user", "content": "word " * 10_000}]),
         ["50000 characters", str(MAX_MODEL_LEN - 1)]),
    ]


@pytest.mark.parametrize("case_id", [c[0] for c in _anthropic_cases("m")])
def test_bad_anthropic_requests_get_400_with_anthropics_body(live, case_id):
    base, model, _ = live
    _, path, body, fragments = {c[0]: c for c in _anthropic_cases(model)}[case_id]
    if isinstance(body, str):
        resp = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        resp = httpx.post(base + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    payload = resp.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error", payload
    for fragment in fragments:
        assert fragment in payload["error"]["message"], payload


def test_max_tokens_null_means_the_default_on_completions(live):
    base, model, _ = live
    counts = []
    for extra in ({}, {"max_tokens": None}):
        resp = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": model, "prompt": "Count:", "temperature": 0, "ignore_eos": True, **extra})
        assert resp.status_code == 200, resp.text
        counts.append(resp.json()["usage"]["completion_tokens"])
    assert counts == [16, 16]


def test_a_tiny_temperature_samples_like_the_smallest_one(live):
    """temperature 1e-40 once overflowed the logits (a 500 that failed the whole step); it now samples as 0.01."""
    base, model, _ = live
    texts = []
    for temperature in (1e-40, 0.01):
        resp = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": temperature,
            "seed": 7, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_a_wrong_method_is_a_typed_client_error_with_allow(live, path):
    base, _, _ = live
    resp = httpx.get(base + path, timeout=10)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    payload = resp.json()
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (payload.get("type") == "error") == path.startswith("/v1/messages")


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(loaded):
    """Issue 12: it reported finish_reason length (Anthropic: max_tokens, stop_sequence null)."""
    engine = build_engine(loaded, EngineConfig(max_model_len=MAX_MODEL_LEN), SchedulerConfig("batched", 4, {}))
    prompt = loaded.tokenizer.encode("The capital of France is")

    def run(params: SamplingParams):
        seq = engine.add_request(prompt, params)
        outputs = []
        while engine.has_work():
            outputs += [o for o in engine.step() if o.seq_id == seq.seq_id]
        return seq, outputs

    free, _ = run(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    text = loaded.tokenizer.decode(free.output_token_ids)
    before = loaded.tokenizer.decode(free.output_token_ids[:7])
    stop = text[len(before):].strip() or text[-2:]
    assert stop and stop not in before, (text, stop)
    seq, outputs = run(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop]))
    assert len(seq.output_token_ids) == 8
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_string == stop
    assert "".join(o.text for o in outputs) == text[:text.rindex(stop)]
