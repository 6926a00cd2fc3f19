"""The field rule (:mod:`quanta.server.field_rule`) through the official ``openai``
and ``anthropic`` clients, against the session server (embedded SmolLM2).

The request bodies have the shapes coding agents send (written from the
protocols): Claude Code's streamed ``/v1/messages?beta=true`` with a
mid-conversation system message, ``thinking``, ``output_config`` and
``context_management``; Codex CLI's streamed ``/v1/responses`` with function,
``namespace`` and hosted tools and ``client_metadata``. Documented fields
quanta has no use for are accepted and named in the server log; a typo of a
known field stays a 400 naming the field it resembles; a field no API
documents is accepted and logged. Also: a forced ``tool_choice`` with
``response_format`` on chat, Responses ``ignore_eos``, an ``incomplete``
message item, and non-streamed answers in output order.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from quanta.engine.output import RequestOutput
from quanta.server.access import AccessPolicy, RequestGate
from quanta.server.field_rule import ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_COMPLETIONS, OPENAI_RESPONSES, resembles
from quanta.server.tool_formats.base import HermesParser
from quanta.server.tool_formats.stream import tool_stream

BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"],
                         "additionalProperties": False}}
SHELL = {"type": "function", "name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                        "required": ["command"], "additionalProperties": False}, "strict": False}
CRM = {"type": "namespace", "name": "crm", "description": "Customer records",
       "tools": [{"type": "function", "name": "get_customer", "description": "Look a customer up",
                  "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"],
                                 "additionalProperties": False}}]}


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", timeout=120, max_retries=0)


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=120, max_retries=0)


def marker() -> dict:
    """An undocumented field with a fresh name: its log line identifies the request."""
    return {f"x_trace_{uuid.uuid4().hex[:12]}": 1}


def log_line(server, extra: dict) -> str:
    """The server log's line for the request that sent the :func:`marker` ``extra``."""
    (name,) = extra
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in server.log().splitlines() if name in line]
        if lines:
            assert len(lines) == 1, lines
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(f"no log line names {name}\n{server.log_tail()}")


# --------------------------------------------------------------------------- Claude Code's shapes


def claude_code_request(server, **overrides) -> dict:
    """A Claude Code-style first request: system blocks with cache_control, a user turn, then a system
    message (a reminder) inside messages, tools, adaptive thinking, effort and context management."""
    body = dict(
        model=server.model, max_tokens=24, stream=True, betas=["context-management-2025-06-27"],
        system=[{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
            {"role": "system", "content": "Reminder: be brief."},
        ],
        tools=[BASH], thinking={"type": "adaptive"}, output_config={"effort": "high"},
        context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
        metadata={"user_id": "user_1"},
    )
    return {**body, **overrides}


def test_claude_code_shaped_stream_is_served_and_the_ignored_fields_are_logged(server):
    extra = marker()
    with claude(server).beta.messages.stream(**{k: v for k, v in claude_code_request(server).items() if k != "stream"},
                                             extra_body=extra) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert not any(block.type == "thinking" for block in final.content)
    line = log_line(server, extra)
    assert "POST /v1/messages: no effect here:" in line
    for name in ("context_management", "thinking (adaptive)", "output_config.effort"):
        assert name in line, line
    assert "unknown, ignored: " + next(iter(extra)) in line


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}, {"type": "disabled"}])
def test_thinking_of_every_type_is_accepted_without_thinking_blocks(server, thinking):
    reply = claude(server).messages.create(model=server.model, max_tokens=8, extra_body={"temperature": 0}, thinking=thinking,
                                           messages=[{"role": "user", "content": "Say hi."}])
    assert reply.stop_reason in ("end_turn", "max_tokens") and [b.type for b in reply.content] == ["text"]


def test_a_mid_conversation_system_message_is_a_system_turn(server):
    """SmolLM2's template takes a system turn anywhere: the Anthropic prompt is the chat route's prompt
    for the same turns (counted by count_tokens and chat usage), and longer than without the message."""
    turns = [{"role": "user", "content": "List the files."}, {"role": "system", "content": "Reminder: be brief."}]
    counted = claude(server).messages.count_tokens(model=server.model, messages=turns, thinking={"type": "adaptive"},
                                                   output_config={"effort": "low"})
    without = claude(server).messages.count_tokens(model=server.model, messages=turns[:1])
    chat = openai_client(server).chat.completions.create(model=server.model, messages=turns, max_tokens=1)
    assert counted.input_tokens == chat.usage.prompt_tokens > without.input_tokens


