"""The streaming tool-call splitter (quanta.server.tool_formats.stream) on fixed outputs,
split at every possible point: what streams must add up to the non-streamed parse."""

from __future__ import annotations

import json

import pytest

from quanta.server.tool_formats.base import HermesParser, Llama3JsonParser, MistralParser
from quanta.server.tool_formats.calls import ToolCall
from quanta.server.tool_formats.stream import ArgumentsDelta, CallClosed, CallOpened, TextDelta, tool_stream

HERMES_OUTPUTS = [
    'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
    '<tool_call>{"name": "read_file", "arguments": {"path": "b.py", "n": [1, {"x": "}"}]}}</tool_call>',
    # the grammar's form: compact JSON between newlines
    '<tool_call>\n{"name":"read_file","arguments":{"path":"notes.txt"}}\n</tool_call>',
    # braces, quotes, escapes and a would-be close tag inside strings
    '<tool_call>{"name": "edit", "arguments": {"code": "if (a) { b(\\"}\\"); } // \\\\", "q": "a < b </tool x"}}</tool_call>',
    'A <tool_call>{"name": "f", "arguments": {}}</tool_call> B\n',
    '  \n<tool_call>{"name": "f", "arguments": {"s": "\u00e9\\u00e9"}}</tool_call>\n\n',
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}}',  # cut after the object: still a call
    '<tool_call>{"name": "f", "arguments": {"x": 1}} trailing</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # string arguments: sent whole
    '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',  # arguments first: sent whole
    '<tool_call>{not json}</tool_call> then <tool_call>{"name": "f", "arguments": {}}</tool_call>',
    "no calls here, just <tool text  ",
    "<tool_call>{broken",
    "",
    # F3a: a close tag inside a JSON string is data (both read the city as "</tool_call>")
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"</tool_call>"}}\n</tool_call> after',
    '<tool_call>{"name": "f", "arguments": {"s": "a\\"</tool_call>\\\\"}}</tool_call>',
    # F3b: a repeated name keeps its first value in both
    '<tool_call>\n{"name":"get_weather","name":"evil","arguments":{"city":"Paris"}}\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}, "arguments": {"b": 3}}</tool_call>',
]

#: outputs that end inside a call or whose call JSON breaks after the name was streamed (F2, F3c)
BROKEN_OUTPUTS = [
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"',  # stop string "}" (F2)
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}\n</tool_call>',  # wrapper brace missing (F3c)
    '<tool_call>{"name": "f", "arguments": {"x": 1]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": 1}',  # cut between the arguments and the wrapper's brace
    'Hi <tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>{"name": "g", "arguments": {"y": ',
]


def run(parser, pieces):
    """Feed ``pieces``; (events, text, calls as (name, arguments), fragments per call index)."""
    stream = tool_stream(parser)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    closed = [(e.call.name, e.call.arguments) for e in events if isinstance(e, CallClosed)]
    fragments: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ArgumentsDelta):
            fragments.setdefault(e.index, []).append(e.text)
    return events, text, closed, fragments


def check_against_parse(parser, output, pieces):
    events, text, closed, fragments = run(parser, pieces)
    whole = parser.parse(output)
    complete = [(e.call.name, e.call.arguments) for e in events if isinstance(e, CallClosed) and e.complete]
    assert complete == [(c.name, c.arguments) for c in whole.calls], pieces
    assert (len(complete) < len(closed)) == whole.broken, pieces
    if whole.broken:  # documented: the broken call was streamed; parse keeps its text as content
        return fragments
    assert text == (whole.content or ""), pieces
    assert closed == [(c.name, c.arguments) for c in whole.calls], pieces
    for index, (_name, arguments) in enumerate(closed):
        assert "".join(fragments.get(index, [])) == arguments
        kinds = [type(e) for e in events if getattr(e, "index", None) == index]
        assert kinds[0] is CallOpened and kinds[-1] is CallClosed and set(kinds[1:-1]) <= {ArgumentsDelta}
    opened = [e for e in events if isinstance(e, CallOpened)]
    assert [(e.index, e.name) for e in opened] == [(i, n) for i, (n, _a) in enumerate(closed)]
    return fragments


