"""Ollama's API (``/api/*``) through the official ``ollama`` Python client against the
session server (the embedded SmolLM2, ``--max-model-len 512``; see ``conftest.py``).

Expected texts come from the server's own greedy output on its OpenAI routes:
the Ollama route must give the same tokens for the same prompt and settings
(so ``options`` are mapped), streamed and not. Tool calls are forced with
quanta's ``options.tool_choice`` and sent with plain HTTP: the client's
``Tool`` model drops ``additionalProperties`` and ``maxLength`` from a schema,
which a forced call needs to end; the answer is read back with the client's
own ``ChatResponse``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import ollama
import pytest
import torch

from inprocess_server import POISON_TOP_K, serve_in_process
from quanta.engine.output import RequestOutput
from quanta.launch import load_model
from quanta.server.access import AccessPolicy, RequestGate
from quanta.server.app import GENERATION_PATHS
from quanta.server.ollama.shapes import Shape
from quanta.server.tool_formats.base import HermesParser
from quanta.server.tool_formats.reasoning import REASONING
from quanta.server.tool_formats.registry import output_parser

GREEDY = {"temperature": 0, "num_predict": 12}
ASK = [{"role": "user", "content": "Write a haiku about the sea."}]
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a text file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}},
                   "required": ["path"], "additionalProperties": False}}}
READ_ASK = [{"role": "user", "content": "Read the file notes.txt"}]
STATS = ("total_duration", "prompt_eval_duration", "eval_duration", "prompt_eval_count", "eval_count")


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


@pytest.fixture(scope="module")
def name(server) -> str:
    return server.model + ":latest"


@pytest.fixture(scope="module")
def greedy(client, name) -> ollama.ChatResponse:
    """A greedy answer to ASK, sent twice: the second finds its prompt cached, as every later repeat does."""
    client.chat(model=name, messages=ASK, options=GREEDY)
    return client.chat(model=name, messages=ASK, options=GREEDY)


def _openai_chat(server, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120).json()


def _check_stats(final) -> None:
    assert final.done is True and final.done_reason in ("stop", "length")
    assert all(isinstance(final[k], int) and final[k] > 0 for k in STATS), final
    assert final.total_duration >= final.eval_duration and final.load_duration == 0


def test_chat_answers_as_the_openai_route_does(server, greedy):
    reference = _openai_chat(server, ASK, 12)
    assert greedy.message.role == "assistant" and greedy.message.content == reference["choices"][0]["message"]["content"]
    assert greedy.prompt_eval_count == reference["usage"]["prompt_tokens"]
    assert greedy.eval_count == reference["usage"]["completion_tokens"]
    _check_stats(greedy)
    assert greedy.done_reason == {"length": "length", "stop": "stop"}[reference["choices"][0]["finish_reason"]]


def test_streamed_chat_equals_non_streamed(client, name, greedy):
    parts = list(client.chat(model=name, messages=ASK, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert "".join(p.message.content for p in parts) == greedy.message.content
    assert parts[-1].message.content == "" and parts[-1].eval_count == greedy.eval_count
    _check_stats(parts[-1])


def test_generate_raw_and_templated(server, client, name):
    raw = client.generate(model=name, prompt="The capital of France is", raw=True, options={"temperature": 0, "num_predict": 8})
    body = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    reference = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).json()
    assert raw.response == reference["choices"][0]["text"] and raw.prompt_eval_count == reference["usage"]["prompt_tokens"]
    assert len(raw.context) == raw.prompt_eval_count + raw.eval_count  # the prompt's ids, then the output's
    _check_stats(raw)
    templated = client.generate(model=name, prompt="Say hi.", system="Be brief.", options={"temperature": 0, "num_predict": 6})
    chat = _openai_chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}], 6)
    assert templated.response == chat["choices"][0]["message"]["content"]
    assert templated.prompt_eval_count == chat["usage"]["prompt_tokens"]


def test_streamed_generate_equals_non_streamed(client, name):
    kw = dict(model=name, prompt="Count: one, two,", raw=True, options={"temperature": 0, "num_predict": 10})
    whole = client.generate(**kw)
    parts = list(client.generate(stream=True, **kw))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done and not parts[0].done
    assert parts[-1].context == whole.context and parts[-1].eval_count == whole.eval_count


def test_options_stop_seed_num_predict(client, name, greedy):
    text = greedy.message.content
    word = text.split()[1]
    stopped = client.chat(model=name, messages=ASK, options={**GREEDY, "stop": [word]})
    assert stopped.done_reason == "stop" and stopped.message.content == text[:text.index(word)]
    sampled = [client.chat(model=name, messages=ASK, options={"temperature": 1.0, "seed": 7, "num_predict": 8}).message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]
    short = client.chat(model=name, messages=ASK, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    wide = client.chat(model=name, messages=ASK, options={**GREEDY, "num_ctx": 100_000}, keep_alive="5m")
    assert wide.message.content == text  # num_ctx above max_model_len is clamped to it


def test_forced_tool_call_and_round_trip(server, client, name):
    body = {"model": name, "messages": READ_ASK, "tools": [READ_FILE], "stream": False,
            "options": {"temperature": 0, "num_predict": 40, "tool_choice": "read_file"}}
    reply = ollama.ChatResponse(**httpx.post(server.base_url + "/api/chat", json=body, timeout=120).json())
    (call,) = reply.message.tool_calls
    assert call.function.name == "read_file" and set(call.function.arguments) == {"path"}
    assert isinstance(call.function.arguments["path"], str) and reply.done_reason == "stop"
    with httpx.stream("POST", server.base_url + "/api/chat", json={**body, "stream": True}, timeout=120) as resp:
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(text) for text in resp.iter_lines()]
    calls = [c for part in lines for c in part["message"].get("tool_calls", [])]
    assert [c["function"] for c in calls] == [{"index": 0, "name": "read_file", "arguments": call.function.arguments}]
    assert lines[-1]["done"] and not any(part["done"] for part in lines[:-1])

    def answered(result: str) -> ollama.ChatResponse:
        history = READ_ASK + [reply.message, {"role": "tool", "content": result, "tool_name": "read_file"}]
        return client.chat(model=name, messages=history, tools=[READ_FILE], options={"temperature": 0, "num_predict": 4})
    short, long = answered("Meeting at noon."), answered("Meeting at noon. Bring the quarterly report and the slides.")
    assert short.message.role == "assistant" and long.prompt_eval_count > short.prompt_eval_count


def test_format_schema_and_json(client, name):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    reply = client.chat(model=name, messages=[{"role": "user", "content": "Name a city."}], format=schema,
                        options={"temperature": 0, "num_predict": 30})
    assert set(json.loads(reply.message.content)) == {"city"} and reply.done_reason == "stop"
    reply = client.generate(model=name, prompt="Give a JSON object.", format="json", options={"temperature": 0, "num_predict": 6})
    assert reply.response.lstrip().startswith("{")


def test_tags_show_ps_version(server, client, name):
    (listed,) = [m for m in client.list().models if m.model == name]
    assert listed.size > 0 and len(listed.digest) == 64 and listed.details.family == "llama"
    shown = client.show(name)
    assert client.show(server.model).modelinfo == shown.modelinfo  # with or without the tag
    assert shown.modelinfo["llama.context_length"] == 512 and shown.modelinfo["general.parameter_count"] > 100e6
    assert {"completion", "tools"} <= set(shown.capabilities) and "<|im_start|>" in shown.template
    (running,) = client.ps().models
    assert running.model == name and running.context_length == 512 and running.size == listed.size
    assert httpx.get(server.base_url + "/api/version", timeout=30).json()["version"].count(".") == 2


def test_nothing_to_generate_loads(client, name):
    assert client.chat(model=name, messages=[]).done_reason == "load"
    assert client.generate(model=name, prompt="").done_reason == "load"


@pytest.mark.parametrize("call", ["embed", "embeddings"])
def test_embeddings_are_501(client, name, call):
    with pytest.raises(ollama.ResponseError) as info:
        getattr(client, call)(name, "some text")
    assert info.value.status_code == 501 and "embeddings are not supported" in info.value.error


@pytest.mark.parametrize("kw, field", [
    (dict(messages=ASK, options={"temprature": 0}), "options.temprature"),
    (dict(messages=[{"role": "user", "content": "x", "images": ["aGVsbG8="]}]), "messages.0.images"),
    (dict(messages=ASK, think=True), "think"),
    (dict(messages=ASK, options={"num_ctx": 4}), "options.num_ctx"),
    (dict(messages=ASK, options={"tool_choice": "required"}), "options.tool_choice"),
])
def test_bad_chat_field_is_400_naming_it(client, name, kw, field):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=name, **kw)
    assert info.value.status_code == 400 and info.value.error.startswith(field + ":"), info.value.error


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": "x", "format": "xml"}, "format"),
    ({"prompt": "x", "template": "{{ .Prompt }}"}, "template"), ({"prompt": "x", "raw": True, "system": "s"}, "system"),
    ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "context": [10**9]}, "context"),
])
def test_bad_generate_field_is_400_in_ollamas_shape(server, name, body, field):
    resp = httpx.post(server.base_url + "/api/generate", json={"model": name, **body}, timeout=30)
    assert resp.status_code == 400 and list(resp.json()) == ["error"] and resp.json()["error"].startswith(field + ":")


def test_unknown_model_is_404(server, client):
    for call in (lambda: client.chat(model="nope:7b", messages=ASK), lambda: client.generate(model="nope", prompt="x"),
                 lambda: client.show("nope")):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 404 and "'nope" in info.value.error and server.model in info.value.error


def _gate(path: str, headers: list) -> list:
    sent = []

    async def app(scope, receive, send):
        sent.append("app")

    async def send(message):
        sent.append(message.get("status") or json.loads(message.get("body", b"{}") or b"{}"))

    scope = {"type": "http", "path": path, "method": "GET", "headers": headers}
    asyncio.run(RequestGate(app, AccessPolicy(api_keys=("k1",)))(scope, None, send))
    return sent


def test_generation_routes_take_the_api_key_and_hold_a_queue_place():
    assert {"/api/chat", "/api/generate"} <= GENERATION_PATHS
    status, body = _gate("/api/chat", [])
    assert status == 401 and list(body) == ["error"]
    assert _gate("/api/chat", [(b"authorization", b"Bearer k1")]) == ["app"]
    assert _gate("/api/version", []) == ["app"]  # a reachability probe, as /health


def _outputs(pieces: list[str]) -> list[RequestOutput]:
    """The engine's outputs of one request writing ``pieces``, one a step (the clock in seconds)."""
    return [RequestOutput(0, [i], text, i == len(pieces) - 1, "stop" if i == len(pieces) - 1 else None, 5, i + 1,
                          time=10.0 + i, arrival_time=9.5) for i, text in enumerate(pieces)]


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("chat", [True, False])
def test_reasoning_is_thinking_streamed_and_not(chat, keep):
    """A reasoning model's ``<think>`` block (the embedded model writes none) is ``thinking``; ``think: false`` drops it."""
    pieces = ["<think>", "plan the", " answer", "</think>", "The answer", "."]
    parser = output_parser(HermesParser(), REASONING["deepseek_r1"], with_tools=chat)
    shape = Shape("m", chat, parser, keep, None, started=9.0)
    chunks = [c for c in (shape.chunk(out, None) for out in _outputs(pieces)) if c is not None]
    text = [c["message"] if chat else c for c in chunks]
    assert "".join(t.get("thinking", "") for t in text) == ("plan the answer" if keep else "")
    assert "".join(t["content" if chat else "response"] for t in text) == "The answer."
    final = shape.final(_outputs(pieces)[-1])
    assert final["prompt_eval_duration"] == 500_000_000 and final["eval_duration"] == 5_000_000_000
    whole = Shape("m", chat, parser, keep, None, started=9.0).full("".join(pieces), _outputs(pieces)[-1], None)
    answer = whole["message"] if chat else whole
    assert answer.get("thinking") == ("plan the answer" if keep else None)
    assert answer["content" if chat else "response"] == "The answer." and whole["done"]


