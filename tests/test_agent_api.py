"""Tool calls, structured output, logprobs, refused fields and the Responses API,
through the official ``openai`` client against the session server (embedded SmolLM2).

Tool calls are forced with ``tool_choice`` (a grammar), so the 135M model
returns valid calls; the tests assert their shape and invariants (stream ==
non-stream, schema validity, logprob arithmetic), never a hard-coded text.
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a text file and return its contents",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"], "additionalProperties": False}}}
LIST_DIR = {"type": "function", "function": {
    "name": "list_dir", "description": "List a directory",
    "parameters": {"type": "object", "properties": {"dir": {"type": "string"}}, "required": ["dir"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Read the file notes.txt"}]
NAMED = {"type": "function", "function": {"name": "read_file"}}
GREEDY = dict(temperature=0, max_tokens=40)
#: no finite JSON satisfies it: "a" is required and is the object again
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
RECURSIVE_TOOL = {"type": "function", "function": {"name": "loop", "parameters": RECURSIVE}}


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=120, max_retries=0)


def forced_call(server, **kw):
    return client_for(server).chat.completions.create(
        model=server.model, messages=ASK, tools=[READ_FILE], tool_choice=NAMED, parallel_tool_calls=False, **GREEDY, **kw)


@pytest.fixture(scope="module")
def named_call(server):
    return forced_call(server)


def test_named_tool_choice_returns_a_valid_call(named_call):
    choice = named_call.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "read_file"
    args = json.loads(call.function.arguments)
    assert set(args) == {"path"} and isinstance(args["path"], str)


def test_streamed_tool_call_arguments_arrive_in_fragments(server, named_call):
    """As OpenAI streams a call: a first delta with index, id, type, name and
    ``arguments: ""``, then several ``arguments`` fragments that concatenate
    to the non-streamed call's arguments (same greedy request)."""
    stream = client_for(server).chat.completions.create(
        model=server.model, messages=ASK, tools=[READ_FILE], tool_choice=NAMED, parallel_tool_calls=False, stream=True, **GREEDY)
    deltas, finish = [], None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        deltas += choice.delta.tool_calls or []
    expected = named_call.choices[0].message.tool_calls[0]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "read_file", "")
    assert first.id.startswith("call_") and all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    fragments = [d.function.arguments for d in rest]
    assert len(fragments) > 1, fragments
    assert "".join(fragments) == expected.function.arguments
    assert json.loads("".join(fragments)) == json.loads(expected.function.arguments)
    assert finish == "tool_calls"


def test_stream_helper_accumulates_the_same_call(server, named_call):
    """The openai client's own stream accumulator rebuilds the call from the fragments."""
    with client_for(server).chat.completions.stream(
            model=server.model, messages=ASK, tools=[READ_FILE], tool_choice=NAMED, parallel_tool_calls=False, **GREEDY) as s:
        final = s.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    expected = named_call.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == (expected.function.name, expected.function.arguments)


def test_stop_string_inside_a_forced_call_is_stop_streamed_or_not(server):
    """F2: stop ["}"] ends the forced call inside its arguments: finish_reason ``stop`` both ways (never
    tool_calls); non-streamed the cut text is content, streamed the partial call was already sent."""
    kw = dict(model=server.model, messages=ASK, tools=[READ_FILE], tool_choice="required", parallel_tool_calls=False,
              stop=["}"], **GREEDY)
    full = client_for(server).chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "stop" and not full.message.tool_calls
    assert full.message.content.startswith("<tool_call>") and "}" not in full.message.content
    finish, args = None, ""
    for chunk in client_for(server).chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        args += "".join(d.function.arguments or "" for d in choice.delta.tool_calls or [])
    assert finish == "stop" and args.startswith("{") and full.message.content.endswith(args)


def test_required_picks_one_of_the_tools(server):
    r = client_for(server).chat.completions.create(
        model=server.model, messages=ASK, tools=[READ_FILE, LIST_DIR], tool_choice="required", parallel_tool_calls=False, **GREEDY)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in {"read_file", "list_dir"}
    params = {"read_file": READ_FILE, "list_dir": LIST_DIR}[call.function.name]["function"]["parameters"]
    assert set(json.loads(call.function.arguments)) == set(params["required"])


