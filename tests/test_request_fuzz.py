"""No request body makes the server answer 5xx, and a storm with cancels and
poisoned requests loses no healthy request.

* A Hypothesis fuzz (a fixed, bounded number of derandomized examples, so CI
  is reproducible) of the four generating routes' bodies: every field drawn
  from its valid values mixed with wrong types, out-of-range numbers,
  ``NaN``/``Infinity``, ``null``, lone surrogates and nesting. Every answer
  is below 500 and carries the route's error body or a complete response.
* The same over bodies drawn from each route's published request schema
  (``/openapi.json``, Anthropic's bodies included): what the schema allows
  is served or refused with a 4xx, never a 5xx.
* A storm of concurrent requests over mixed endpoints (streaming or not),
  some cancelled midway, a few poisoned (:mod:`inprocess_server`): every
  healthy request completes with exact usage, every poisoned one gets an
  error, nothing stays resident, and the finish counters add up.
"""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inprocess_server import CRASH_SEED, POISON_TOP_K, serve_in_process
from quanta.launch import load_model

MAX_MODEL_LEN = 192
FUZZ_EXAMPLES = 15  # per route
SCHEMA_EXAMPLES = 10  # per route, bodies drawn from /openapi.json


@pytest.fixture(scope="module")
def live():
    with serve_in_process(load_model(None, torch.float32), MAX_MODEL_LEN, 2**20, max_num_seqs=4) as server:
        yield server


# ----------------------------------------------------------------------------- fuzz

_odd = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.sampled_from(["a\ud800b", "\udfff", "4", "0.5", "NaN"]),
    st.lists(st.integers(-3, 3), max_size=3), st.just({"nested": [[[]]]}),
)


def _field(valid):
    """Mostly valid values, sometimes anything else."""
    return st.one_of(valid, valid, _odd)


_text = st.one_of(st.text(max_size=30), st.sampled_from(["Hello", "a\ud800b", "<|im_start|>", ""]))
_sampling = {
    "temperature": _field(st.floats(0, 2)), "top_p": _field(st.floats(0.01, 1)), "top_k": _field(st.integers(-1, 50)),
    "min_p": _field(st.floats(0, 1)), "seed": _field(st.integers(-(2**63), 2**63 - 1)),
    "presence_penalty": _field(st.floats(-2, 2)), "frequency_penalty": _field(st.floats(-2, 2)),
    "stream": _field(st.booleans()), "n": _field(st.just(1)), "ignore_eos": _field(st.booleans()),
    "stop": _field(st.one_of(_text, st.lists(_text, max_size=40))),
}
#: never null: chat would then fill the context (a long generation, not a new case)
_max_tokens = st.one_of(st.integers(1, 2), st.integers(1, 2), _odd.filter(lambda v: v is not None))
_openai_message = st.fixed_dictionaries({"role": _field(st.sampled_from(["system", "user", "assistant"])), "content": _field(_text)})
_anthropic_message = st.fixed_dictionaries({
    "role": _field(st.sampled_from(["user", "assistant"])),
    "content": _field(st.one_of(_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=2))),
})

ROUTES = {
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": _field(st.one_of(_text, st.lists(st.integers(-5, 60_000), min_size=1, max_size=20))), "max_tokens": _max_tokens},
        optional=_sampling),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": _field(st.lists(_openai_message, min_size=1, max_size=3)), "max_tokens": _max_tokens}, optional=_sampling),
    "/v1/messages": st.fixed_dictionaries(
        {"messages": _field(st.lists(_anthropic_message, min_size=1, max_size=3)), "max_tokens": _max_tokens},
        optional={"system": _field(_text), "stop_sequences": _field(st.lists(_text, max_size=40)), "stream": _field(st.booleans()),
                  "temperature": _field(st.floats(0, 1)), "top_p": _field(st.floats(0.01, 1)), "top_k": _field(st.integers(0, 50))}),
    "/v1/messages/count_tokens": st.fixed_dictionaries(
        {"messages": _field(st.lists(_anthropic_message, min_size=1, max_size=3))}, optional={"system": _field(_text)}),
}