def splits(output):
    yield [output]
    yield list(output)
    for i in range(len(output) + 1):
        yield [output[:i], output[i:]]


@pytest.mark.parametrize("output", HERMES_OUTPUTS)
def test_hermes_stream_equals_parse_at_every_split(output):
    for pieces in splits(output):
        check_against_parse(HermesParser(), output, pieces)


@pytest.mark.parametrize("output", BROKEN_OUTPUTS)
def test_hermes_broken_calls_agree_on_broken_at_every_split(output):
    for pieces in splits(output):
        check_against_parse(HermesParser(), output, pieces)
    stream = tool_stream(HermesParser())
    events = stream.feed(output) + stream.finish()
    assert stream.broken and not stream.made_calls and not HermesParser().parse(output).made_calls
    assert [e.complete for e in events if isinstance(e, CallClosed)][-1] is False


def test_close_tag_inside_a_string_is_the_argument():
    output = HERMES_OUTPUTS[-4]
    (call,) = HermesParser().parse(output).calls
    assert json.loads(call.arguments) == {"city": "</tool_call>"} and HermesParser().parse(output).content == " after"
    _events, text, closed, fragments = run(HermesParser(), list(output))
    assert closed == [("get_weather", '{"city":"</tool_call>"}')] and text == " after"
    assert "".join(fragments[0]) == '{"city":"</tool_call>"}'


def test_repeated_name_keeps_the_first_in_both():
    output = HERMES_OUTPUTS[-2]
    assert [c.name for c in HermesParser().parse(output).calls] == ["get_weather"]
    assert run(HermesParser(), list(output))[2] == [("get_weather", '{"city": "Paris"}')]  # not the head shape: sent whole


def test_hermes_arguments_arrive_as_written_while_the_call_is_open():
    output = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/main.py", "lines": [1, 20]}}\n</tool_call>'
    _events, _text, closed, fragments = run(HermesParser(), list(output))
    assert closed == [("read_file", '{"path": "src/main.py", "lines": [1, 20]}')]
    assert len(fragments[0]) == len(closed[0][1])  # one per character fed: nothing held back
    stream = tool_stream(HermesParser())
    head = output.index('{"path"')
    first = stream.feed(output[:head + 1])
    assert [type(e) for e in first] == [CallOpened, ArgumentsDelta] and first[1].text == "{"
    assert stream.feed('"path": "s') == [ArgumentsDelta(0, '"path": "s')]
    # the object's closing brace goes out; the wrapper's and the close tag do not
    rest = output[head + 1 + len('"path": "s'):]
    out = stream.feed(rest)
    assert out[0] == ArgumentsDelta(0, 'rc/main.py", "lines": [1, 20]}') and isinstance(out[1], CallClosed) and len(out) == 2


def test_hermes_parse_reports_the_raw_arguments_text():
    parsed = HermesParser().parse('<tool_call>{"name": "f", "arguments": {"b":1,  "a": "\\u00e9"}}</tool_call>')
    assert parsed.calls[0].arguments == '{"b":1,  "a": "\\u00e9"}'
    # JSON-string arguments have no raw object: re-serialized
    parsed = HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"x\\":1}"}</tool_call>')
    assert parsed.calls[0].arguments == '{"x": 1}'


def test_hermes_cut_inside_the_arguments_keeps_the_streamed_call():
    """Documented divergence: a call cut by max_tokens has streamed its name and part of its arguments,
    closed as incomplete; the non-streamed answer keeps the text, and both report the call broken."""
    output = '<tool_call>{"name": "f", "arguments": {"x": 1'
    events, text, closed, _fragments = run(HermesParser(), list(output))
    assert closed == [("f", '{"x": 1')] and text == "" and events[-1].complete is False
    parsed = HermesParser().parse(output)
    assert parsed.calls == [] and parsed.content == output and parsed.broken


def test_trailing_whitespace_is_held_until_more_content():
    stream = tool_stream(HermesParser())
    assert stream.feed("Hi \n") == [TextDelta("Hi")]
    assert stream.feed(" there ") == [TextDelta(" \n there")]
    assert stream.finish() == [TextDelta(" ")]  # no calls: the whole text


