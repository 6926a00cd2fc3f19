"""The server's defaults for what a request leaves out: ``--max-tokens-default`` and the
sampling settings (``--temperature`` / ``--top-p`` / ``--top-k`` over ``generation_config.json``).

The live tests use the official ``openai`` client against a ``quanta serve`` subprocess.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from quanta.server.defaults import generation_defaults, output_cap, sampling_defaults

PROMPT = [{"role": "user", "content": "Write a long story about a dragon."}]


def test_generation_config_values_in_range_become_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": True, "do_sample": True, "max_new_tokens": 9}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 7, "top_p": 0, "top_k": "5"}))
    assert generation_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text("not json")
    assert generation_defaults(str(tmp_path)) == {}
    assert generation_defaults(None) == {}


def test_flags_override_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    merged = sampling_defaults(str(tmp_path), {"temperature": 0.0, "top_p": None, "top_k": 5})
    assert merged == {"temperature": 0.0, "top_p": 0.9, "top_k": 5}


def test_output_cap_is_the_default_within_the_room_left():
    config = {"max_tokens_default": 100}
    assert output_cap(config, 512, 500, None) == 12
    assert output_cap(config, 512, 10, None) == 100
    assert output_cap(config, 512, 10, 300) == 300  # a cap the request names stands
    assert output_cap({"max_tokens_default": 0}, 512, 10, None) == 502  # 0: the room left


@pytest.fixture(scope="module")
def capped(launch_server):
    handle = launch_server("--max-model-len", "512", "--max-tokens-default", "6", "--temperature", "0")
    yield handle
    handle.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=120, max_retries=0)


def test_chat_without_max_tokens_stops_at_the_server_default(capped):
    client = _client(capped)
    reply = client.chat.completions.create(model=capped.model, messages=PROMPT, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 6
    assert reply.choices[0].finish_reason == "length"
    named = client.chat.completions.create(model=capped.model, messages=PROMPT, max_tokens=9,
                                           extra_body={"ignore_eos": True})
    assert named.usage.completion_tokens == 9


def test_responses_without_max_output_tokens_stop_at_the_server_default(capped):
    reply = _client(capped).responses.create(model=capped.model, input="Write a long story.",
                                             extra_body={"ignore_eos": True})
    assert reply.usage.output_tokens == 6
    assert reply.status == "incomplete"


def test_the_server_temperature_applies_when_the_request_sends_none(capped):
    client = _client(capped)
    ask = dict(model=capped.model, messages=PROMPT, max_tokens=6, extra_body={"ignore_eos": True})
    greedy = client.chat.completions.create(temperature=0, **ask).choices[0].message.content
    # at temperature 1.0, three 6-token samples of a 135M model agreeing with the greedy answer is unlikely
    assert [client.chat.completions.create(**ask).choices[0].message.content for _ in range(3)] == [greedy] * 3


def test_config_reports_the_defaults(capped):
    config = httpx.get(capped.base_url + "/v1/config", timeout=30).json()
    assert config["max_tokens_default"] == 6
    assert config["sampling_defaults"] == {"temperature": 0.0}


MODELLESS = [
    ("/v1/chat/completions", {"messages": PROMPT, "max_tokens": 2}, lambda r: r["model"]),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 2}, lambda r: r["model"]),
    ("/v1/responses", {"input": "Once", "max_output_tokens": 16}, lambda r: r["model"]),
    ("/v1/messages", {"messages": PROMPT, "max_tokens": 2}, lambda r: r["model"]),
    ("/v1/messages/count_tokens", {"messages": PROMPT}, lambda r: r["input_tokens"] > 0),
]


@pytest.mark.parametrize("path,body,read", MODELLESS, ids=[m[0] for m in MODELLESS])
def test_a_request_without_model_is_for_the_served_model(capped, path, body, read):
    r = httpx.post(capped.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert read(r.json()) in (capped.model, True)
    named = httpx.post(capped.base_url + path, json={**body, "model": "other"}, timeout=60)
    assert named.status_code == 404, named.text  # a model the request names is still checked


TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}ANSWER:"


def test_chat_template_flag_renders_chat_prompts(launch_server, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    server = launch_server("--max-model-len", "512", "--chat-template", str(path))
    try:
        chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 1}).json()
        plain = httpx.post(server.base_url + "/v1/completions", timeout=60,
                           json={"prompt": "<<Hi there>>ANSWER:", "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] < 12  # the model's own template adds ~30
        assert httpx.get(server.base_url + "/v1/config", timeout=30).json()["chat_template_flag"] is True
    finally:
        server.stop()