class Verdict(BaseModel):
    ok: bool
    build: Literal["green", "red"]


def test_messages_parse_gets_output_config_format_as_a_json_schema_constraint(server):
    """The SDK's ``messages.parse`` sends ``output_config.format``; the answer parses into the model."""
    parsed = claude(server).messages.parse(model=server.model, max_tokens=40, output_format=Verdict,
                                           messages=[{"role": "user", "content": "Is the build green? Answer in JSON."}])
    assert isinstance(parsed.parsed_output, Verdict), parsed.content
    assert parsed.stop_reason == "end_turn"


def test_a_forced_tool_wins_over_output_config_format(server):
    reply = claude(server).messages.create(
        model=server.model, max_tokens=80, extra_body={"temperature": 0}, tools=[BASH],
        tool_choice={"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
        output_config={"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}},
        messages=[{"role": "user", "content": "List the files."}])
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"]
    assert set(reply.content[0].input) == {"command"}


def test_server_tools_are_accepted_and_never_called(server):
    extra = marker()
    reply = claude(server).messages.create(
        model=server.model, max_tokens=8, extra_body={**extra, "temperature": 0},
        tools=[BASH, {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}],
        messages=[{"role": "user", "content": "Hi."}])
    assert all(b.type != "server_tool_use" for b in reply.content)
    assert "tools.1 (web_search_20250305)" in log_line(server, extra)


def test_a_reasoning_model_s_thinking_blocks_in_history_are_taken(server):
    """A second Claude Code turn after a reasoning model: thinking blocks, text and a call, then its result.
    The thinking block is the turn's reasoning_content (tests/test_anthropic_thinking.py); the redacted one has no effect."""
    extra = marker()
    history = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should run ls.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]},
    ]
    reply = claude(server).messages.create(model=server.model, max_tokens=8, tools=[BASH], messages=history,
                                           extra_body={**extra, "temperature": 0})
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    line = log_line(server, extra)
    assert "messages.1.content.0 (thinking)" not in line and "messages.1.content.1 (redacted_thinking)" in line


def test_anthropic_typo_is_a_400_naming_the_field_it_resembles(server):
    with pytest.raises(anthropic.BadRequestError, match=r"max_token: unknown field \(did you mean max_tokens\?\)"):
        claude(server).messages.create(model=server.model, max_tokens=8, messages=[{"role": "user", "content": "Hi."}],
                                       extra_body={"max_token": 8})


# --------------------------------------------------------------------------- Codex CLI's shapes


def codex_request(server, **overrides) -> dict:
    """A Codex CLI-style request: instructions, a developer message, function, namespace and hosted tools,
    ``store: false``, reasoning, include, prompt_cache_key (``client_metadata`` goes in extra_body)."""
    body = dict(
        model=server.model, instructions="You are Codex, a coding agent.",
        input=[{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}],
        tools=[SHELL, CRM, {"type": "web_search"}], tool_choice="auto", parallel_tool_calls=False, store=False,
        reasoning={"effort": "medium", "summary": "auto"}, include=["reasoning.encrypted_content"],
        prompt_cache_key=str(uuid.uuid4()), max_output_tokens=24, temperature=0,
    )
    return {**body, **overrides}


