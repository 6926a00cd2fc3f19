"""Hostile requests against the newer routes (Ollama's API, introspection, HEAD probes) on a real server:
each bad input is a 4xx in the route's own error shape that names its field once."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import httpx
import llguidance
import pytest

from quanta.engine.grammar import GrammarCompiler
from quanta.engine.kv_budget import KVBudgetError, num_blocks
from quanta.model.loader import embedded_model_path
from quanta.model.tokenizer import Tokenizer
from quanta.server.anthropic.messages import request_grammar as messages_grammar
from quanta.server.anthropic.requests import MessagesRequest
from quanta.server.errors import APIError
from quanta.server.ollama.generation import _format_grammar
from quanta.server.ollama.models import resolve
from quanta.server.ollama.requests import GenerateBody
from quanta.server.openai.chat import _request_grammar as chat_grammar
from quanta.server.openai.requests import ChatRequest
from quanta.server.responses.requests import ResponsesRequest
from quanta.server.responses.requests import request_grammar as responses_grammar
from quanta.server.tool_formats.reasoning import REASONING
from quanta.server.tool_formats.registry import TOOL_PARSERS, request_parser

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "hi"}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": server.model, **body}, timeout=60)


def _message(path: str, payload: dict) -> str:
    if path.startswith("/api/"):
        return payload["error"]
    return payload["error"]["message"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": USER, "tools": [TOOL, TOOL]}, "tools.1"),
    ("/api/chat", {"messages": USER, "tools": [TOOL, TOOL], "stream": False}, "tools.1"),
    ("/v1/messages", {"messages": USER, "max_tokens": 4, "tools": [{"name": "f", "input_schema": {"type": "object"}}] * 2},
     "tools.1"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f"}] * 2}, "tools.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
])
def test_a_refusal_names_its_field_once(server, path, body, field):
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text
    message = _message(path, resp.json())
    assert message.startswith(f"{field}: ") and message.count(field) == 1, message


@pytest.mark.parametrize("path", ["/api/tags", "/api/ps", "/api/version", "/version", "/v1/models", "/props", "/slots",
                                  "/metrics", "/v1/config", "/v1/trace?limit=1", "/v1/models/{model}", "/v1/models/nope"])
def test_head_answers_as_get_without_a_body(server, path):
    url = server.base_url + path.format(model=server.model)
    got, head = httpx.get(url, timeout=30), httpx.head(url, timeout=30)
    assert head.status_code == got.status_code, (path, head.status_code)
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]


def test_head_is_not_in_the_schema(server):
    paths = httpx.get(server.base_url + "/openapi.json", timeout=30).json()["paths"]
    assert not [p for p, methods in paths.items() if "head" in methods]


def test_a_kv_pool_beyond_the_memory_limit_is_refused():
    # 1000-byte blocks of 32 tokens; 4 sequences of 100 tokens need 16 blocks (16,000 bytes)
    assert num_blocks(1000, 32, 100, 4, memory_limit=40_000) == 16
    assert num_blocks(1000, 32, 100, 4, memory_limit=20_000) == 10  # the default pool: half the limit
    with pytest.raises(KVBudgetError, match="--kv-cache-tokens 3200 needs 97.7 KiB of KV cache, more than"):
        num_blocks(1000, 32, 100, 4, tokens=3200, memory_limit=50_000)
    with pytest.raises(KVBudgetError, match="one sequence of --max-model-len 10000 needs 305.7 KiB"):
        num_blocks(1000, 32, 10_000, 4, memory_limit=50_000)
    assert num_blocks(1000, 32, 100, 4, tokens=3200) == 100  # no limit: a simulated machine's pool


@pytest.mark.parametrize("flags", [["--max-model-len", str(10**13)], ["--kv-cache-tokens", str(10**12)]])
def test_serve_with_a_kv_cache_beyond_memory_is_one_line_before_the_load(flags):
    proc = subprocess.run([sys.executable, "-m", "quanta.cli", "serve", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "more than this machine's memory" in proc.stderr and flags[0] in proc.stderr
    assert "Traceback" not in proc.stderr and "loaded" not in proc.stderr


@pytest.mark.parametrize(("asked", "served"), [("m", "m:latest"), ("m:latest", "m:latest"), ("org/x", "org/x"),
                                               ("org/x:latest", "org/x"), ("host:5000/y:7b", "host:5000/y:7b")])
def test_an_ollama_name_without_a_tag_is_its_latest(asked, served):
    state = SimpleNamespace(model_names=["m:latest", "org/x", "host:5000/y:7b"])
    assert resolve(state, asked) == served


@pytest.mark.parametrize("asked", ["m:v2", "org/x:v1", "host:5000/y", "../m", ""])
def test_an_ollama_name_not_served_is_a_404(asked):
    with pytest.raises(APIError) as info:
        resolve(SimpleNamespace(model_names=["m:latest", "org/x", "host:5000/y:7b"]), asked)
    assert info.value.status == 404


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/api/chat", {"messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(600))}]}, "messages"),
    ("/api/generate", {"prompt": " ".join(f"w{i}" for i in range(600))}, "prompt"),
    ("/api/generate", {"prompt": " ".join(f"w{i}" for i in range(600)), "raw": True}, "prompt"),
])
def test_an_ollama_prompt_too_long_names_its_field(server, path, body, field):
    resp = _post(server, path, {**body, "stream": True})
    assert resp.status_code == 400 and list(resp.json()) == ["error"], resp.text
    assert resp.json()["error"].startswith(f"{field}: the prompt has "), resp.text


def _accepts(compiler: GrammarCompiler, tok: Tokenizer, grammar, text: str) -> bool:
    matcher = llguidance.LLMatcher(compiler._tokenizer(), llguidance.LLMatcher.grammar_from_lark(grammar.lark), log_level=0)
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting() and not matcher.is_error()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat_format(state, prompt):
    body = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    return chat_grammar(state, body, prompt)[0]


def _messages_format(state, prompt):
    body = MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}],
                           output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    return messages_grammar(state, body, prompt)[0]


def _responses_format(state, prompt):
    body = ResponsesRequest(model="m", input="x", text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}})
    return responses_grammar(state, body, [], prompt)[0]


@pytest.mark.parametrize("route", [_chat_format, _messages_format, _responses_format])
@pytest.mark.parametrize("opened", [True, False])
def test_a_response_format_is_the_answer_after_the_reasoning(route, opened):
    """chat ``response_format``, Anthropic ``output_config.format``, Responses ``text.format``: on a
    model that reasons first, the JSON is forced after the reasoning, not from the first token."""
    tok = Tokenizer.from_path(embedded_model_path())
    state = SimpleNamespace(tokenizer=tok, reasoning=REASONING["qwen3"], tool_parser=TOOL_PARSERS["hermes"]())
    prompt = tok.encode("<|im_start|>assistant\n" + ("<think>\n" if opened else ""), add_special_tokens=False)
    grammar, compiler = route(state, prompt), GrammarCompiler(tok.hf, tok.eos_token_ids)
    thought, answer = ("" if opened else "<think>") + "An object with a.\n</think>\n\n", '{"a":1}'
    assert _accepts(compiler, tok, grammar, thought + answer)
    assert _accepts(compiler, tok, grammar, answer) is not opened
    assert not _accepts(compiler, tok, grammar, thought + '{"b":1}')


def test_a_response_format_without_reasoning_is_json_from_the_first_token():
    tok = Tokenizer.from_path(embedded_model_path())
    state = SimpleNamespace(tokenizer=tok, reasoning=None, tool_parser=TOOL_PARSERS["hermes"]())
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    compiler = GrammarCompiler(tok.hf, tok.eos_token_ids)
    for route in (_chat_format, _messages_format, _responses_format):
        grammar = route(state, prompt)
        assert _accepts(compiler, tok, grammar, '{"a":1}') and not _accepts(compiler, tok, grammar, "<think>x</think>{\"a\":1}")


@pytest.mark.parametrize("opened", [True, False])
def test_ollama_format_is_the_answer_after_the_reasoning(opened):
    tok = Tokenizer.from_path(embedded_model_path())
    state = SimpleNamespace(tokenizer=tok, reasoning=REASONING["qwen3"], tool_parser=TOOL_PARSERS["hermes"]())
    prompt = tok.encode("<|im_start|>assistant\n" + ("<think>\n" if opened else ""), add_special_tokens=False)
    body = GenerateBody(model="m", prompt="x", format={"type": "object", "properties": {"a": {"type": "integer"}},
                                                       "required": ["a"]})
    grammar, compiler = _format_grammar(state, body, prompt), GrammarCompiler(tok.hf, tok.eos_token_ids)
    thought, answer = ("" if opened else "<think>") + "An object with a.\n</think>\n\n", '{"a":1}'  # the grammar's JSON is compact
    assert _accepts(compiler, tok, grammar, thought + answer)
    assert _accepts(compiler, tok, grammar, answer) is not opened  # opened: the reasoning ends first
    assert not _accepts(compiler, tok, grammar, thought + "Sure.")
    parsed = request_parser(state, False, prompt).parse(thought + answer)
    assert parsed.content == answer and parsed.reasoning == "An object with a."


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/chat"])
def test_a_404_for_a_huge_model_name_does_not_echo_it(server, path):
    body = {"model": "m" * 100_000, "messages": USER, "max_tokens": 4, "stream": False}
    resp = httpx.post(server.base_url + path, json=body, timeout=60)
    message = _message(path, resp.json())
    assert resp.status_code == 404 and len(message) < 400 and "100,000 characters" in message, message
    assert message.startswith("model "), message  # the field, also where the body has no param


def test_an_anthropic_error_names_its_field_in_the_message(server):
    """Anthropic's error body has no ``param``: the message leads with the field (a prompt too long: ``messages``)."""
    long = [{"role": "user", "content": " ".join(f"w{i}" for i in range(3000))}]
    resp = _post(server, "/v1/messages", {"max_tokens": 8, "messages": long})
    assert resp.status_code == 400 and resp.json()["type"] == "error", resp.text
    assert resp.json()["error"]["message"].startswith("messages: the prompt has "), resp.text


