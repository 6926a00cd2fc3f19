"""Anthropic's Messages API through the official ``anthropic`` client on the
session server (see ``conftest.py``).

Expected texts are derived from the server's own greedy output; the tests
assert invariants: stream == non-stream, usage arithmetic against
count_tokens, stop sequences, event order, cache reads on a growing
conversation, and Anthropic's error body.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]
SYSTEM = "You are a poet who writes only about the ocean."
#: The current client has no sampling arguments (the API dropped them); the
#: server still takes ``temperature`` (default 1.0), so greedy goes in the body.
GREEDY = {"extra_body": {"temperature": 0}}


def client_for(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", timeout=60, max_retries=0)


def count(server, **kw) -> int:
    return client_for(server).messages.count_tokens(model=server.model, **kw).input_tokens


@pytest.fixture(scope="module")
def greedy(server):
    """A greedy non-streaming reply to MESSAGES (24 tokens at most), sent twice.

    The second reply is the reference: it and every repeat after it find the
    prompt cached (all but its last token), so they run the same computation.
    A cold first request computes the last prompt token inside the prompt's
    prefill instead, which in bf16 may round differently and change a later
    greedy token (fp32 equality of reuse vs none: test_prefix_cache.py).
    """
    client = client_for(server)
    client.messages.create(model=server.model, max_tokens=24, messages=MESSAGES, **GREEDY)
    return client.messages.create(model=server.model, max_tokens=24, messages=MESSAGES, **GREEDY)


def test_non_streaming_message_shape_and_usage(server, greedy):
    msg = greedy
    assert msg.type == "message" and msg.role == "assistant" and msg.model == server.model
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text.strip()
    assert msg.stop_reason in {"end_turn", "max_tokens"} and msg.stop_sequence is None
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == count(server, messages=MESSAGES)
    assert u.cache_creation_input_tokens == 0
    assert 1 <= u.output_tokens <= 24
    if msg.stop_reason == "max_tokens":
        assert u.output_tokens == 24


def test_streaming_events_match_non_streaming(server, greedy):
    client = client_for(server)
    events = list(client.messages.create(model=server.model, max_tokens=24, messages=MESSAGES, **GREEDY, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"ping", "content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == greedy.content[0].text
    start, delta = events[0].message, events[-2]
    assert start.content == [] and start.stop_reason is None
    assert delta.delta.stop_reason == greedy.stop_reason
    assert delta.usage.output_tokens == greedy.usage.output_tokens
    assert delta.usage.input_tokens + delta.usage.cache_read_input_tokens == count(server, messages=MESSAGES)
    # message_start goes out before the prompt is computed: the whole prompt as input; message_delta splits off the cache
    assert start.usage.input_tokens == count(server, messages=MESSAGES) and start.usage.cache_read_input_tokens == 0

    with client.messages.stream(model=server.model, max_tokens=24, messages=MESSAGES, **GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == greedy.content[0].text
    assert final.usage.output_tokens == greedy.usage.output_tokens


def test_system_prompt_reaches_the_model(server):
    client = client_for(server)
    short, with_system = count(server, messages=MESSAGES, system="Be brief."), count(server, messages=MESSAGES, system=SYSTEM)
    assert with_system > short
    blocks = [{"type": "text", "text": SYSTEM}]
    assert count(server, messages=MESSAGES, system=blocks) == with_system
    msg = client.messages.create(model=server.model, max_tokens=4, messages=MESSAGES, system=SYSTEM, **GREEDY)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == with_system


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_ends_the_message_before_it(server, greedy, stream):
    text = greedy.content[0].text
    words = text.split()
    assert len(words) >= 3, f"greedy reply too short to pick a stop sequence: {text!r}"
    stop = words[2]
    expected = text[:text.index(stop)]
    client = client_for(server)
    req = dict(model=server.model, max_tokens=24, messages=MESSAGES, **GREEDY, stop_sequences=["@@never@@", stop])
    if stream:
        with client.messages.stream(**req) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**req)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == expected


def test_max_tokens_stops_with_max_tokens(server):
    msg = client_for(server).messages.create(model=server.model, max_tokens=2, messages=MESSAGES, **GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2


def test_second_turn_reads_the_first_from_cache(server, greedy):
    turn2 = MESSAGES + [
        {"role": "assistant", "content": greedy.content[0].text},
        {"role": "user", "content": [{"type": "text", "text": "Now one about mountains.", "cache_control": {"type": "ephemeral"}}]},
    ]
    msg = client_for(server).messages.create(model=server.model, max_tokens=4, messages=turn2, **GREEDY)
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == count(server, messages=turn2)
    assert u.cache_read_input_tokens > count(server, messages=MESSAGES) - 32  # the first prompt's full blocks of 32, at least


def test_final_assistant_message_is_continued(server):
    prefill = "The waves"
    messages = MESSAGES + [{"role": "assistant", "content": prefill}]
    msg = client_for(server).messages.create(model=server.model, max_tokens=6, messages=messages, **GREEDY)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == count(server, messages=messages)
    assert count(server, messages=messages) > count(server, messages=MESSAGES)


# --------------------------------------------------------------------------- errors


def _expect_error(exc_info, status: int, kind: str, fragment: str) -> None:
    err = exc_info.value
    assert err.status_code == status
    assert err.body["type"] == "error"
    assert err.body["error"]["type"] == kind
    assert fragment in err.body["error"]["message"], err.body


@pytest.mark.parametrize("kwargs, fragment", [
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "rm"}}, "'rm', which is not among tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "ls", "input": {}}]}]}, "tool_use"),
    ({"messages": [{"role": "user", "content": [{"type": "image",
                                                 "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "image"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
])
def test_invalid_requests_get_an_anthropic_error(server, kwargs, fragment):
    req = {"model": server.model, "max_tokens": 8, "messages": MESSAGES, **kwargs}
    with pytest.raises(anthropic.BadRequestError) as exc_info:
        client_for(server).messages.create(**req)
    _expect_error(exc_info, 400, "invalid_request_error", fragment)


def test_unknown_model_is_not_found(server):
    with pytest.raises(anthropic.NotFoundError) as exc_info:
        client_for(server).messages.create(model="claude-nonexistent", max_tokens=8, messages=MESSAGES)
    _expect_error(exc_info, 404, "not_found_error", "claude-nonexistent")
    with pytest.raises(anthropic.NotFoundError):
        client_for(server).messages.count_tokens(model="claude-nonexistent", messages=MESSAGES)


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "malformed JSON"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', "max_tokens"),
])
def test_malformed_bodies_get_an_anthropic_error(server, raw, fragment):
    r = httpx.post(server.base_url + "/v1/messages", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert fragment in body["error"]["message"]
