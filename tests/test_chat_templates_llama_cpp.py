"""llama.cpp's 70 real chat templates (``models/templates/*.jinja``) through quanta's chat path,
against transformers' ``apply_chat_template`` (the pinned version).

Each template is put on the embedded SmolLM2 tokenizer (``*-tool_use`` files as the ``tool_use``
variant of a dict beside a ChatML ``default``, as Hermes ships them) and five conversations in
OpenAI's shape (system prompt, two JSON-schema tools, an assistant call with arguments, its result,
a reasoning turn, several turns) go the way the chat route takes them: ``Message.as_dict``,
:func:`template_input`, :func:`prompt_text` / :func:`prompt_ids`. The expected text is transformers'
rendering of the same conversation in Hugging Face's shape (arguments as objects, a call's null
content as ``""``), written out here. Either quanta's text equals it (and the prompt ids decode
back to it), or transformers raises too and quanta raises :class:`TemplateRejected` naming the
template and the message it cannot take (the route's 400). Templates that do not read ``tools``
(:data:`HERMES_TEXT`) get quanta's Hermes tool prompt instead: their text must equal transformers'
rendering of that rewritten conversation and hold the tools and the call; those that take a
call's arguments only as JSON text (:data:`STRING_ARGUMENTS`) get them so. ``strftime_now`` is
pinned to one date.
"""

from __future__ import annotations

import datetime
import json
import re

import httpx
import pytest
import torch
import transformers.utils.chat_template_utils as chat_template_utils