@pytest.fixture(scope="module")
def poisoning():
    """An in-process server whose engine fails a request with ``top_k == POISON_TOP_K`` inside a step."""
    with serve_in_process(load_model(None, torch.float32), 256, 2**20, max_num_seqs=2) as live:
        yield live


def test_a_failure_inside_a_step_is_ollamas_error(poisoning):
    body = {"model": poisoning.model, "prompt": "Hi", "options": {"top_k": POISON_TOP_K, "num_predict": 4}}
    whole = httpx.post(poisoning.base + "/api/generate", json={**body, "stream": False}, timeout=60)
    assert whole.status_code == 500 and list(whole.json()) == ["error"] and "error id" in whole.json()["error"]
    with httpx.stream("POST", poisoning.base + "/api/generate", json=body, timeout=60) as resp:  # streamed by default
        status, lines = resp.status_code, [json.loads(text) for text in resp.iter_lines()]
    assert status == 200 and list(lines[-1]) == ["error"] and "error id" in lines[-1]["error"]
    with pytest.raises(ollama.ResponseError):  # the client raises on that line
        list(ollama.Client(host=poisoning.base, timeout=60).generate(stream=True, **body))
    healthy = ollama.Client(host=poisoning.base, timeout=60).generate(model=poisoning.model, prompt="Hi", options={"num_predict": 2})
    assert healthy.done and healthy.eval_count == 2