def test_an_anthropic_schema_error_is_one_sentence_naming_its_field(server):
    body = {"max_tokens": 8, "messages": USER, "output_config": {"format": {"type": "json_schema", "schema": {"type": "strin"}}}}
    resp = _post(server, "/v1/messages", body)
    assert resp.status_code == 400 and resp.json()["type"] == "error", resp.text
    message = resp.json()["error"]["message"]
    assert message.startswith("output_config.format: ") and "Invalid type: strin" in message and "\n" not in message, message


@pytest.mark.parametrize(("path", "field", "named"), [
    ("/v1/responses", "max_tokens", "max_output_tokens"),
    ("/v1/responses", "response_format", "text.format"),
    ("/v1/messages", "stop", "stop_sequences"),
    ("/v1/messages", "max_completion_tokens", "max_tokens"),
])
def test_another_protocols_name_for_a_field_is_a_400_naming_this_ones(server, path, field, named):
    """The request would otherwise run ignoring it (a Responses request with max_tokens ran to the default cap)."""
    body = {"input": "hi"} if path == "/v1/responses" else {"messages": USER, "max_tokens": 4}
    resp = _post(server, path, {**body, field: 16 if "tokens" in field else ["x"] if field == "stop" else {"type": "text"}})
    assert resp.status_code == 400, resp.text
    message = _message(path, resp.json())
    assert message.startswith(f"{field}: ") and named in message, message