def test_tool_result_round_trip_reaches_the_prompt(server, named_call):
    call = named_call.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "The notes say: buy milk."},
    ]
    client = client_for(server)
    r = client.chat.completions.create(model=server.model, messages=history, tools=[READ_FILE], tool_choice="none", temperature=0,
                                       max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    longer = history[:-1] + [{"role": "tool", "tool_call_id": call.id, "content": "The notes say: buy milk and eggs and bread."}]
    r2 = client.chat.completions.create(model=server.model, messages=longer, tools=[READ_FILE], tool_choice="none", temperature=0,
                                        max_tokens=1)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the tool result is in the prompt


def test_json_schema_response_validates(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client_for(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Describe Paris as JSON."}], temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"city", "population"} and isinstance(data["city"], str) and isinstance(data["population"], int)


def test_json_object_and_guided_fields(server):
    client = client_for(server)
    r = client.chat.completions.create(model=server.model, messages=ASK, temperature=0, max_tokens=60,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(model=server.model, messages=ASK, temperature=0, max_tokens=10,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=server.model, prompt="My zip code is", temperature=0, max_tokens=10,
                                  extra_body={"guided_regex": "[0-9]{5}"})
    assert len(r.choices[0].text) == 5 and r.choices[0].text.isdigit()


def test_chat_logprobs_are_consistent_and_stream_alike(server):
    client = client_for(server)
    req = dict(model=server.model, messages=[{"role": "user", "content": "Count to five."}], temperature=0, max_tokens=8,
               logprobs=True, top_logprobs=3)
    client.chat.completions.create(**req)  # warm: the next two both reuse the cached prompt (bf16 sums differ otherwise)
    r = client.chat.completions.create(**req)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        # greedy: the chosen token is a most likely one (bf16 logits can tie, so compare values, not tokens)
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob, abs_tol=1e-6)
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-5
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert "".join(e.token for e in entries).startswith(r.choices[0].message.content)
    streamed = [e for chunk in client.chat.completions.create(**req, stream=True)
                for e in ((chunk.choices[0].logprobs.content or []) if chunk.choices and chunk.choices[0].logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(streamed, entries))


def test_completion_logprobs_offsets(server):
    r = client_for(server).completions.create(model=server.model, prompt="The capital of France is", temperature=0,
                                              max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for _token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and math.isclose(max(top.values()), logprob, abs_tol=1e-6)
    assert "".join(lp.tokens).startswith(r.choices[0].text)


@pytest.mark.parametrize("route,extra,field", [
    ("chat", {"logit_bias": {"1": 5}}, "logit_bias"),
    ("chat", {"n": 2}, "n"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    # a $ref cycle with no finite value compiled, then ran unconstrained (200 with free text): now a 400
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": RECURSIVE}}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}, "response_format"),
    ("chat", {"tools": [RECURSIVE_TOOL], "tool_choice": "required"}, "tool_choice"),
    ("chat", {"guided_json": RECURSIVE}, "guided_json"),
    ("completions", {"guided_json": {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                     "required": ["next"]}}, "$ref": "#/$defs/n"}}, "guided_json"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"logit_bias": {"1": 5}}, "logit_bias"),
])
def test_unsupported_or_invalid_fields_are_400_naming_them(server, route, extra, field):
    body = {"model": server.model, "max_tokens": 2}
    if route == "chat":
        body["messages"] = ASK
        url = "/v1/chat/completions"
    else:
        body["prompt"] = "Hi"
        url = "/v1/completions"
    resp = httpx.post(server.base_url + url, json={**body, **extra}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert field in err["message"] or field == err["param"], err


def test_bad_json_error_gives_the_position(server):
    resp = httpx.post(server.base_url + "/v1/chat/completions", content=b'{"model": "m",, }',
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400
    assert "position 14" in resp.json()["error"]["message"]


def read_file_tool(path: str) -> str:
    return {"notes.txt": "Meeting at noon.", "todo.txt": "Ship the release."}.get(path, f"no such file: {path}")


def test_scripted_agent_calls_read_file_twice_and_finishes(server):
    """A minimal agent: the model must call read_file until it has read two
    files (tool_choice forces it), then answers without tools. The path is
    bounded (``maxLength``) because the 135M model tends to repeat itself."""
    client = client_for(server)
    tool = json.loads(json.dumps(READ_FILE))
    tool["function"]["parameters"]["properties"]["path"]["maxLength"] = 24
    messages = [{"role": "system", "content": "You are a coding agent. Use read_file to read files."},
                {"role": "user", "content": "Read notes.txt and todo.txt, then summarize them."}]
    reads = []
    for _turn in range(4):
        must_call = len(reads) < 2
        r = client.chat.completions.create(model=server.model, messages=messages, tools=[tool],
                                           tool_choice="required" if must_call else "none", parallel_tool_calls=False,
                                           temperature=0, max_tokens=40)
        msg = r.choices[0].message
        if not msg.tool_calls:
            break
        assert r.choices[0].finish_reason == "tool_calls"
        messages.append({"role": "assistant", "content": msg.content, "tool_calls": [c.model_dump() for c in msg.tool_calls]})
        for call in msg.tool_calls:
            path = json.loads(call.function.arguments)["path"]
            reads.append(path)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": read_file_tool(path)})
    assert len(reads) == 2
    assert msg.tool_calls is None and r.choices[0].finish_reason in ("stop", "length") and msg.content
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]


# --------------------------------------------------------------------------- Responses API

RESPONSES_TOOL = {"type": "function", "name": "read_file", "description": "Read a text file",
                  "parameters": READ_FILE["function"]["parameters"]}


def test_responses_text_and_stream(server):
    client = client_for(server)
    client.responses.create(model=server.model, input="Say hello.", max_output_tokens=16, temperature=0)  # warm, as above
    r = client.responses.create(model=server.model, input="Say hello.", max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.output[0].type == "message" and r.output_text
    assert r.usage.output_tokens <= 16 and r.status in ("completed", "incomplete")
    events = list(client.responses.create(model=server.model, input="Say hello.", max_output_tokens=16, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_call_round_trip(server):
    client = client_for(server)
    kw = dict(model=server.model, tools=[RESPONSES_TOOL], tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=40, temperature=0)
    r = client.responses.create(input="Read notes.txt", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "read_file" and "path" in json.loads(calls[0].arguments)
    events = list(client.responses.create(input="Read notes.txt", stream=True, **kw))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(d.name, d.arguments) for d in done] == [(calls[0].name, calls[0].arguments)]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 1 and "".join(fragments) == calls[0].arguments
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    assert kinds[added + 1] == "response.function_call_arguments.delta"  # arguments stream while the item is open
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    follow = client.responses.create(model=server.model, max_output_tokens=16, temperature=0, tools=[RESPONSES_TOOL], input=[
        {"role": "user", "content": "Read notes.txt"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "read_file", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Meeting at noon."},
    ], tool_choice="none")
    assert follow.output[0].type == "message"


def test_responses_refuses_stored_state_and_a_forced_hosted_tool(server):
    """Stored state and a call only a hosted tool could answer are refused; offered, a hosted tool is
    accepted and never called (tests/test_agent_fields.py)."""
    client = client_for(server)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=server.model, input="x", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="conversation"):
        client.responses.create(model=server.model, input="x", conversation="conv_1")
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=server.model, input="x", background=True)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.responses.create(model=server.model, input="x", tools=[{"type": "web_search"}], tool_choice="required")


def test_served_model_name_aliases(launch_server):
    srv = launch_server("--max-model-len", "256", "--served-model-name", "main-id", "alias-id", "--tool-call-parser", "hermes")
    try:
        ids = [m["id"] for m in httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"]]
        assert ids == ["main-id", "alias-id"]
        r = client_for(srv).chat.completions.create(model="alias-id", messages=ASK, max_tokens=2, temperature=0)
        assert r.model == "alias-id"
        with pytest.raises(openai.NotFoundError, match="'main-id' or 'alias-id'"):
            client_for(srv).chat.completions.create(model="other", messages=ASK, max_tokens=2)
        assert httpx.get(srv.base_url + "/v1/config", timeout=30).json()["tool_call_parser"] == "hermes"
    finally:
        srv.stop()


@pytest.mark.parametrize("url,body,field", [
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 16,
                       "text": {"format": {"type": "json_schema", "name": "x", "schema": RECURSIVE}}}, "text.format"),
    ("/v1/messages", {"messages": ASK, "max_tokens": 2, "tools": [{"name": "loop", "input_schema": RECURSIVE}],
                      "tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_a_recursive_schema_is_400_on_responses_and_messages(server, url, body, field):
    resp = httpx.post(server.base_url + url, json={"model": server.model, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert field in err["message"] and "$ref" in err["message"], err
