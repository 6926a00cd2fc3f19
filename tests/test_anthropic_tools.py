"""Anthropic tool use through the official ``anthropic`` client against the
session server: forced ``tool_use`` blocks, streamed ``input_json_delta``
reassembled, and a ``tool_result`` round trip."""

from __future__ import annotations

import json

import anthropic
import pytest

READ_FILE = {"name": "read_file", "description": "Read a text file",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}},
                              "required": ["path"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "Read the file notes.txt"}]
FORCED = dict(max_tokens=40, extra_body={"temperature": 0}, tools=[READ_FILE],
              tool_choice={"type": "tool", "name": "read_file", "disable_parallel_tool_use": True})


def client_for(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def forced(server):
    return client_for(server).messages.create(model=server.model, messages=ASK, **FORCED)


def test_forced_tool_use_block(forced):
    assert forced.stop_reason == "tool_use"
    (block,) = [b for b in forced.content if b.type == "tool_use"]
    assert block.name == "read_file" and block.id.startswith("toolu_")
    assert set(block.input) == {"path"} and isinstance(block.input["path"], str)


def test_streamed_tool_use_equals_non_streamed(server, forced):
    events = list(client_for(server).messages.create(model=server.model, messages=ASK, stream=True, **FORCED))
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert len(starts) == 1 and starts[0].content_block.name == "read_file"
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    expected = next(b for b in forced.content if b.type == "tool_use")
    assert len(fragments) > 1, fragments  # the input streams as the model writes it
    assert json.loads("".join(fragments)) == expected.input
    assert starts[0].content_block.input == {}
    index = starts[0].index
    assert [e.type for e in events if getattr(e, "index", None) == index][-1] == "content_block_stop"
    assert next(e for e in events if e.type == "message_delta").delta.stop_reason == "tool_use"
    assert events[-1].type == "message_stop"


def test_stream_helper_parses_the_partial_json(server, forced):
    """The anthropic client's accumulator parses each partial_json prefix and ends with the same input."""
    with client_for(server).messages.stream(model=server.model, messages=ASK, **FORCED) as s:
        final = s.get_final_message()
    (block,) = [b for b in final.content if b.type == "tool_use"]
    expected = next(b for b in forced.content if b.type == "tool_use")
    assert (block.name, block.input) == (expected.name, expected.input) and final.stop_reason == "tool_use"


def test_stop_sequence_inside_a_tool_use_is_stop_sequence(server):
    """F2: a stop sequence inside the input ends with stop_reason ``stop_sequence`` (and the sequence), never tool_use."""
    kw = dict(model=server.model, messages=ASK, stop_sequences=["}"], **FORCED)
    msg = client_for(server).messages.create(**kw)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "}") and [b.type for b in msg.content] == ["text"]
    events = list(client_for(server).messages.create(stream=True, **kw))
    delta = next(e for e in events if e.type == "message_delta").delta
    assert (delta.stop_reason, delta.stop_sequence) == ("stop_sequence", "}")
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert partial.startswith("{") and msg.content[0].text.endswith(partial)


def test_tool_result_round_trip(server, forced):
    block = next(b for b in forced.content if b.type == "tool_use")
    client = client_for(server)
    history = ASK + [
        {"role": "assistant", "content": [block.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Meeting at noon."}]},
    ]
    reply = client.messages.create(model=server.model, messages=history, max_tokens=8, extra_body={"temperature": 0},
                                   tools=[READ_FILE], tool_choice={"type": "none"})
    assert reply.content[0].type == "text" and reply.stop_reason in ("end_turn", "max_tokens")
    n_short = client.messages.count_tokens(model=server.model, messages=history, tools=[READ_FILE]).input_tokens
    history[-1]["content"][0]["content"] = [{"type": "text", "text": "Meeting at noon. Bring the quarterly report."}]
    assert client.messages.count_tokens(model=server.model, messages=history, tools=[READ_FILE]).input_tokens > n_short


def test_any_tool_choice_and_auto_text(server):
    client = client_for(server)
    msg = client.messages.create(model=server.model, messages=ASK, max_tokens=40, extra_body={"temperature": 0}, tools=[READ_FILE],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.type for b in msg.content] == ["tool_use"] and msg.stop_reason == "tool_use"
    # auto: whatever the model writes comes back as blocks that add up to its output
    auto = client.messages.create(model=server.model, messages=ASK, max_tokens=12, extra_body={"temperature": 0}, tools=[READ_FILE])
    assert auto.content and all(b.type in ("text", "tool_use") for b in auto.content)