def _check_answer(path: str, resp: httpx.Response, text: str) -> None:
    assert resp.status_code < 500, text
    if resp.status_code >= 400:
        payload = json.loads(text)
        if path.startswith("/v1/messages"):
            assert payload["type"] == "error" and payload["error"]["message"], payload
        else:
            assert payload["error"]["message"] and payload["error"]["type"], payload
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert 'data: {"error"' not in text and "event: error\n" not in text, text
        last = text.rstrip().rsplit("\n\n", 1)[-1]
        assert last in ("data: [DONE]", 'event: message_stop\ndata: {"type": "message_stop"}') or last.startswith(
            ("event: response.completed\n", "event: response.incomplete\n")), text
    else:
        json.loads(text)


@pytest.mark.parametrize("path", list(ROUTES))
def test_no_body_gets_a_5xx(live, path):
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(body=ROUTES[path])
    def check(body):
        if body.get("top_k") == POISON_TOP_K or body.get("seed") == CRASH_SEED:
            return  # the fault-injection markers
        raw = json.dumps({"model": live.model, **body})  # NaN and Infinity as Python's json writes them
        with httpx.stream("POST", live.base + path, content=raw, headers={"content-type": "application/json"}, timeout=60) as resp:
            text = resp.read().decode("utf-8", errors="replace")
        _check_answer(path, resp, text)

    check()


# ----------------------------------------------------------------------------- fuzz from /openapi.json

#: output caps that are optional (chat, Responses): set small so a body never fills the context
_CAPS = {"/v1/chat/completions": "max_tokens", "/v1/responses": "max_output_tokens"}
SCHEMA_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")


