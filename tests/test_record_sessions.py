"""``quanta record`` (a recording pass-through proxy) and ``--workload sessions`` (its replay).

The proxy runs as a real subprocess in front of the shared quanta server;
agents are the official ``openai`` and ``anthropic`` clients. The recorded
file is then replayed against the same server with ``quanta bench run``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager

import anthropic
import httpx
import openai
import pytest

from quanta.bench.server import free_port
from quanta.bench.sessions import SessionFileError, load
from quanta.cli import main

MARK = "zebraquartz"  # a word of every prompt: the file must not contain it without --record-text


@contextmanager
def recording(server, out):
    """``quanta record`` in front of ``server``, writing ``out``; yields its base URL and then its log text."""
    port = free_port()
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "quanta.cli", "record", "--upstream", server.base_url, "--out", str(out),
                                 "--port", str(port)], stdout=f, stderr=subprocess.STDOUT)
    done = {}
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180  # the CLI imports torch: slow on a busy machine
        while True:
            try:
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield base, done
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()
    done["log"] = log.read_text()


@pytest.fixture(scope="module")
def recorded(server, tmp_path_factory):
    """Record a few agent sessions through ``quanta record``; returns (file, what the clients saw)."""
    out = tmp_path_factory.mktemp("record") / "agent.jsonl"
    with recording(server, out) as (base, done):
        seen = _agents(base, server.model, out)
    assert "wrote 8 requests of 4 sessions" in done["log"]
    return out, seen


def test_record_writes_responses_requests_and_their_relation(server, tmp_path):
    """A Codex-style Responses session (instructions, then the first turn's items resent with a function call
    and its output), streamed and not: each request's line with the upstream's usage, the second extending the first."""
    out = tmp_path / "codex.jsonl"
    with recording(server, out) as (base, done):
        oc = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        first = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"List the files. {MARK}"}]}]
        events = list(oc.responses.create(model=server.model, instructions="You are Codex.", input=first,
                                          max_output_tokens=16, temperature=0, stream=True))
        final = events[-1].response
        text = final.output[0].content[0].text
        second = first + [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
                          {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "ls"}'},
                          {"type": "function_call_output", "call_id": "c1", "output": "README.md"}]
        again = oc.responses.create(model=server.model, instructions="You are Codex.", input=second, max_output_tokens=16,
                                    temperature=0)
    assert "wrote 2 requests of 1 sessions" in done["log"]
    _, (a, b) = _records(out)
    assert (a["api"], a["path"], a["stream"], a["max_tokens"], a["status"], a["complete"]) == (
        "responses", "/v1/responses", True, 16, 200, True)
    assert (a["prompt_tokens"], a["completion_tokens"]) == (final.usage.input_tokens, final.usage.output_tokens)
    assert a["finish_reason"] == (final.incomplete_details.reason if final.incomplete_details else final.status)
    assert (b["prompt_tokens"], b["completion_tokens"], b["stream"]) == (again.usage.input_tokens, again.usage.output_tokens, False)
    assert (b["session"], b["turn"], b["parent"], b["extends"]) == (a["session"], 1, a["id"], True)
    assert [s["role"] for s in b["segments"]] == ["function_call", "function_call_output"]
    assert MARK not in out.read_text()


def _agents(base: str, model: str, out) -> dict:
    """Two chat agents (one streaming, one not), a completions agent and an Anthropic agent.

    After each request the sessions file already holds its line: the proxy writes it before the
    client sees the reply's end, so an agent's next turn always finds its parent finished.
    """
    oc = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    seen = {"usage": []}

    def written() -> int:
        return len(out.read_text().splitlines()) - 1  # less the header
    msgs = [{"role": "system", "content": f"You are terse. {MARK}"}, {"role": "user", "content": f"List three colors. {MARK}"}]
    for turn in range(3):
        stream = oc.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        seen["usage"].append((usage.prompt_tokens, usage.completion_tokens))
        assert written() == len(seen["usage"])
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Tool output: {MARK} ok {turn}"}]
    other = [{"role": "user", "content": f"Name a river. {MARK}"}]
    r = oc.chat.completions.create(model=model, messages=other, max_tokens=5, temperature=0)
    seen["usage"].append((r.usage.prompt_tokens, r.usage.completion_tokens))
    assert written() == len(seen["usage"])  # a JSON body: written once its Content-Length arrived
    other += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"And a lake. {MARK}"}]
    r = oc.chat.completions.create(model=model, messages=other, max_tokens=5, temperature=0)
    seen["usage"].append((r.usage.prompt_tokens, r.usage.completion_tokens))
    p = f"The sky is {MARK}"
    r = oc.completions.create(model=model, prompt=p, max_tokens=4, temperature=0)
    seen["usage"].append((r.usage.prompt_tokens, r.usage.completion_tokens))
    r = oc.completions.create(model=model, prompt=p + r.choices[0].text + " and the sea", max_tokens=4, temperature=0)
    seen["usage"].append((r.usage.prompt_tokens, r.usage.completion_tokens))
    ac = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    with ac.messages.stream(model=model, max_tokens=5, system=f"You are terse. {MARK}",
                            messages=[{"role": "user", "content": f"List three colors. {MARK}"}]) as s:
        final = s.get_final_message()
    u = final.usage
    seen["usage"].append((u.input_tokens + (u.cache_read_input_tokens or 0), u.output_tokens))
    assert written() == len(seen["usage"])
    return seen


def _records(path):
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), sorted((json.loads(x) for x in lines[1:]), key=lambda r: r["id"])


def test_record_writes_lengths_timing_and_prefix_relations_without_text(recorded):
    path, seen = recorded
    assert MARK not in path.read_text()
    header, recs = _records(path)
    assert header["format"] == "quanta-sessions/1" and header["record_text"] is False
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in recs] == seen["usage"]
    assert all(r["status"] == 200 and r["complete"] and not r["usage_estimated"] for r in recs)
    for r in recs:  # the shared prefix plus the new segments are the whole prompt
        assert r["shared_tokens"] + sum(s["tokens"] for s in r["segments"]) == r["prompt_tokens"]
        assert r["done"] >= r["t"] and "text" not in json.dumps(r["segments"])
    a0, a1, a2, b0, b1, c0, c1, d0 = recs
    # agent A: each turn resends the previous prompt (2 segments, then 4) plus its reply
    assert (a0["session"], a0["turn"], a0["parent"]) == (0, 0, None)
    assert (a1["session"], a1["turn"], a1["parent"], a1["shared"], a1["extends"]) == (0, 1, 0, 3, True)
    assert (a2["turn"], a2["parent"], a2["shared"], [s["role"] for s in a2["segments"]]) == (2, 1, 5, ["user"])
    assert a1["shared_tokens"] == a0["prompt_tokens"] + a0["completion_tokens"]
    assert a0["stream"] and a0["ttft"] is not None and 0 < a0["ttft"] <= a0["done"] - a0["t"]
    # agent B is a new session; its non-streamed turns extend each other
    assert (b0["session"], b0["parent"], b1["session"], b1["parent"], b1["shared"]) == (1, None, 1, 3, 2)
    assert not b0["stream"] and b0["api"] == "chat"
    # completions: the second prompt starts with the first prompt and its reply
    assert (c0["api"], c1["parent"], c1["shared"], c1["extends"]) == ("completions", 5, 2, True)
    assert c0["session"] == 2 and c1["session"] == 2
    # the Anthropic agent sends agent A's first prompt: a new session sharing A's latest two segments (ties: the latest)
    assert (d0["api"], d0["session"], d0["parent"], d0["shared"], d0["extends"]) == ("messages", 3, 2, 2, False)


def test_sessions_replay_sends_the_recorded_requests(recorded, server, tmp_path):
    path, _ = recorded
    _, recs = _records(path)
    prefix = tmp_path / "replay"
    assert main(["bench", "run", "--base-url", server.base_url, "--workload", "sessions", "--sessions-file", str(path),
                 "--endpoint", "chat", "--repeats", "2", "--warmup", "0", "--no-progress", "--no-plots", "--out", str(prefix)]) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    assert doc["workload_text"].startswith(f"sessions: 8 recorded requests of 4 agent sessions from {path}")
    runs = doc["conditions"][0]["runs"]
    expected = sorted((f"session{r['session']}/turn{r['turn']}", r["completion_tokens"]) for r in recs)
    for run in runs:
        samples = run["samples"]
        assert all(s["error"] is None for s in samples)
        assert sorted((s["tag"], s["completion_tokens"]) for s in samples) == expected  # exact output lengths
    by_tag = [{s["tag"]: s["prompt_tokens"] for s in run["samples"]} for run in runs]
    firsts = [t for t in by_tag[0] if t.endswith("/turn0")]
    assert all(by_tag[0][t] == by_tag[1][t] for t in firsts)  # the same requests in every run
    a = {r["turn"]: r["prompt_tokens"] for r in recs if r["session"] == 0 and r["api"] == "chat"}
    for turn, tokens in a.items():  # as recorded, plus the 6-word run prefix and the template's tokens again per message
        messages = 2 * (turn + 1)
        assert tokens < by_tag[0][f"session0/turn{turn}"] <= tokens + 6 + 8 * messages, (turn, by_tag, a)


HEADER = '{"format": "quanta-sessions/1"}'
REQ0 = {"id": 0, "t": 0.0, "done": 1.0, "session": 0, "turn": 0, "parent": None, "extends": False, "shared": 0, "shared_tokens": 0,
        "segments": [{"role": "user", "tokens": 5}], "prompt_tokens": 5, "completion_tokens": 3, "status": 200, "complete": True}
REQ1 = {**REQ0, "id": 1, "t": 1.0, "done": 2.0, "turn": 1, "parent": 0, "extends": True, "shared": 2, "shared_tokens": 8}


@pytest.mark.parametrize("lines, message", [
    ([], "empty sessions file"),
    (['{"id": 0}'], "not a sessions file"),
    ([HEADER, "{not json"], ":2: not JSON"),
    ([HEADER, {"id": 0, "t": 0}], ":2: missing field 'session'"),
    ([HEADER, REQ0, {**REQ1, "t": -1.0}], ":3: 't', 'shared' and 'shared_tokens' must be >= 0"),
    ([HEADER, {**REQ0, "t": 5.0, "done": 6.0}, REQ1], ":3: timestamps go backwards: request 1 at t=1 s arrives before request 0 at t=5 s"),
    ([HEADER, REQ1], "request ids must be 0..0"),
    ([HEADER, {**REQ0, "parent": 0}], "parent 0 is not an earlier request"),
    ([HEADER, REQ0, {**REQ1, "segments": [{"role": "user", "tokens": -3}]}], "a segment needs 'tokens' >= 0"),
    ([HEADER, {**REQ0, "status": 500}], "no request to replay"),
])
def test_bad_sessions_files_are_refused_with_the_line(lines, message, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(SessionFileError) as err:
        load(str(path))
    assert message in str(err.value)
    prefix = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["bench", "run", "--base-url", "http://127.0.0.1:1", "--model", "m", "--workload", "sessions",
              "--sessions-file", str(path), "--out", str(prefix)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))  # nothing written


@pytest.mark.parametrize("argv, message", [
    (["--workload", "sessions"], "needs --sessions-file"),
    (["--sessions-file", "x.jsonl"], "--sessions-file needs --workload sessions"),
    (["--workload", "sessions", "--sessions-file", "/nonexistent/x.jsonl"], "cannot read sessions file"),
])
def test_sessions_flags_must_go_together(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "run", "--base-url", "http://127.0.0.1:1", "--model", "m", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_record_refuses_an_existing_file_and_an_unreachable_upstream(tmp_path, capsys):
    out = tmp_path / "exists.jsonl"
    out.write_text("keep me\n")
    with pytest.raises(SystemExit) as exc:
        main(["record", "--upstream", "http://127.0.0.1:1", "--out", str(out)])
    assert exc.value.code == 2 and "exists; pass --force" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"
    missing = tmp_path / "new.jsonl"
    assert main(["record", "--upstream", f"http://127.0.0.1:{free_port()}", "--out", str(missing)]) == 1
    assert "cannot reach upstream" in capsys.readouterr().err and not missing.exists()


# --- the recorder's parts, without a server ---

def test_observed_parses_streams_split_anywhere():
    from quanta.bench.record import Observed

    openai_sse = (b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
                  b'data: {"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"length"}]}\n\n'
                  b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
                  b"data: [DONE]\n\n")
    anthropic_sse = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":3,'
                     b'"cache_read_input_tokens":5,"output_tokens":0}}}\n\n'
                     b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                     b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
                     b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
                     b'"usage":{"output_tokens":1}}\n\n'
                     b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    responses_sse = (b'event: response.created\ndata: {"type":"response.created","response":{"status":"in_progress",'
                     b'"usage":null}}\n\n'
                     b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"Hel"}\n\n'
                     b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"lo"}\n\n'
                     b'event: response.incomplete\ndata: {"type":"response.incomplete","response":{"status":"incomplete",'
                     b'"incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":9,'
                     b'"input_tokens_details":{"cached_tokens":6},"output_tokens":2,"total_tokens":11}}}\n\n')
    for raw, expected in [(openai_sse, ("Hello", 7, 2, 4, "length")), (anthropic_sse, ("Hi", 8, 1, 5, "max_tokens")),
                          (responses_sse, ("Hello", 9, 2, 6, "max_output_tokens"))]:
        obs = Observed("chat")
        obs.sse = True
        for i in range(0, len(raw), 7):  # 7-byte pieces cut lines and JSON in half
            obs.feed(raw[i:i + 7], now=float(i))
        obs.close(now=999.0)
        assert (obs.reply(), obs.prompt_tokens, obs.completion_tokens, obs.cached_tokens, obs.finish) == expected
        assert obs.first is not None and obs.first < 999.0
        assert obs.ended  # the last event was seen: complete even if the client closes before the upstream's EOF
        cut = Observed("chat")
        cut.sse = True
        cut.feed(raw[:len(raw) * 2 // 3], now=0.0)
        cut.close(now=1.0)
        assert not cut.ended  # cut before its last event: incomplete
    half = Observed("chat")
    half.feed(b'{"choices":[{"message":{"content":"Ye', 1.0)
    half.close(2.0)
    assert not half.ended
    obs = Observed("chat")  # a JSON body
    obs.feed(b'{"choices":[{"message":{"content":"Yes"},"finish_reason":"stop"}],"usage":{"prompt_tokens":4,"completion_tokens":1}}', 1.0)
    obs.close(2.0)
    assert (obs.reply(), obs.prompt_tokens, obs.first, obs.ended) == ("Yes", 4, 2.0, True)
    obs = Observed("responses")  # a Responses JSON body: its message's text, usage with cached tokens, status
    obs.feed(b'{"object":"response","status":"completed","incomplete_details":null,"output":[{"type":"function_call",'
             b'"arguments":"{}"},{"type":"message","content":[{"type":"output_text","text":"Yes"}]}],'
             b'"usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":3},"output_tokens":1}}', 1.0)
    obs.close(2.0)
    assert (obs.reply(), obs.prompt_tokens, obs.cached_tokens, obs.finish, obs.ended) == ("Yes", 5, 3, "completed", True)


def test_record_text_keeps_text_and_the_replay_sends_it(tmp_path):
    from quanta.bench.record import Observed, Recorder
    from quanta.bench.sessions import _Replay, replay_plan, replayed
    from quanta.bench.workloads import Workload

    out = tmp_path / "text.jsonl"
    rec = Recorder(out, "http://up", record_text=True)
    h = rec.begin("chat", "/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Hi there"}], "stream": True})
    obs = Observed("chat")
    obs.sse = True
    obs.feed(b'data: {"choices":[{"delta":{"content":"Hello!"}}],"usage":{"prompt_tokens":12,"completion_tokens":3}}\n\n', rec.now())
    rec.finish(h, 200, obs, complete=True)
    h2 = rec.begin("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "unfinished"}]})
    rec.close()  # still running at shutdown: written, incomplete
    header, recs = _records(out)
    assert header["record_text"] is True
    assert [s["text"] for s in recs[0]["segments"]] == ["Be brief.", "Hi there"] and recs[0]["reply"] == "Hello!"
    assert sum(s["tokens"] for s in recs[0]["segments"]) == 12
    assert recs[1]["id"] == h2 and recs[1]["complete"] is False and recs[1]["status"] is None
    assert [r.id for r in replayed(str(out))] == [0]

    class FakeRun:
        w = Workload(kind="sessions", sessions_file=str(out))

    msgs = _Replay(FakeRun(), replayed(str(out))).messages(replay_plan(str(out))[0])
    assert msgs[0]["role"] == "system" and msgs[0]["content"].endswith(" Be brief.") and msgs[1] == {"role": "user", "content": "Hi there"}


def test_upstream_failure_is_a_502_in_the_api_s_error_shape_and_recorded(tmp_path):
    from fastapi.testclient import TestClient

    from quanta.bench.record import Recorder, build_app

    out = tmp_path / "fail.jsonl"
    rec = Recorder(out, "http://127.0.0.1:1", record_text=False)
    with TestClient(build_app(f"http://127.0.0.1:{free_port()}", rec)) as client:
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 502 and r.json()["error"]["message"].startswith("upstream")
        r = client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 502 and r.json()["type"] == "error"
    _, recs = _records(out)
    assert [(r["status"], r["complete"], r["api"]) for r in recs] == [(502, False, "chat"), (502, False, "messages")]
