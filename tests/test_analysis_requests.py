"""Client-side figures from hand-made request samples with known answers."""

import math

import pytest

from quanta.analysis.requests import (
    RequestSample,
    client_intervals,
    client_metrics,
    gaps_overlapping,
    probe_metrics,
    request_latencies,
    token_times,
)
from quanta.analysis.scrape import by_kind, parse_prometheus, scrape_deltas, scrape_overlap


def sample(i, chunks, tokens, scheduled=0.0, sent=None, done=None, error=None, tag="", prompt=10):
    return RequestSample(id=i, scheduled=scheduled, sent=scheduled if sent is None else sent, chunks=[list(c) for c in chunks],
                         done=done if done is not None else (chunks[-1][0] if chunks else scheduled),
                         prompt_tokens=prompt, completion_tokens=tokens, error=error, tag=tag)


def test_one_token_per_chunk():
    s = sample(0, [(1.0, 3), (1.2, 5), (1.6, 2)], 3)
    assert token_times(s) == ([1.0, 1.2, 1.6], False)


def test_a_chunk_with_several_tokens_is_several_tokens():
    # 3 tokens (usage) in 2 chunks: 4 and 8 characters -> token 1 in chunk 1, tokens 2-3 in chunk 2
    s = sample(0, [(1.0, 4), (1.5, 8)], 3)
    times, estimated = token_times(s)
    assert times == [1.0, 1.5, 1.5] and estimated
    lat = request_latencies(s)
    assert lat["itl"] == pytest.approx([0.5, 0.0])
    assert lat["tpot"] == pytest.approx(0.25)  # (1.5 - 1.0) / (3 - 1), from usage not from 2 chunks


def test_missing_usage_falls_back_to_chunks_and_says_so():
    s = sample(0, [(1.0, 1), (2.0, 1)], None)
    assert token_times(s) == ([1.0, 2.0], True)
    assert client_metrics([s])["num_missing_usage"] == 1


def test_latencies_count_from_the_scheduled_time():
    # scheduled at 0, the client only sent it at 0.5: TTFT includes that queueing
    s = sample(0, [(1.0, 1), (1.2, 1), (1.6, 1)], 3, scheduled=0.0, sent=0.5, done=1.7)
    lat = request_latencies(s)
    assert lat["ttft"] == pytest.approx(1.0)
    assert lat["e2e"] == pytest.approx(1.7)
    assert lat["queue"] == pytest.approx(0.5)
    assert lat["tpot"] == pytest.approx(0.3)
    assert lat["itl"] == pytest.approx([0.2, 0.4])


def test_client_metrics_pool_itl_and_count_failures_per_condition():
    ok1 = sample(0, [(1.0, 1), (1.1, 1), (1.3, 1)], 3, done=1.3)
    ok2 = sample(1, [(2.0, 1), (2.4, 1)], 2, scheduled=1.0, done=2.5)
    bad1 = sample(2, [], None, error="unreachable")
    bad2 = sample(3, [(0.5, 1)], None, error="truncated")
    bad3 = sample(4, [], None, error="unreachable")
    m = client_metrics([ok1, ok2, bad1, bad2, bad3])
    assert m["num_requests"] == 5 and m["num_ok"] == 2 and m["num_failed"] == 3
    assert m["errors"] == {"truncated": 1, "unreachable": 2}
    assert m["itl"]["n"] == 3
    assert m["itl"]["mean"] == pytest.approx((0.1 + 0.2 + 0.4) / 3)
    assert m["itl"]["max"] == pytest.approx(0.4)
    assert m["ttft"]["n"] == 2 and m["ttft"]["max"] == pytest.approx(1.0)
    assert m["output_tokens"] == 5
    assert m["wall"] == pytest.approx(2.5)  # first scheduled (0) to last end (2.5)
    assert m["throughput"] == pytest.approx(2.0)
    prefill, decode = client_intervals([ok1, ok2, bad1])
    assert prefill == [(0.0, 1.0), (1.0, 2.0)] and decode == [(1.0, 1.3), (2.0, 2.4)]