def _from_schema(schema: dict, defs: dict, depth: int = 0):
    """A Hypothesis strategy of JSON values valid for ``schema`` (the subset /openapi.json uses),
    sizes kept small; integers near their minimum, so output caps stay short."""
    if "$ref" in schema:
        return _from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth + 1)
    if "anyOf" in schema:
        return st.one_of([_from_schema(m, defs, depth + 1) for m in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        low = schema.get("minLength", 0)
        return st.one_of(st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", 12), 12))), st.just("<|im_start|>"))
    if kind == "integer":
        low = schema.get("minimum", -3)
        return st.integers(low, min(schema.get("maximum", low + 3), low + 3))
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum", -3.0)), schema.get("maximum", 3.0),
                         exclude_min="exclusiveMinimum" in schema, allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        low = schema.get("minItems", 0)
        high = max(low, min(schema.get("maxItems", 2), 2 if depth < 4 else low))
        return st.lists(_from_schema(schema.get("items", {}), defs, depth + 1), min_size=low, max_size=high)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        if not props:
            return st.dictionaries(st.text(max_size=4), st.integers(0, 3), max_size=2)
        required = set(schema.get("required", []))
        child = lambda name: _from_schema(props[name], defs, depth + 1)  # noqa: E731
        return st.fixed_dictionaries({n: child(n) for n in props if n in required},
                                     optional={} if depth > 5 else {n: child(n) for n in props if n not in required})
    return st.one_of(st.none(), st.integers(0, 3), st.text(max_size=4))  # Any


@pytest.fixture(scope="module")
def openapi(live) -> dict:
    return httpx.get(live.base + "/openapi.json", timeout=30).json()


@pytest.mark.parametrize("path", SCHEMA_ROUTES)
def test_no_body_valid_for_the_published_schema_gets_a_5xx(live, openapi, path):
    """Bodies drawn from the route's own /openapi.json request schema (Anthropic's included):
    each is served or refused with the route's error body, never a 5xx."""
    defs = openapi["components"]["schemas"]
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    @settings(max_examples=SCHEMA_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(body=_from_schema(ref, defs))
    def check(body):
        if body.get("top_k") == POISON_TOP_K or body.get("seed") == CRASH_SEED:
            return
        body["model"] = live.model
        if path in _CAPS and body.get(_CAPS[path]) is None:
            body[_CAPS[path]] = 2
        body.pop("max_completion_tokens", None)
        raw = json.dumps(body)
        with httpx.stream("POST", live.base + path, content=raw, headers={"content-type": "application/json"}, timeout=60) as resp:
            text = resp.read().decode("utf-8", errors="replace")
        _check_answer(path, resp, text)

    check()


# ----------------------------------------------------------------------------- storm

STORM_REQUESTS = 24
STORM_TOKENS = 6


def _storm_request(live, i: int, kind: str, results: dict) -> None:
    rng = random.Random(i)
    stream = rng.random() < 0.6
    poisoned = kind == "poisoned"
    extra = {"top_k": POISON_TOP_K, "temperature": 1.0} if poisoned else {"temperature": 0}
    if i % 3 == 2:
        path = "/v1/messages"
        body = {"max_tokens": STORM_TOKENS, "messages": [{"role": "user", "content": f"Say {i}"}], **extra}
    else:
        path = "/v1/completions" if i % 3 == 0 else "/v1/chat/completions"
        body = {"max_tokens": STORM_TOKENS, "ignore_eos": True, **extra}
        body.update({"prompt": f"Number {i}:"} if i % 3 == 0 else {"messages": [{"role": "user", "content": f"Say {i}"}]})
        if stream:
            body["stream_options"] = {"include_usage": True}
    body.update(model=live.model, stream=stream)
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", live.base + path, json=body) as resp:
            if kind == "cancel":
                for _ in resp.iter_lines():
                    break  # hang up after the first line
                results[i] = ("cancelled", resp.status_code, None)
                return
            text = resp.read().decode()
    results[i] = (kind, resp.status_code, (path, stream, text))


def _usage_of(path: str, stream: bool, text: str) -> int:
    """Completion tokens the response reports."""
    if not stream:
        usage = json.loads(text)["usage"]
        return usage["output_tokens"] if path == "/v1/messages" else usage["completion_tokens"]
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    if path == "/v1/messages":
        return [e for e in events if e["type"] == "message_delta"][-1]["usage"]["output_tokens"]
    return [e for e in events if e.get("usage")][-1]["usage"]["completion_tokens"]


def test_a_storm_with_cancels_and_poisoned_requests_loses_no_healthy_request(live):
    registry = live.state.metrics.registry
    reasons = ("length", "stop", "error", "abort")

    def finished() -> dict[str, float]:
        return {r: registry.get_sample_value("quanta:request_success_total", {"finished_reason": r}) or 0.0 for r in reasons}

    before = finished()
    kinds = ["poisoned" if i in (4, 11, 19) else "cancel" if i % 5 == 3 else "healthy" for i in range(STORM_REQUESTS)]
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=_storm_request, args=(live, i, kind, results), daemon=True) for i, kind in enumerate(kinds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(results) == STORM_REQUESTS, "some storm requests never finished"
    for i, (kind, status, detail) in results.items():
        if kind == "healthy":
            path, stream, text = detail
            assert status == 200, text
            tokens = _usage_of(path, stream, text)
            assert tokens == STORM_TOKENS or (path == "/v1/messages" and 1 <= tokens <= STORM_TOKENS), (i, text)
            assert '"error"' not in text
        elif kind == "poisoned":
            path, stream, text = detail
            assert (status == 500) if not stream else (status == 200 and "error id" in text), (i, status, text)
            assert "error id" in text and "Overflow" not in text
    engine = live.state.async_engine
    for _ in range(100):  # aborts of hung-up clients reach the engine thread shortly after
        if engine.num_running == 0 and engine.num_waiting == 0 and sum(finished().values()) - sum(before.values()) == STORM_REQUESTS:
            break
        threading.Event().wait(0.1)
    after = finished()
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert sum(after.values()) - sum(before.values()) == STORM_REQUESTS, (before, after)
    assert after["error"] - before["error"] == kinds.count("poisoned")
    assert httpx.get(live.base + "/health", timeout=10).status_code == 200
