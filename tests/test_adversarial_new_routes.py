"""Hostile requests against the newer routes (Ollama's API, introspection, HEAD probes) on a real server:
each bad input is a 4xx in the route's own error shape that names its field once."""

from __future__ import annotations

import httpx
import pytest

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