def test_codex_shaped_stream_is_served_and_the_ignored_fields_are_logged(server):
    extra = {**marker(), "client_metadata": {"x-codex-installation-id": "abc"}}
    events = list(openai_client(server).responses.create(stream=True, extra_body=extra, **codex_request(server)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    line = log_line(server, {k: v for k, v in extra.items() if k.startswith("x_trace")})
    for name in ("client_metadata", "tools.2 (web_search)", "reasoning", "include"):
        assert name in line, line


def test_a_namespaced_call_is_answered_in_the_namespace_s_form(server):
    """Forced, the call is of the namespace's function: ``name`` and ``namespace`` apart, streamed or not;
    the call sent back in input (with its namespace) continues the conversation."""
    client = openai_client(server)
    kw = codex_request(server, tools=[CRM, {"type": "web_search"}], tool_choice="required", max_output_tokens=40)
    full = client.responses.create(**kw)
    (call,) = [item for item in full.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("get_customer", "crm") and set(json.loads(call.arguments)) == {"id"}
    events = list(client.responses.create(stream=True, **kw))
    (done,) = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert (done.name, done.namespace) == ("get_customer", "crm")
    args_done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args_done[0].name == "get_customer"
    history = kw["input"] + [
        {"type": "function_call", "call_id": call.call_id, "name": "get_customer", "namespace": "crm", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Ada Lovelace"},
    ]
    after = client.responses.create(**{**kw, "input": history, "tool_choice": "none", "max_output_tokens": 16})
    assert after.status in ("completed", "incomplete")


def test_responses_ignore_eos_runs_to_max_output_tokens_and_the_cut_message_is_incomplete(server):
    client = openai_client(server)
    kw = dict(model=server.model, input="Say hi.", max_output_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.responses.create(**kw)
    assert full.usage.output_tokens == 16
    assert full.status == "incomplete" and full.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in full.output] == [("message", "incomplete")]
    events = list(client.responses.create(stream=True, **kw))
    final = events[-1]
    assert final.type == "response.incomplete" and [item.status for item in final.response.output] == ["incomplete"]
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete" and done.item.content[0].text == full.output[0].content[0].text


def test_responses_reasoning_items_in_input_are_dropped_and_top_k_is_served(server):
    extra = marker()
    reply = openai_client(server).responses.create(
        model=server.model, max_output_tokens=16, temperature=0, extra_body={**extra, "top_k": 1, "min_p": 0.1},
        input=[{"type": "message", "role": "user", "content": "Hi."},
               {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
               {"type": "message", "role": "user", "content": "Again."}])
    assert reply.status in ("completed", "incomplete")
    line = log_line(server, extra)
    assert "input.1 (reasoning)" in line and "top_k" not in line


def test_responses_typo_is_a_400_and_an_unknown_field_is_logged(server):
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="did you mean max_output_tokens") as err:
        client.responses.create(model=server.model, input="Hi.", extra_body={"max_output_token": 16})
    assert err.value.body["param"] == "max_output_token"
    extra = marker()
    assert client.responses.create(model=server.model, input="Hi.", max_output_tokens=16, extra_body=extra).status
    assert "unknown, ignored: " + next(iter(extra)) in log_line(server, extra)


# --------------------------------------------------------------------------- chat completions


READ_FILE = {"type": "function", "function": {
    "name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                                        "additionalProperties": False}}}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "read_file"}}])
def test_chat_forced_tool_choice_with_response_format_makes_the_call(server, tool_choice):
    reply = openai_client(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Read notes.txt"}], tools=[READ_FILE], tool_choice=tool_choice,
        response_format=ANSWER_FORMAT, parallel_tool_calls=False, max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "read_file" and set(json.loads(call.function.arguments)) == {"path"}


#: a tool whose parameters use ``oneOf`` of object branches (as an agent's first tool does), which
#: llguidance cannot enforce as such: enforced as ``anyOf``
TODO_WRITE = {"type": "function", "function": {
    "name": "todo_write", "description": "Change the todo list",
    "parameters": {"type": "object", "required": ["change"], "additionalProperties": False, "properties": {"change": {
        "oneOf": [{"type": "object", "required": ["clear"], "properties": {"clear": {"type": "boolean"}}},
                  {"type": "object", "required": ["add"], "properties": {"add": {"type": "string", "maxLength": 20}}}]}}}}}


def test_qwen_code_shaped_stream_with_a_one_of_tool_schema_is_served(server):
    """Qwen Code's first request: a system prompt, streamed with usage, tools (one with ``oneOf``) and an
    8,000-token cap past the context's room (clamped). A forced call's arguments take one branch."""
    client = openai_client(server)
    stream = client.chat.completions.create(
        model=server.model, stream=True, stream_options={"include_usage": True}, max_tokens=8000, temperature=0,
        messages=[{"role": "system", "content": "You are Qwen Code, an interactive CLI agent."},
                  {"role": "user", "content": "Plan the work."}], tools=[READ_FILE, TODO_WRITE])
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens <= SESSION_MAX_MODEL_LEN
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    forced = client.chat.completions.create(
        model=server.model, max_tokens=60, temperature=0, messages=[{"role": "user", "content": "Clear the todo list."}],
        tools=[TODO_WRITE], tool_choice={"type": "function", "function": {"name": "todo_write"}}, parallel_tool_calls=False)
    (call,) = forced.choices[0].message.tool_calls
    change = json.loads(call.function.arguments)["change"]
    assert isinstance(change.get("clear"), bool) or isinstance(change.get("add"), str), change


def test_chat_typo_is_a_400_and_documented_or_unknown_fields_are_logged(server):
    client = openai_client(server)
    ask = dict(model=server.model, messages=[{"role": "user", "content": "Hi."}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"max_token: unknown field \(did you mean max_tokens\?\)") as err:
        client.chat.completions.create(**ask, extra_body={"max_token": 5})
    assert err.value.body["param"] == "max_token"
    extra = marker()
    client.chat.completions.create(**ask, extra_body={**extra, "verbosity": "low", "min_tokens": 1})
    line = log_line(server, extra)
    assert "POST /v1/chat/completions: no effect here: verbosity" in line and "min_tokens" in line.split("unknown, ignored:")[1]
    completion_extra = marker()
    client.completions.create(model=server.model, prompt="Hi", max_tokens=1, extra_body=completion_extra)
    assert "POST /v1/completions: unknown, ignored:" in log_line(server, completion_extra)


# --------------------------------------------------------------------------- output caps past the context

SESSION_MAX_MODEL_LEN = 512  # the session server's --max-model-len (conftest)
ROOM = 6  # output tokens the prompts below leave in the context
FAR_TOO_MANY = 32_000  # opencode's and Claude Code's output cap


def _filler(words: int) -> str:
    return "Count on: " + " one" * words


def _fit(measure) -> str:
    """Filler text whose prompt (``measure(text)`` tokens) leaves exactly :data:`ROOM` tokens in the context."""
    target, words = SESSION_MAX_MODEL_LEN - ROOM, 400
    for _ in range(4):
        n = measure(_filler(words))
        if n == target:
            return _filler(words)
        words += target - n
    raise AssertionError(f"no filler gives a {target}-token prompt (last {n})")


def test_chat_and_completions_clamp_max_tokens_to_the_room_left(server):
    """An output cap past the room the prompt leaves is clamped to that room (no 400), streamed or not;
    the answer ends as a length finish at exactly max_model_len tokens."""
    client = openai_client(server)
    ask = lambda text, n, **kw: client.chat.completions.create(  # noqa: E731
        model=server.model, messages=[{"role": "user", "content": text}], max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True}, **kw)
    text = _fit(lambda t: ask(t, 1).usage.prompt_tokens)
    reply = ask(text, FAR_TOO_MANY)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (SESSION_MAX_MODEL_LEN - ROOM, ROOM)
    chunks = list(ask(text, FAR_TOO_MANY, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == ROOM
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    ids = [1000 + i for i in range(SESSION_MAX_MODEL_LEN - ROOM)]
    done = client.completions.create(model=server.model, prompt=ids, max_tokens=FAR_TOO_MANY, extra_body={"ignore_eos": True})
    assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", ROOM)


def test_responses_clamps_max_output_tokens_to_the_room_left(server):
    client = openai_client(server)
    ask = lambda text, n: client.responses.create(  # noqa: E731
        model=server.model, input=text, max_output_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    text = _fit(lambda t: ask(t, 16).usage.input_tokens)  # 16: the least max_output_tokens
    reply = ask(text, FAR_TOO_MANY)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (SESSION_MAX_MODEL_LEN - ROOM, ROOM)
    assert reply.max_output_tokens == FAR_TOO_MANY  # the response echoes what was asked


def test_anthropic_clamps_max_tokens_to_the_room_left(server):
    """Claude Code continues an answer cut by ``max_tokens`` (the answer resent, then larger): where the
    context's end cut it, the stop reason says so, as Anthropic's API does."""
    client = claude(server)
    messages = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    text = _fit(lambda t: client.messages.count_tokens(model=server.model, messages=messages(t)).input_tokens)
    for stream in (False, True):
        if stream:
            with client.messages.stream(model=server.model, max_tokens=FAR_TOO_MANY, extra_body={"temperature": 0},
                                        messages=messages(text)) as s:
                reply = s.get_final_message()
        else:
            reply = client.messages.create(model=server.model, max_tokens=FAR_TOO_MANY, extra_body={"temperature": 0},
                                           messages=messages(text))
        prompt = reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
        assert reply.stop_reason == "model_context_window_exceeded"  # not max_tokens: continuing cannot fit
        assert (prompt, reply.usage.output_tokens) == (SESSION_MAX_MODEL_LEN - ROOM, ROOM)


@pytest.mark.parametrize("words", [SESSION_MAX_MODEL_LEN, 2 * SESSION_MAX_MODEL_LEN])
def test_a_prompt_that_leaves_no_room_is_a_400_naming_the_limit(server, words):
    with pytest.raises(anthropic.BadRequestError, match=f"at most {SESSION_MAX_MODEL_LEN - 1} fit"):
        claude(server).messages.create(model=server.model, max_tokens=1, messages=[{"role": "user", "content": _filler(words)}])
    with pytest.raises(openai.BadRequestError, match=f"at most {SESSION_MAX_MODEL_LEN - 1} fit"):
        openai_client(server).chat.completions.create(model=server.model, max_tokens=1,
                                                      messages=[{"role": "user", "content": _filler(words)}])


def test_claude_code_s_reachability_probe_is_answered_without_a_key(server):
    """``HEAD /api/hello`` (no key) comes before Claude Code's first request: 200, also where keys are set."""
    assert httpx.head(server.base_url + "/api/hello", timeout=30).status_code == 200
    assert httpx.get(server.base_url + "/api/hello", timeout=30).json() == {"status": "ok"}
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    gate = RequestGate(app, AccessPolicy(api_keys=("sk-1",)))
    for path in ("/api/hello", "/v1/models"):
        asyncio.run(gate({"type": "http", "path": path, "method": "HEAD", "headers": []}, None, _ignore))
    assert reached == ["/api/hello"]


async def _ignore(message) -> None:
    pass


# --------------------------------------------------------------------------- the rule itself


def _params(typed_dict) -> set[str]:
    return {k for klass in typed_dict.__mro__ for k in getattr(klass, "__annotations__", {})}


def test_every_field_the_official_clients_send_is_documented_to_the_rule():
    """Each top-level field the installed clients' create params list is declared or documented for its
    route, so none of them is ever a typo 400 or logged as unknown."""
    from anthropic.types import message_count_tokens_params, message_create_params
    from anthropic.types.beta import message_create_params as beta_create
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params

    from quanta.server.anthropic.requests import CountTokensRequest, MessagesRequest
    from quanta.server.openai.requests import ChatRequest, CompletionsRequest
    from quanta.server.responses.requests import ResponsesRequest

    cases = [
        (chat_create_params.CompletionCreateParamsBase, ChatRequest, OPENAI_CHAT),
        (completion_create_params.CompletionCreateParamsBase, CompletionsRequest, OPENAI_COMPLETIONS),
        (response_create_params.ResponseCreateParamsBase, ResponsesRequest, OPENAI_RESPONSES),
        (message_create_params.MessageCreateParamsBase, MessagesRequest, ANTHROPIC_MESSAGES),
        (beta_create.MessageCreateParamsBase, MessagesRequest, ANTHROPIC_MESSAGES),
        (message_count_tokens_params.MessageCountTokensParams, CountTokensRequest, ANTHROPIC_MESSAGES),
    ]
    for params, model, documented in cases:
        missing = _params(params) - set(model.model_fields) - documented
        assert not missing, (model.__name__, missing)


@pytest.mark.parametrize(("name", "near"), [("max_token", "max_tokens"), ("maxTokens", "max_tokens"), ("max-tokens", "max_tokens"),
                                            ("temprature", "temperature"), ("stop_sequence", "stop_sequences"), ("topp", "top_p")])
def test_a_typo_resembles_the_known_field(name, near):
    assert resembles(name, {"max_tokens", "temperature", "stop_sequences", "top_p", "model"}) == near


@pytest.mark.parametrize("name", ["min_tokens", "repetition_penalty", "x_trace", "n1", "chat_template_kwargs"])
def test_a_vendor_extension_is_no_typo(name):
    assert resembles(name, OPENAI_CHAT | {"top_k", "min_p", "ignore_eos", "cache_salt"}) is None


def test_no_engine_extension_is_taken_for_a_typo_on_any_route():
    """Each other engine's field a route does not declare is accepted as unknown on every route, even one
    edit from a known field (``top_k`` on a body with ``top_p`` only)."""
    from quanta.server.anthropic.requests import CountTokensRequest, MessagesRequest
    from quanta.server.field_rule import ENGINE_EXTENSIONS, FieldRule
    from quanta.server.openai.requests import ChatRequest, CompletionsRequest
    from quanta.server.responses.requests import ResponsesRequest

    class TopPOnly(FieldRule):
        top_p: float = 1.0

    message = [{"role": "user", "content": "hi"}]
    bodies = {ChatRequest: {"messages": message}, CompletionsRequest: {"prompt": "hi"}, ResponsesRequest: {"input": "hi"},
              MessagesRequest: {"messages": message, "max_tokens": 1}, CountTokensRequest: {"messages": message}, TopPOnly: {}}
    for model, body in bodies.items():
        extensions = {name: "x" for name in ENGINE_EXTENSIONS - set(model.model_fields)}
        parsed = model.model_validate({"model": "m", **body, **extensions})
        assert set(parsed.unknown_fields()) | set(parsed.ignored_fields()) >= set(extensions), model.__name__


# --------------------------------------------------------------------------- output order, non-streamed as streamed


CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
ORDERS = {"call-then-text": CALL + "\nDone.", "text-then-call": "Let me look.\n" + CALL, "text-call-text": "Look.\n" + CALL + "\nDone."}


async def _outputs(text: str):
    yield RequestOutput(0, [1], text, True, "stop", 5, 4, 0.0, 0.0)


def _streamed_kinds(text: str, on_event, close) -> list:
    stream = tool_stream(HermesParser())
    return [s for e in stream.feed(text) + stream.finish() for s in on_event(e)] + close()


@pytest.mark.parametrize("text", list(ORDERS.values()), ids=list(ORDERS))
def test_non_streamed_anthropic_blocks_keep_the_stream_s_order(text):
    from quanta.server.anthropic.messages import ToolBlocks, _collect

    body = json.loads(asyncio.run(_collect("msg_1", "m", _outputs(text), HermesParser(), 64)).body)
    blocks = ToolBlocks()
    starts = [json.loads(s.split("data: ", 1)[1]) for s in _streamed_kinds(text, blocks.events, blocks.close_text)]
    streamed = [e["content_block"]["type"] for e in starts if e["type"] == "content_block_start"]
    assert [b["type"] for b in body["content"]] == streamed
    texts = [e["delta"]["text"] for e in starts if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"]
    assert "".join(b.get("text", "") for b in body["content"]) == "".join(texts)
    assert body["stop_reason"] == "tool_use"


@pytest.mark.parametrize("text", list(ORDERS.values()), ids=list(ORDERS))
def test_non_streamed_responses_items_keep_the_stream_s_order(text):
    from quanta.server.responses.routes import ResponsesRequest, _Builder, _collect, _Events, _Items

    builder = _Builder(ResponsesRequest(model="m", input="x"), [])
    body = json.loads(asyncio.run(_collect(builder, _outputs(text), HermesParser())).body)
    items = _Items(_Events(), builder)
    _streamed_kinds(text, items.on, items.close)
    assert [o["type"] for o in body["output"]] == [o["type"] for o in items.output]
    assert [o["content"][0]["text"] for o in body["output"] if o["type"] == "message"] == \
        [o["content"][0]["text"] for o in items.output if o["type"] == "message"]
    assert len({o["id"] for o in body["output"]}) == len(body["output"])


# --------------------------------------------------------------------------- a later system message under other templates


#: As Qwen 2.5's and Llama's templates do: a system message after the first turn raises.
REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: A template that writes a system message only first and drops later ones silently.
DROPPING_TEMPLATE = (
    "{% for m in messages %}{% if m.role != 'system' or loop.first %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LATER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."},
         {"role": "system", "content": "Reminder: be brief."}]


@pytest.fixture(scope="module")
def tok():
    from quanta.model.loader import embedded_model_path
    from quanta.model.tokenizer import Tokenizer

    return Tokenizer.from_path(embedded_model_path())


@pytest.mark.parametrize("template", [REFUSING_TEMPLATE, DROPPING_TEMPLATE], ids=["refusing", "dropping"])
@pytest.mark.parametrize("lead", [True, False], ids=["with-system-prompt", "without"])
def test_a_later_system_message_is_folded_into_the_system_prompt_where_the_template_has_no_place(tok, monkeypatch, template, lead):
    from quanta.server.system_turns import place_system_turns, prompt_ids

    monkeypatch.setattr(tok.hf, "chat_template", template)
    messages = LATER if lead else LATER[1:]
    placed = place_system_turns(tok, messages, None)
    expected = "You are terse.\n\nReminder: be brief." if lead else "Reminder: be brief."
    assert placed == [{"role": "system", "content": expected}, {"role": "user", "content": "List the files."}]
    assert "Reminder: be brief." in tok.decode(prompt_ids(tok, messages, None), skip_special_tokens=False)


def test_a_template_that_takes_a_later_system_turn_gets_it_in_place(tok):
    from quanta.server.system_turns import place_system_turns

    assert place_system_turns(tok, LATER, None) == LATER