def test_probe_prefill_rate_and_itl_of_the_other_sessions_during_the_probe():
    probe = sample(9, [(4.0, 2)], 1, scheduled=2.0, sent=2.0, tag="probe", prompt=1000)
    other = sample(1, [(1.0, 1), (1.5, 1), (2.5, 1), (4.5, 1), (5.0, 1)], None, tag="session")
    assert gaps_overlapping([1.0, 1.5, 2.5, 4.5, 5.0], (2.0, 4.0)) == pytest.approx([1.0, 2.0])
    p = probe_metrics(probe, [other])
    assert p["ttft"] == pytest.approx(2.0)
    assert p["prefill_tok_s"] == pytest.approx(500.0)
    assert p["itl_during"]["n"] == 2 and p["itl_during"]["max"] == pytest.approx(2.0)
    assert p["itl_outside"]["n"] == 2 and p["itl_outside"]["max"] == pytest.approx(0.5)
    failed = probe_metrics(sample(9, [], None, error="timeout"), [other])
    assert not failed["ok"] and math.isnan(failed["prefill_tok_s"])


PROM = """\
# HELP quanta:engine_step_seconds_total Busy time of executed steps by kind.
# TYPE quanta:engine_step_seconds_total counter
quanta:engine_step_seconds_total{kind="prefill"} 2.5
quanta:engine_step_seconds_total{kind="decode"} 7.25
quanta:engine_steps_total{kind="prefill"} 3.0
quanta:inter_token_latency_seconds_bucket{le="0.001"} 0.0
quanta:num_requests_running 4.0
garbage line
"""


def test_prometheus_parsing():
    samples = parse_prometheus(PROM)
    assert ("quanta:num_requests_running", {}, 4.0) in samples
    assert by_kind(samples, "engine_step_seconds_total") == {"prefill": 2.5, "decode": 7.25}
    assert by_kind(samples, "engine_steps_total") == {"prefill": 3.0}
    assert by_kind(parse_prometheus("vllm:foo 1\n"), "engine_steps_total") == {}


def test_scrape_overlap_counts_prefill_in_windows_with_decode():
    scrapes = [
        {"t": 0, "busy": {"prefill": 0.0, "decode": 0.0}},
        {"t": 15, "busy": {"prefill": 2.0, "decode": 10.0}},   # prefill 2 s with decode
        {"t": 30, "busy": {"prefill": 2.0, "decode": 20.0}},   # decode only
        {"t": 45, "busy": {"prefill": 5.0, "decode": 20.0}},   # prefill 3 s alone
    ]
    assert scrape_overlap(scrapes) == pytest.approx(0.4)
    assert scrape_deltas(scrapes)[0] == {"t0": 0, "t1": 15, "prefill": 2.0, "decode": 10.0}
    # a mixed step is both prefill and decode time
    mixed = [{"t": 0, "busy": {"mixed": 0.0}}, {"t": 1, "busy": {"mixed": 1.0}}]
    assert scrape_overlap(mixed) == pytest.approx(1.0)
    assert math.isnan(scrape_overlap(scrapes[:1]))


def test_throughput_counts_the_tokens_of_streams_stopped_before_their_usage():
    """A probe run: the sessions the workload cancels never get their usage; their streamed tokens
    count in the run's throughput beside the probe's own."""
    probe = sample(9, [(3.0, 2), (3.5, 2)], 2, scheduled=2.0, done=3.5, tag="probe")
    session = sample(1, [(0.5 * i, 1) for i in range(1, 9)], None, tag="session", done=4.0)
    session.finish_reason = "client_cancel"
    m = client_metrics([probe, session])
    assert m["output_tokens"] == 2 + 8
    assert m["throughput"] == pytest.approx(10 / 4.0)
