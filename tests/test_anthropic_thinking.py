"""Anthropic ``thinking`` blocks of earlier assistant turns reach the chat template as the
assistant message's ``reasoning_content``, as OpenAI's messages carry it.

On Qwen3's template (llama.cpp's ``models/templates``; it writes an assistant turn's reasoning in
``<think>`` when the turn follows the last user query), an Anthropic conversation with thinking
blocks renders the prompt of the same conversation in OpenAI's shape with ``reasoning_content``:
through the functions the routes use, and over HTTP (``/v1/messages/count_tokens`` against
``/tokenize`` of the OpenAI messages). ``redacted_thinking`` is dropped.
"""

from __future__ import annotations

import json

import httpx
import pytest

from llama_cpp_material import chat_templates, llama_cpp_tree
from quanta.model.loader import embedded_model_path
from quanta.model.tokenizer import Tokenizer
from quanta.server.anthropic.requests import MessagesRequest
from quanta.server.anthropic.tools import chat_messages
from quanta.server.errors import APIError
from quanta.server.openai.requests import Message
from quanta.server.system_turns import prompt_text
from quanta.server.tool_formats.templates import template_input

BASH = {"name": "Bash", "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
TOOLS = [{"type": "function", "function": {"name": "Bash", "description": BASH["description"],
                                           "parameters": BASH["input_schema"]}}]
THOUGHT, SECOND = "The user wants the files; I should run ls.", "Then read a.txt."

ANTHROPIC = [
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": THOUGHT, "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "Running ls."},
        {"type": "thinking", "thinking": SECOND, "signature": "sig2"},
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]},
]
OPENAI = [
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "Running ls.", "reasoning_content": THOUGHT + "\n" + SECOND, "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": json.dumps({"command": "ls"})}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
]


def _qwen3():
    path = next((p for p in chat_templates() if p.stem == "Qwen-Qwen3-0.6B"), None)
    if path is None:
        llama_cpp_tree()  # skips with the reason
        pytest.skip("Qwen-Qwen3-0.6B not in this llama.cpp tree")
    return path


@pytest.fixture
def qwen3_tok(monkeypatch) -> Tokenizer:
    tok = Tokenizer.from_path(embedded_model_path())
    monkeypatch.setattr(tok.hf, "chat_template", _qwen3().read_text())
    return tok


def _anthropic_chat(messages: list[dict]) -> list[dict]:
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": messages, "tools": [BASH]})
    return chat_messages(body.messages, APIError)


def _prompt(tok: Tokenizer, chat: list[dict], tools) -> str:
    return prompt_text(tok, *template_input(tok, chat, tools))


def test_thinking_blocks_are_the_assistant_turns_reasoning():
    chat = _anthropic_chat(ANTHROPIC)
    assert chat[1]["reasoning_content"] == THOUGHT + "\n" + SECOND and "opaque" not in json.dumps(chat)
    no_thoughts = [{**m, "content": [b for b in m["content"] if b["type"] not in ("thinking", "redacted_thinking")]}
                   if m["role"] == "assistant" else m for m in ANTHROPIC]
    assert "reasoning_content" not in _anthropic_chat(no_thoughts)[1]
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": ANTHROPIC})
    assert body.ignored_parts() == ["messages.1.content.1 (redacted_thinking)"]


def test_thinking_renders_as_openai_reasoning_content_on_qwen3(qwen3_tok):
    anthropic = _prompt(qwen3_tok, _anthropic_chat(ANTHROPIC), TOOLS)
    openai = _prompt(qwen3_tok, [Message.model_validate(m).as_dict() for m in OPENAI], TOOLS)
    assert anthropic == openai
    assert f"<think>\n{THOUGHT}\n{SECOND}\n</think>" in anthropic
    without = _prompt(qwen3_tok, [{k: v for k, v in m.items() if k != "reasoning_content"} for m in OPENAI], TOOLS)
    assert THOUGHT not in without


@pytest.fixture(scope="module")
def qwen3_server(launch_server):
    srv = launch_server("--max-model-len", "1024", "--chat-template", str(_qwen3()))
    yield srv
    srv.stop()


def test_count_tokens_counts_the_thinking_as_tokenize_counts_reasoning_content(qwen3_server):
    def post(path: str, body: dict) -> dict:
        r = httpx.post(qwen3_server.base_url + path, json={"model": qwen3_server.model, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    counted = post("/v1/messages/count_tokens", {"messages": ANTHROPIC, "tools": [BASH]})["input_tokens"]
    tokenized = post("/tokenize", {"messages": OPENAI, "tools": TOOLS})
    without = post("/tokenize", {"messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in OPENAI],
                                 "tools": TOOLS})
    assert counted == tokenized["count"] > without["count"]
