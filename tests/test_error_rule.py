"""One rule for invalid input on every route (issue 12): HTTP 400, never FastAPI's 422,
with OpenAI's error body naming the field in ``param`` (Anthropic's body, the field
named in the message, on ``/v1/messages`` and ``/v1/messages/count_tokens``);
and ``/openapi.json`` states the same rule and the limits the validators enforce.

Raw httpx against the session server: the official clients refuse to send most of these.
"""

from __future__ import annotations

import json

import httpx
import pytest

from quanta.server.protocol import MAX_STOP, MAX_STOP_CHARS

SALT_LIMIT = 1024
ANTHROPIC_ROUTES = ("messages", "messages/count_tokens")

#: route -> a valid body to spoil
VALID = {
    "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "completions": {"prompt": "hi", "max_tokens": 1},
    "responses": {"input": "hi", "max_output_tokens": 16},
    "messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
}
MISSING = object()
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
EARLIER_CALL = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}
HUGE_SEED = b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"1" * 5000 + b"}"

#: (route, id, change to the valid body (field -> value, MISSING drops it) or raw bytes, param, message fragment)
CASES = [
    *[(route, "malformed-json", b'{"model": ', None, "JSON") for route in VALID],
    *[(route, "not-an-object", b"[1, 2]", None, "") for route in VALID],
    *[(route, "empty-body", b"", None, "JSON object") for route in VALID],
    *[(route, "nested-100000-deep", b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply") for route in VALID],
    *[(route, "model-a-number", {"model": 5}, "model", "model") for route in VALID],
    *[(route, "cache-salt-too-long", {"cache_salt": "s" * (SALT_LIMIT + 1)}, "cache_salt", "cache_salt")
      for route in VALID if route != "messages/count_tokens"],
    *[(route, "cache-salt-empty", {"cache_salt": ""}, "cache_salt", "cache_salt")
      for route in VALID if route != "messages/count_tokens"],
    *[(route, "cache-salt-lone-surrogate", {"cache_salt": "a\ud800"}, "cache_salt", "surrogate")
      for route in VALID if route != "messages/count_tokens"],
    ("chat/completions", "content-lone-surrogate", {"messages": [{"role": "user", "content": "a\udc00"}]}, "messages", "surrogate"),
    ("completions", "prompt-lone-surrogate", {"prompt": "a\ud800b"}, "prompt", "surrogate"),
    ("responses", "input-lone-surrogate", {"input": "a\ud800b"}, "input", "surrogate"),
    *[(route, "content-lone-surrogate", {"messages": [{"role": "user", "content": "a\ud800"}]}, None, "surrogate")
      for route in ANTHROPIC_ROUTES],
    ("chat/completions", "messages-missing", {"messages": MISSING}, "messages", "messages"),
    ("chat/completions", "messages-empty", {"messages": []}, "messages", "messages"),
    ("chat/completions", "content-a-number", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "string"),
    ("chat/completions", "content-an-image", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content", "image_url"),
    ("chat/completions", "role-unknown", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "role"),
    ("chat/completions", "max-tokens-digit-string", {"max_tokens": "4"}, "max_tokens", "max_tokens"),
    ("chat/completions", "n-2", {"n": 2}, "n", "n"),
    ("chat/completions", "top-logprobs-string", {"logprobs": True, "top_logprobs": "3"}, "top_logprobs", "top_logprobs"),
    ("chat/completions", "logprobs-string", {"logprobs": "yes"}, "logprobs", "logprobs"),
    ("chat/completions", "parallel-tool-calls-string", {"parallel_tool_calls": "no"}, "parallel_tool_calls", "parallel_tool_calls"),
    ("chat/completions", "tool-choice-without-function", {"tool_choice": {"type": "function"}}, "tool_choice.function", "required"),
    ("chat/completions", "stop-33-strings", {"stop": ["x"] * (MAX_STOP + 1)}, "stop", str(MAX_STOP)),
    ("completions", "prompt-missing", {"prompt": MISSING}, "prompt", "prompt"),
    ("completions", "prompt-empty-text", {"prompt": ""}, "prompt", "at least 1"),
    ("completions", "prompt-no-ids", {"prompt": []}, "prompt", "at least 1"),
    ("completions", "prompt-one-empty-text", {"prompt": [""]}, "prompt.0", "at least 1"),
    ("completions", "prompt-batched", {"prompt": ["a", "b"]}, "prompt", "batched"),
    ("completions", "prompt-booleans", {"prompt": [True]}, "prompt", "boolean"),
    ("completions", "logprobs-6", {"logprobs": 6}, "logprobs", "logprobs"),
    ("completions", "temperature-3", {"temperature": 3}, "temperature", "temperature"),
    ("responses", "input-missing", {"input": MISSING}, "input", "input"),
    ("responses", "input-empty-text", {"input": ""}, "input", "at least 1"),
    ("responses", "input-no-items", {"input": []}, "input", "at least 1"),
    ("responses", "input-item-an-image", {"input": [{"type": "input_image"}]}, "input.0.type", "input_image"),
    ("responses", "max-output-tokens-string", {"max_output_tokens": "4"}, "max_output_tokens", "max_output_tokens"),
    ("responses", "temperature-string", {"temperature": "0.5"}, "temperature", "temperature"),
    ("responses", "stream-string", {"stream": "yes"}, "stream", "stream"),
    ("responses", "previous-response-id", {"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    # found by the schema fuzz (tests/test_request_fuzz.py): a nameless function tool under tool_choice required was a 500
    ("responses", "tool-without-name", {"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0.name", "Field required"),
    ("responses", "hosted-tool-forced", {"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice", "function tools"),
    ("messages", "max-tokens-missing", {"max_tokens": MISSING}, None, "max_tokens"),
    ("messages", "max-tokens-0", {"max_tokens": 0}, None, "max_tokens"),
    ("messages", "temperature-above-1", {"temperature": 1.5}, None, "temperature"),
    ("messages", "top-k-negative", {"top_k": -1}, None, "top_k"),
    ("messages", "stream-string", {"stream": "yes"}, None, "stream"),
    ("messages", "stop-sequence-too-long", {"stop_sequences": ["x" * (MAX_STOP_CHARS + 1)]}, None, "stop_sequences"),
    ("messages", "metadata-salt-too-long", {"metadata": {"cache_salt": "s" * (SALT_LIMIT + 1)}}, None, "metadata.cache_salt"),
    ("messages", "metadata-salt-a-number", {"metadata": {"cache_salt": 1}}, None, "metadata.cache_salt"),
    ("messages", "image-block", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, None, "messages.0.content.0"),
    *[(route, "messages-empty", {"messages": []}, None, "messages") for route in ANTHROPIC_ROUTES],
    *[(route, "messages-missing", {"messages": MISSING}, None, "messages") for route in ANTHROPIC_ROUTES],
    # the typo guard (quanta.server.field_rule): an unknown field one edit from a known one (a typo of
    # max_tokens would fill the context), and values of accepted no-op fields that would need an effect
    *[(route, "max-token-typo", {"max_token": 5}, "max_token", "max_token: unknown field (did you mean max_tokens?)")
      for route in ("chat/completions", "completions")],
    ("messages", "max-token-typo", {"max_token": 5}, None, "max_token: unknown field (did you mean max_tokens?)"),
    ("responses", "max-output-tokens-typo", {"max_output_token": 16}, "max_output_token", "did you mean max_output_tokens?"),
    ("messages/count_tokens", "system-typo", {"sytem": "be brief"}, None, "sytem: unknown field (did you mean system?)"),
    ("chat/completions", "temperature-typo", {"temprature": 0}, "temprature", "did you mean temperature?"),
    *[(route, "store-true", {"store": True}, "store", "nothing is stored") for route in ("chat/completions", "completions", "responses")],
    *[(route, "stream-options-without-stream", {"stream_options": {"include_usage": True}}, "stream_options", "stream: true")
      for route in ("chat/completions", "completions")],
    ("chat/completions", "content-null-on-user", {"messages": [{"role": "user", "content": None}]}, "messages.0.content", "needs content"),
    ("chat/completions", "tool-message-without-id", {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "1"}]},
     "messages.1.tool_call_id", "tool_call_id"),
    ("chat/completions", "arguments-not-json", {"messages": [{"role": "user", "content": "hi"}, EARLIER_CALL,
                                                              {"role": "tool", "tool_call_id": "c1", "content": "1"}]},
     "messages.1.tool_calls.0.function.arguments", "not valid JSON"),
    ("chat/completions", "duplicate-tool-names", {"tools": [TOOL, TOOL]}, "tools.1", "repeated"),
    ("chat/completions", "bad-parameters-schema-under-auto",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "auto"},
     "tools.0.function.parameters", "nonsense"),
    ("chat/completions", "text-part-without-text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content", "needs text"),
    # F4: errors of a known field name it in param
    ("chat/completions", "tool-choice-unknown-function", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "not among tools"),
    ("chat/completions", "tool-choice-required-without-tools", {"tool_choice": "required"}, "tool_choice", "requires tools"),
    ("chat/completions", "top-logprobs-without-logprobs", {"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("chat/completions", "two-constraints", {"tools": [TOOL], "tool_choice": "required", "guided_regex": "a+"},
     "guided_regex", "give one constraint"),
    ("chat/completions", "seed-5000-digits", HUGE_SEED, "seed", "4300 digits"),
    ("chat/completions", "tool-description-lone-surrogate",
     {"tools": [{"type": "function", "function": {"name": "f", "description": "a\ud800"}}]}, "tools.0.function.description", "surrogate"),
    ("chat/completions", "reasoning-effort-unknown", {"reasoning_effort": "extreme"}, "reasoning_effort", "high"),
    ("responses", "max-output-tokens-below-16", {"max_output_tokens": 15}, "max_output_tokens", "16"),
    ("responses", "include-logprobs", {"include": ["message.output_text.logprobs"]}, "include.0", "logprobs"),
    ("responses", "reasoning-unknown-effort", {"reasoning": {"effort": "extreme"}}, "reasoning.effort", "high"),
    ("responses", "reasoning-unknown-key", {"reasoning": {"budget": 5}}, "reasoning.budget", "unknown"),
    ("responses", "truncation-auto", {"truncation": "auto"}, "truncation", "disabled"),
    ("responses", "duplicate-tool-names", {"tools": [RESPONSES_TOOL, RESPONSES_TOOL]}, "tools.1", "repeated"),
    ("responses", "bad-parameters-schema", {"tools": [{**RESPONSES_TOOL, "parameters": {"properties": 5}}]}, "tools.0.parameters",
     "properties"),
    *[(route, "thinking-a-string", {"thinking": "on"}, None, "thinking") for route in ANTHROPIC_ROUTES],
    ("messages", "output-format-not-a-schema", {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     None, "output_config.format"),
    ("messages", "container-given", {"container": "c1"}, None, "container"),
    ("messages", "server-tool-forced", {"tools": [{"type": "web_search_20250305", "name": "web_search"}], "tool_choice": {"type": "any"}},
     None, "tool_choice: requires tools"),
    *[(route, "duplicate-tool-names", {"tools": [ANTHROPIC_TOOL, ANTHROPIC_TOOL]}, None, "tools.1") for route in ANTHROPIC_ROUTES],
    ("messages/count_tokens", "tool-name-with-spaces", {"tools": [{"name": "a b", "input_schema": {}}]}, None, "tools.0.name"),
]


def _body(server, route: str, change) -> bytes | dict:
    if isinstance(change, bytes):
        return change
    body = {"model": server.model, **VALID[route], **change}
    return {k: v for k, v in body.items() if v is not MISSING}


@pytest.mark.parametrize(("route", "case", "change", "param", "fragment"), CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_invalid_input_is_a_400_with_the_route_s_error_body(server, route, case, change, param, fragment):
    body = _body(server, route, change)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # lone surrogates as \u escapes
    resp = httpx.post(f"{server.base_url}/v1/{route}", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    payload = resp.json()
    if route in ANTHROPIC_ROUTES:
        assert set(payload) == {"type", "error"} and payload["type"] == "error", payload
        assert set(payload["error"]) == {"type", "message"}, payload
        assert payload["error"]["type"] == "invalid_request_error"
    else:
        assert set(payload) == {"error"}, payload
        assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
        assert payload["error"]["type"] == "invalid_request_error"
        assert payload["error"]["param"] == param, payload
    message = payload["error"]["message"]
    assert isinstance(message, str) and message and fragment in message, message
    assert "set_int_max_str_digits" not in message  # Python's advice, no use to a client


#: route -> fields official clients and agents send that have no effect here: accepted (200)
NO_EFFECT = {
    "chat/completions": {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "prompt_cache_key": "p",
                         "safety_identifier": "s", "stream_options": None, "reasoning_effort": "low"},
    "completions": {"user": "u", "metadata": {"k": "v"}, "store": None, "service_tier": "default", "prompt_cache_key": "p",
                    "safety_identifier": "s"},
    "responses": {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "prompt_cache_key": "p",
                  "safety_identifier": "s", "include": ["reasoning.encrypted_content"],
                  "reasoning": {"effort": "low", "summary": "auto"}, "truncation": "disabled"},
    "messages": {"metadata": {"user_id": "u"}, "service_tier": "auto", "container": None, "thinking": {"type": "disabled"}},
    "messages/count_tokens": {"thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "low"}},
}


@pytest.mark.parametrize("route", list(NO_EFFECT))
def test_fields_with_no_effect_are_accepted(server, route):
    resp = httpx.post(f"{server.base_url}/v1/{route}", json=_body(server, route, NO_EFFECT[route]), timeout=60)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("route", list(VALID))
def test_every_route_has_cases_and_a_valid_body_passes(server, route):
    """The table covers each route, and each route's base body is itself valid (so a case's 400 is its change)."""
    assert sum(c[0] == route for c in CASES) >= 5
    resp = httpx.post(f"{server.base_url}/v1/{route}", json=_body(server, route, {}), timeout=60)
    assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    return httpx.get(server.base_url + "/openapi.json", timeout=30).json()


def test_openapi_documents_400_with_the_route_s_body_and_never_422(openapi):
    documented = 0
    for path, operations in openapi["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            assert "422" not in responses, (path, responses)
            if "400" in responses:
                ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
                body = "AnthropicError" if path.startswith("/v1/messages") else "OllamaError" if path.startswith("/api/") else "OpenAIError"
                assert ref.endswith(body), (path, ref)
                documented += 1
    assert documented >= len(VALID)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        assert "400" in openapi["paths"][path]["post"]["responses"], path
    schemas = openapi["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert set(schemas["OpenAIError"]["properties"]) == {"error"}
    assert set(schemas["AnthropicError"]["properties"]) == {"type", "error"}
    assert schemas["OllamaError"]["properties"] == {"error": {"title": "Error", "type": "string"}}
    assert "400" in openapi["paths"]["/api/chat"]["post"]["responses"]


def _members(prop: dict) -> list[dict]:
    """A property's schema and its non-null ``anyOf`` members."""
    return [prop, *(m for m in prop.get("anyOf", []) if m.get("type") != "null")]


def _bound(prop: dict, key: str):
    values = [m[key] for m in _members(prop) if key in m]
    assert values, f"no {key} in {prop}"
    return values[0] if len(values) == 1 else values


def test_openapi_states_the_limits_the_validators_enforce(openapi):
    schemas = openapi["components"]["schemas"]
    for name in ("ChatRequest", "CompletionsRequest", "ResponsesRequest", "MessagesRequest", "Metadata"):
        salt = schemas[name]["properties"]["cache_salt"]
        assert _bound(salt, "minLength") == 1 and _bound(salt, "maxLength") == SALT_LIMIT, name
    prompt = schemas["CompletionsRequest"]["properties"]["prompt"]["anyOf"]
    assert [m.get("minLength") or m.get("minItems") for m in prompt] == [1, 1, 1]
    assert prompt[2]["maxItems"] == 1 and prompt[2]["items"]["minLength"] == 1
    assert schemas["ChatRequest"]["properties"]["messages"]["minItems"] == 1
    assert [m.get("minLength") or m.get("minItems") for m in schemas["ResponsesRequest"]["properties"]["input"]["anyOf"]] == [1, 1]
    assert schemas["ResponsesRequest"]["properties"]["previous_response_id"]["type"] == "null"
    assert schemas["FunctionTool"]["properties"]["type"]["enum"] == ["function"]
    assert schemas["ContentPart"]["properties"]["type"]["enum"] == ["text"]
    assert "not supported" in schemas["ChatRequest"]["properties"]["logit_bias"]["description"]
    for name in ("MessagesRequest", "CountTokensRequest"):
        assert schemas[name]["properties"]["messages"]["minItems"] == 1, name
    messages = schemas["MessagesRequest"]["properties"]
    assert messages["max_tokens"]["minimum"] == 1 and messages["max_tokens"]["type"] == "integer"
    assert _bound(messages["temperature"], "minimum") == 0 and _bound(messages["temperature"], "maximum") == 1
    assert _bound(messages["top_p"], "exclusiveMinimum") == 0 and _bound(messages["top_p"], "maximum") == 1
    assert _bound(messages["top_k"], "minimum") == 0
    assert _bound(messages["stop_sequences"], "maxItems") == MAX_STOP
    assert _bound(messages["stop_sequences"], "items")["maxLength"] == MAX_STOP_CHARS
    assert schemas["ContentBlock"]["properties"]["type"]["enum"] == ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    assert schemas["AnthropicTool"]["properties"]["name"]["pattern"]