@pytest.mark.parametrize("parser,output", [
    (Llama3JsonParser(), '{"name": "read_file", "parameters": {"path": "a"}}'),
    (Llama3JsonParser(), ' <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 2}}'),
    (Llama3JsonParser(), "The answer is {probably} 4."),
    (MistralParser(), 'Sure [TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a"}}]'),
    (MistralParser(), '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'),
    (MistralParser(), '[TOOL_CALLS]read_file[ARGS]{"path": "y"}'),
    (MistralParser(), "[1, 2] is a list"),
])
def test_whole_call_formats_equal_parse_at_every_split(parser, output):
    for pieces in splits(output):
        fragments = check_against_parse(parser, output, pieces)
        assert all(len(f) == 1 for f in fragments.values())  # documented: one fragment per call


def test_streamed_calls_decode_to_the_parsed_arguments():
    output = HERMES_OUTPUTS[0]
    _events, _text, closed, _fragments = run(HermesParser(), list(output))
    assert [json.loads(a) for _n, a in closed] == [{"path": "a.py"}, {"path": "b.py", "n": [1, {"x": "}"}]}]


# --------------------------------------------------------------------------- protocol mappings

TEXT_CALL_TEXT = [TextDelta("Let me look."), CallOpened(0, "call_abc", "read_file"), ArgumentsDelta(0, '{"path": '),
                  ArgumentsDelta(0, '"a"}'), CallClosed(0, ToolCall("read_file", '{"path": "a"}', "call_abc")), TextDelta(" Done.")]


def sse_payloads(chunks):
    return [json.loads(line.removeprefix("data: ")) for c in chunks for line in c.splitlines() if line.startswith("data: ")]


