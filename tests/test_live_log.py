"""``quanta serve``'s live log: a line per finished request, a periodic stats line, ``--log-format json``."""

from __future__ import annotations

import json
import logging
import time

import openai
import pytest

from quanta.engine.output import RequestOutput
from quanta.engine.trace import StepRecord
from quanta.server.live_log import LiveLog

PROMPT = [{"role": "user", "content": "Count to twenty."}]


def _out(seq_id: int, t: float, tokens: int, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput(seq_id, [7], "x", finished, reason, num_prompt_tokens=100, num_output_tokens=tokens,
                         time=t, arrival_time=0.0, num_cached_tokens=40)


def test_a_request_is_logged_whether_its_route_names_it_before_or_after_it_finishes(caplog):
    live = LiveLog(lambda: 0, lambda: 0, 8, lambda: 0.0)
    caplog.set_level(logging.INFO, "quanta.requests")
    live.label(1, "chatcmpl-early", "/v1/chat/completions")
    for seq_id in (1, 2):
        live.observe_output(_out(seq_id, 0.5, 1))
        live.observe_output(_out(seq_id, 2.5, 11, finished=True, reason="length"))
    assert [r.fields["id"] for r in caplog.records] == ["chatcmpl-early"]
    live.label(2, "msg_late", "/v1/messages")
    late = caplog.records[-1].fields
    assert late == {"id": "msg_late", "route": "/v1/messages", "prompt_tokens": 100, "cached_tokens": 40,
                    "generated_tokens": 11, "ttft_s": 0.5, "decode_tok_s": 5.0, "e2e_s": 2.5, "finish_reason": "length"}


def test_stats_count_prompt_and_generated_tokens_per_interval():
    now = [0.0]
    live = LiveLog(lambda: 1, lambda: 2, 8, lambda: now[0])
    live.observe_step(StepRecord(0, "mixed", 0.0, 1.0, [1, 2, 3], [512, 1, 300], [0, 1, 1]))
    live.observe_output(_out(1, 1.0, 1))
    now[0] = 2.0
    fields = live.stats_fields()
    assert fields["prompt_tok_s"] == 406.0 and fields["generation_tok_s"] == 1.0  # (512 + 300) / 2 s; 2 emitted / 2 s
    assert (fields["running"], fields["waiting"], fields["kv_slots_used"], fields["kv_slots"]) == (1, 2, 1, 8)
    assert fields["prefix_cache_hit_rate"] == 0.4
    assert fields["step_running_s"] is None  # no engine given (the running step: tests/test_stream_liveness.py)
    assert fields["kv_blocks"] is None  # no pool given: no block counts
    idle = LiveLog(lambda: 0, lambda: 0, 8, lambda: now[0])
    assert idle.stats_fields() is None  # nothing ran, waited or was computed: no line


def test_stats_line_reports_the_kv_pool_blocks(caplog):
    blocks = {"used": 5, "cached": 3, "free": 92, "total": 100, "preemptions": 0}
    live = LiveLog(lambda: 1, lambda: 0, 8, lambda: 1.0, lambda: blocks)
    fields = live.stats_fields()
    assert (fields["kv_blocks_used"], fields["kv_blocks_cached"], fields["kv_blocks"]) == (5, 3, 100)
    with caplog.at_level(logging.INFO, logger="quanta.stats"):
        live.write_stats()
    assert "KV blocks 5/100 in use (3 cached)" in caplog.text


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=120, max_retries=0)


def _wait_for(server, predicate, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate(server.log())
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"not in the log after {timeout} s:\n{server.log_tail()}")


def test_a_finished_request_writes_its_line(server):
    reply = _client(server).chat.completions.create(model=server.model, messages=PROMPT, max_tokens=5, temperature=0)
    line = _wait_for(server, lambda log: next((ln for ln in log.splitlines() if reply.id in ln and "quanta.requests" in ln), None))
    assert "/v1/chat/completions" in line and f"generated {reply.usage.completion_tokens}," in line, line
    assert f"prompt {reply.usage.prompt_tokens} " in line and "ttft" in line and "finish" in line, line


@pytest.fixture(scope="module")
def json_server(launch_server):
    handle = launch_server("--max-model-len", "512", "--log-format", "json", "--stats-interval", "1")
    yield handle
    handle.stop()


def test_json_log_lines_parse_and_carry_the_request_and_stats_fields(json_server):
    client = _client(json_server)
    chunks = list(client.chat.completions.create(model=json_server.model, messages=PROMPT, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage, reply_id = chunks[-1].usage, chunks[0].id

    def records(log: str):
        lines = [json.loads(ln) for ln in log.splitlines() if ln.strip()]  # every line is JSON
        mine = [r for r in lines if r["logger"] == "quanta.requests" and r["fields"]["id"] == reply_id]
        stats = [r for r in lines if r["logger"] == "quanta.stats" and r["fields"]["generation_tok_s"] > 0]
        return (mine, stats) if mine and stats else None

    mine, stats = _wait_for(json_server, records)
    fields = mine[0]["fields"]
    assert fields["route"] == "/v1/chat/completions" and fields["finish_reason"] == "length"
    assert (fields["prompt_tokens"], fields["generated_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert fields["ttft_s"] > 0
    assert {"prompt_tok_s", "running", "waiting", "kv_slots_used", "kv_slots", "prefix_cache_hit_rate"} <= set(stats[0]["fields"])
    assert any(json.loads(ln)["logger"] == "uvicorn.access" for ln in json_server.log().splitlines() if ln.strip())