from llama_cpp_material import chat_templates, llama_cpp_tree
from quanta.model.loader import embedded_model_path
from quanta.model.tokenizer import Tokenizer
from quanta.server.chat_render import TemplateRejected, request_template
from quanta.server.openai.requests import Message
from quanta.server.system_turns import prompt_ids, prompt_text
from quanta.server.tool_formats.templates import needs_hermes_text, render_for_template, template_input

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer"}}, "required": ["query"]}}},
]
SYSTEM = {"role": "system", "content": "You are a careful assistant."}
ASK = {"role": "user", "content": "What's the weather in Paris?"}
# a 9-character alphanumeric id: Mistral's templates refuse any other
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "call12345", "type": "function", "function": {
    "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]}
RESULT = {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temp": 21, "sky": "clear"}'}
CONVERSATIONS = {
    "multi_turn": ([SYSTEM, {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"},
                    {"role": "user", "content": "Tell me a joke."}], None),
    "tools": ([SYSTEM, ASK], TOOLS),
    "tool_call": ([SYSTEM, ASK, CALL, RESULT], TOOLS),
    "agent_turns": ([ASK, CALL, RESULT, {"role": "assistant", "content": "It is 21 degrees and clear in Paris."},
                     {"role": "user", "content": "And in Rome?"}], TOOLS),
    "reasoning": ([SYSTEM, {"role": "user", "content": "What is 2+2?"},
                   {"role": "assistant", "reasoning_content": "2 plus 2 is 4.", "content": "4"},
                   {"role": "user", "content": "And 3+3?"}], None),
}

#: Templates that do not read ``tools``: with tools sent, quanta writes them in as Hermes text.
HERMES_TEXT = {
    "HuggingFaceTB-SmolLM3-3B", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-V3.1", "fireworks-ai-llama-3-firefunction-v2", "google-gemma-2-2b-it",
    "llama-cpp-rwkv-world", "microsoft-Phi-3.5-mini-instruct",
}

#: The ``default`` beside a ``*-tool_use`` file's template.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _FixedNow(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 7, 26, 12, 0, 0)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(embedded_model_path())


@pytest.fixture
def with_template(tok, monkeypatch):
    """Put a llama.cpp template file on ``tok`` (named as the file), with ``strftime_now`` pinned."""
    monkeypatch.setattr(chat_template_utils, "datetime", _FixedNow)

    def put(path):
        text = path.read_text()
        template = {"default": CHATML, "tool_use": text} if path.stem.endswith("-tool_use") else text
        monkeypatch.setattr(tok.hf, "chat_template", template)
        monkeypatch.setattr(tok.hf, "name_or_path", path.stem)
    return put


#: Templates that take a call's arguments only as JSON text (as OpenAI sends them).
STRING_ARGUMENTS = {"meetkai-functionary-medium-v3.2"}


def _hf_shape(message: dict, string_arguments: bool) -> dict:
    """An OpenAI-shaped message as Hugging Face templates take it (written out independently of quanta)."""
    out = {k: v for k, v in message.items() if v is not None}
    if message.get("tool_calls"):
        out["content"] = message.get("content") or ""
        if not string_arguments:
            out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in message["tool_calls"]]
    return out


def _transformers(tok: Tokenizer, messages: list[dict], tools: list[dict] | None) -> str | Exception:
    try:
        return tok.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template's own refusal, compared below
        return exc


TEMPLATE_FILES = chat_templates()


def test_the_material_is_there():
    """Skips with the reason when llama.cpp's material cannot be had (the cases below are then empty)."""
    assert len(list((llama_cpp_tree() / "models" / "templates").glob("*.jinja"))) == 70


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("path", TEMPLATE_FILES, ids=[p.stem for p in TEMPLATE_FILES])
def test_template_renders_as_transformers_or_is_refused_by_name(tok, with_template, path, conversation):
    with_template(path)
    messages, tools = CONVERSATIONS[conversation]
    route = [Message.model_validate(m).as_dict() for m in messages]
    hermes = path.stem in HERMES_TEXT and bool(tools)
    assert needs_hermes_text(request_template(tok, tools), route, tools) == hermes
    msgs, template_tools = template_input(tok, route, tools)
    if hermes:
        expected = _transformers(tok, *render_for_template(route, tools, native=False))
    else:
        expected = _transformers(tok, [_hf_shape(m, path.stem in STRING_ARGUMENTS) for m in messages], tools)
    if isinstance(expected, Exception):
        with pytest.raises(TemplateRejected) as refused:
            prompt_text(tok, msgs, template_tools)
        assert f"chat template of {path.stem} cannot take " in str(refused.value)
        assert re.search(r"take (message \d+ \(role '\w+'|the tools it was given|any conversation)", str(refused.value))
        assert str(expected) in str(refused.value)
        return
    text = prompt_text(tok, msgs, template_tools)
    assert text == expected
    assert tok.decode(prompt_ids(tok, msgs, template_tools), skip_special_tokens=False) == text
    if hermes:
        assert all(f'"{t["function"]["name"]}"' in text for t in TOOLS) and "<tool_call>" in text
        if conversation != "tools":
            assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text


def test_the_tool_use_variant_is_picked_only_with_tools(tok, with_template):
    with_template(next(p for p in TEMPLATE_FILES if p.stem == "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"))
    plain = [Message.model_validate(m).as_dict() for m in CONVERSATIONS["multi_turn"][0]]
    assert prompt_text(tok, *template_input(tok, plain, None)).startswith("<|im_start|>system\nYou are a careful")
    with_tools = prompt_text(tok, *template_input(tok, plain, TOOLS))
    assert "<tools>" in with_tools and '"get_weather"' in with_tools


@pytest.fixture(scope="module")
def live():
    from inprocess_server import serve_in_process
    from quanta.launch import load_model

    with serve_in_process(load_model(None, torch.float32), 512, 2**20, max_num_seqs=2) as server:
        yield server


def test_a_template_refusing_a_message_shape_is_a_400_naming_both(live, monkeypatch):
    gemma = llama_cpp_tree() / "models" / "templates" / "google-gemma-2-2b-it.jinja"
    hf = live.state.tokenizer.hf
    monkeypatch.setattr(hf, "chat_template", gemma.read_text())
    monkeypatch.setattr(hf, "name_or_path", "google-gemma-2-2b-it")
    body = {"model": live.model, "max_tokens": 4, "messages": [SYSTEM, {"role": "user", "content": "Hi"}]}
    resp = httpx.post(f"{live.base}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "chat template of google-gemma-2-2b-it cannot take message 0 (role 'system')" in message
    assert "System role not supported" in message
    body["messages"] = body["messages"][1:]
    assert httpx.post(f"{live.base}/v1/chat/completions", json=body, timeout=60).status_code == 200