def test_anthropic_blocks_follow_output_order():
    from quanta.server.anthropic.messages import ToolBlocks

    blocks = ToolBlocks()
    events = sse_payloads([s for e in TEXT_CALL_TEXT for s in blocks.events(e)] + blocks.close_text())
    shape = [(e["type"], e["index"], (e.get("content_block") or e.get("delta") or {}).get("type")) for e in events]
    assert shape == [
        ("content_block_start", 0, "text"), ("content_block_delta", 0, "text_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "tool_use"), ("content_block_delta", 1, "input_json_delta"),
        ("content_block_delta", 1, "input_json_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "text"), ("content_block_delta", 2, "text_delta"), ("content_block_stop", 2, None),
    ]
    assert events[3]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "read_file", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events if e["index"] == 1 and e["type"] == "content_block_delta") == \
        '{"path": "a"}'


def test_responses_items_follow_output_order():
    from quanta.server.responses.routes import ResponsesRequest, _Builder, _Events, _Items

    items = _Items(_Events(), _Builder(ResponsesRequest(model="m", input="x"), []))
    events = sse_payloads([s for e in TEXT_CALL_TEXT for s in items.on(e)] + items.close())
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds == [
        ("response.output_item.added", 0), ("response.content_part.added", 0), ("response.output_text.delta", 0),
        ("response.output_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1), ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.content_part.added", 2), ("response.output_text.delta", 2),
        ("response.output_text.done", 2), ("response.content_part.done", 2), ("response.output_item.done", 2),
    ]
    call_item = events[6]["item"]
    assert call_item["status"] == "in_progress" and call_item["arguments"] == "" and call_item["call_id"] == "call_abc"
    assert {e["item_id"] for e in events[7:10]} == {call_item["id"]}
    assert [o["type"] for o in items.output] == ["message", "function_call", "message"]
    assert items.output[0]["id"] != items.output[2]["id"] and items.output[1]["arguments"] == '{"path": "a"}'
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_responses_without_items_gets_an_empty_message():
    from quanta.server.responses.routes import ResponsesRequest, _Builder, _Events, _Items

    items = _Items(_Events(), _Builder(ResponsesRequest(model="m", input="x"), []))
    kinds = [e["type"] for e in sse_payloads(items.close())]
    assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
    assert items.output[0]["content"][0]["text"] == ""


def test_chat_chunks_carry_content_then_call_deltas():
    from quanta.engine.output import RequestOutput
    from quanta.server.openai.chat import ChatFormat, _Meta

    fmt = ChatFormat(None, tool_stream(HermesParser()))
    fmt.meta = _Meta("chatcmpl-1", 0, "m")
    output = 'Hi.\n<tool_call>\n{"name": "f", "arguments": {"k": [1, 2]}}\n</tool_call>'
    pieces = ["Hi.\n<tool", '_call>\n{"name": "f", "arguments": {"k"', ": [1, ", '2]}}\n</tool_call>']
    chunks = [c for i, p in enumerate(pieces)
              for c in fmt.chunks(RequestOutput(0, [i], p, i == len(pieces) - 1, "stop", 5, i + 1, 0.0, 0.0), None)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [
        {"content": "Hi."},
        {"tool_calls": [{"index": 0, "id": deltas[1]["tool_calls"][0]["id"], "type": "function",
                         "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"k"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": [1, "}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "2]}"}}]},
        {},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message = fmt.full(output, RequestOutput(0, [], "", True, "stop", 5, 4, 0.0, 0.0), None)["choices"][0]["message"]
    assert message["content"] == "Hi." and message["tool_calls"][0]["function"]["arguments"] == '{"k": [1, 2]}'


def chat_run(output: str, finish: str, pieces=None):
    """(streamed finish_reason, streamed call arguments, non-streamed choice) of ``output`` ending with ``finish``."""
    from quanta.engine.output import RequestOutput
    from quanta.server.openai.chat import ChatFormat, _Meta

    fmt = ChatFormat(None, tool_stream(HermesParser()))
    fmt.meta = _Meta("chatcmpl-1", 0, "m")
    pieces = pieces or list(output)
    chunks = [c for i, p in enumerate(pieces)
              for c in fmt.chunks(RequestOutput(0, [i], p, i == len(pieces) - 1, finish, 5, i + 1, 0.0, 0.0), None)]
    args = "".join(t["function"]["arguments"] for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or [])
    full = fmt.full(output, RequestOutput(0, [], "", True, finish, 5, 4, 0.0, 0.0), None)["choices"][0]
    return chunks[-1]["choices"][0]["finish_reason"], args, full


@pytest.mark.parametrize("finish", ["stop", "length"])
@pytest.mark.parametrize("output", BROKEN_OUTPUTS)
def test_chat_ended_inside_a_call_keeps_the_engine_reason(output, finish):
    """F2/F3c: a stop string, max_tokens or EOS inside a call is ``stop``/``length``, streamed or not, never tool_calls."""
    streamed, _args, full = chat_run(output, finish)
    assert streamed == full["finish_reason"] == finish


def test_chat_stop_string_inside_the_arguments():
    """F2 as the tester sent it: stop ["}"] cut the forced call; content non-streamed, a partial call streamed."""
    output = BROKEN_OUTPUTS[0]
    streamed, args, full = chat_run(output, "stop", ['<tool_call>\n{"name":"get_weather","arguments":', '{"city":', '"Paris"'])
    assert (streamed, args) == ("stop", '{"city":"Paris"')
    assert full["message"]["content"] == output and "tool_calls" not in full["message"]
    complete = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    assert chat_run(complete, "stop")[0] == chat_run(complete, "stop")[2]["finish_reason"] == "tool_calls"


def test_anthropic_stop_reason_inside_a_call():
    from quanta.engine.output import RequestOutput
    from quanta.server.anthropic.messages import _stop

    out = RequestOutput(0, [], "", True, "stop", 5, 4, 0.0, 0.0)
    out.stop_string = "}"
    stream = tool_stream(HermesParser())
    stream.feed(BROKEN_OUTPUTS[0])
    stream.finish()
    assert _stop(out, 16, stream.made_calls) == ("stop_sequence", "}")
    assert _stop(out, 16, HermesParser().parse(BROKEN_OUTPUTS[0]).made_calls) == ("stop_sequence", "}")


def test_responses_marks_a_cut_call_incomplete():
    from quanta.server.responses.routes import ResponsesRequest, _Builder, _Events, _Items

    items = _Items(_Events(), _Builder(ResponsesRequest(model="m", input="x"), []))
    stream = tool_stream(HermesParser())
    for event in stream.feed(BROKEN_OUTPUTS[0]) + stream.finish():
        items.on(event)
    assert [(o["type"], o["status"]) for o in items.output] == [("function_call", "incomplete")]
