"""``POST /tokenize`` and ``/detokenize`` in vLLM's and llama-server's shapes, and the 400 of a prompt
that does not fit ``max_model_len`` naming the field it came from; against the session server (512)."""

from __future__ import annotations

import httpx
import pytest

TEXT = "The capital of France is Paris."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_tokenize_counts_what_the_generation_routes_count(server):
    done = _post(server, "/v1/completions", {"model": server.model, "prompt": TEXT, "max_tokens": 1}).json()
    r = _post(server, "/tokenize", {"model": server.model, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == done["usage"]["prompt_tokens"]
    assert body["max_model_len"] == 512 and body["token_strs"] is None
    chat = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert _post(server, "/tokenize", {"messages": MESSAGES}).json()["count"] == chat["usage"]["prompt_tokens"]


def test_llama_server_shape_and_token_strings(server):
    vllm = _post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    llama = _post(server, "/tokenize", {"content": TEXT, "add_special": False, "with_pieces": False}).json()
    assert llama["tokens"] == vllm["tokens"]
    assert len(vllm["token_strs"]) == vllm["count"] and all(isinstance(s, str) for s in vllm["token_strs"])


def test_detokenize_inverts_tokenize(server):
    ids = _post(server, "/tokenize", {"prompt": TEXT}).json()["tokens"]
    r = _post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT, "content": TEXT}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "a", "content": "b"}, 400, "content"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "tools": []}, 400, "tools"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens.1"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens.0"),
])
def test_bad_requests_name_the_field(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


LONG = "word " * 700  # about 700 tokens, past the session server's max_model_len of 512


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/responses", {"input": LONG}, "input"),
])
def test_a_prompt_that_does_not_fit_is_a_400_naming_its_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "the prompt has" in error["message"], error


def test_anthropic_over_long_prompt_says_so(server):
    r = _post(server, "/v1/messages", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 4})
    assert r.status_code == 400 and "the prompt has" in r.json()["error"]["message"], r.text
