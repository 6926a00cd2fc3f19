"""Server-side figures from hand-made engine traces with known answers."""

import json
import math

import pytest

from quanta.analysis.server_trace import (
    decoding_intervals,
    emission_times,
    load_trace_file,
    phase_split,
    step_counts,
    trace_itl,
    trace_metrics,
)


def _scrapes_from_trace(records: list[dict], every: float) -> list[dict]:
    """The scrapes of cumulative busy seconds by step kind a scraper every ``every`` seconds would
    have read (from the first step start to past the last step end), from a trace's step records;
    a step counts at its end. For checking the scraped figure against the trace's own."""
    records = sorted(records, key=lambda r: r["end"])
    if not records:
        return []
    t, end, i, busy, out = min(r["start"] for r in records), records[-1]["end"], 0, {}, []
    while True:
        while i < len(records) and records[i]["end"] <= t:
            busy[records[i]["kind"]] = busy.get(records[i]["kind"], 0.0) + records[i]["end"] - records[i]["start"]
            i += 1
        out.append({"t": t, "busy": dict(busy)})
        if t >= end:
            return out
        t += every


def rec(step, kind, start, end, seqs, new, emitted):
    return {"step": step, "kind": kind, "start": start, "end": end, "seq_ids": seqs, "num_new_tokens": new, "num_emitted": emitted}


#: A (seq 0) prefills and decodes once; B's 20-token prefill stalls A for 1 s; then both decode.
STALL_TRACE = [
    rec(0, "prefill", 0.0, 1.0, [0], [10], [1]),        # A's first token at 1.0
    rec(1, "decode", 1.0, 1.1, [0], [1], [1]),          # A at 1.1
    rec(2, "prefill", 1.1, 2.1, [1], [20], [1]),        # B's first token at 2.1; A waits
    rec(3, "decode", 2.1, 2.3, [0, 1], [1, 1], [1, 1]),  # A at 2.3, B at 2.3
    rec(4, "decode", 2.3, 2.4, [0, 1], [1, 1], [1, 1]),  # A at 2.4, B at 2.4
]


def test_itl_is_measured_from_the_previous_emission_of_the_same_request():
    assert emission_times(STALL_TRACE) == {0: [1.0, 1.1, 2.3, 2.4], 1: [2.1, 2.3, 2.4]}
    itl = sorted(trace_itl(STALL_TRACE))
    assert itl == pytest.approx(sorted([0.1, 1.2, 0.1, 0.2, 0.1]))
    assert max(itl) == pytest.approx(1.2)  # the prefill stall shows up in A's gap


def test_measuring_from_the_previous_step_of_any_kind_would_hide_the_stall():
    # the wrong method (seed 002's first measurement): gap from the previous step's end
    naive = [r["end"] - prev["end"] for prev, r in zip(STALL_TRACE, STALL_TRACE[1:]) if r["kind"] == "decode" for _ in r["seq_ids"]]
    assert max(naive) == pytest.approx(0.2)
    assert max(trace_itl(STALL_TRACE)) > 5 * max(naive)


def test_counts_rates_occupancy_and_overlap():
    m = trace_metrics(STALL_TRACE)
    assert m["steps"] == {"prefill": 2, "decode": 3, "mixed": 0}
    assert m["prefill_tokens"] == 30 and m["decode_tokens"] == 5
    assert m["prefill_busy"] == pytest.approx(2.0)
    assert m["prefill_rate"] == pytest.approx(15.0)
    assert m["decode_busy"] == pytest.approx(0.4)
    assert m["decode_rate"] == pytest.approx(12.5)
    assert m["wall"] == pytest.approx(2.4)
    assert m["occupancy"] == pytest.approx(1.0)
    assert m["prefill_occupancy"] == pytest.approx(2.0 / 2.4)
    # A decodes over [1.0, 2.4]: B's prefill (1.1-2.1) overlaps it, A's own prefill (0-1) does not
    assert decoding_intervals(STALL_TRACE) == [(1.0, 2.4), (2.1, 2.4)]
    assert m["overlap"] == pytest.approx(0.5)
    assert m["itl"]["n"] == 5 and m["itl"]["max"] == pytest.approx(1.2)


def test_mixed_steps_count_as_prefill_and_decode():
    trace = [
        rec(0, "prefill", 0.0, 0.5, [0], [8], [1]),
        rec(1, "mixed", 0.5, 1.0, [0, 1], [1, 6], [1, 0]),  # A decodes, B prefills its first 6 tokens
        rec(2, "mixed", 1.0, 1.5, [0, 1], [1, 2], [1, 1]),  # B's last 2 prompt tokens, first token
        rec(3, "decode", 1.5, 1.75, [0, 1], [1, 1], [1, 1]),
    ]
    split = phase_split(trace)
    assert split["prefill_tokens"] == 16 and split["decode_tokens"] == 4
    assert split["prefill_intervals"] == [(0.0, 0.5), (0.5, 1.0), (1.0, 1.5)]
    assert split["decode_intervals"] == [(0.5, 1.0), (1.0, 1.5), (1.5, 1.75)]
    assert step_counts(trace) == {"prefill": 1, "decode": 1, "mixed": 2}
    m = trace_metrics(trace)
    assert m["prefill_rate"] == pytest.approx(16 / 1.5)
    assert m["overlap"] == pytest.approx(1.0 / 1.5)  # A was decoding during both mixed steps
    assert sorted(trace_itl(trace)) == pytest.approx(sorted([0.5, 0.5, 0.25, 0.25]))


def test_empty_trace_and_trace_files(tmp_path):
    m = trace_metrics([])
    assert m["steps"] == {"prefill": 0, "decode": 0, "mixed": 0} and math.isnan(m["overlap"])
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in STALL_TRACE) + "\n")
    assert load_trace_file(str(jsonl)) == STALL_TRACE
    wrapped = tmp_path / "t.json"
    wrapped.write_text(json.dumps({"records": STALL_TRACE}))
    assert load_trace_file(str(wrapped)) == STALL_TRACE


# --------------------------------------------------------------------------- scraped overlap vs the trace's


def _static_trace():
    """8 requests prefilled in one 2-s call, then 180 decode steps of 0.1 s: nothing decodes during prefill."""
    recs = [rec(0, "prefill", 0.0, 2.0, list(range(8)), [32] * 8, [1] * 8)]
    for i in range(180):
        recs.append(rec(i + 1, "decode", 2.0 + 0.1 * i, 2.1 + 0.1 * i, list(range(8)), [1] * 8, [1] * 8))
    return recs


def _interleaved_trace():
    """A decodes for 20 s; 10 other requests' 0.2-s prefills land between its decode steps (all overlapped)."""
    recs, t, step = [rec(0, "prefill", 0.0, 0.2, [0], [16], [1])], 0.2, 1
    for i in range(180):
        recs.append(rec(step, "decode", t, t + 0.1, [0], [1], [1]))
        t, step = t + 0.1, step + 1
        if i % 18 == 9:
            recs.append(rec(step, "prefill", t, t + 0.2, [100 + i], [16], [1]))
            recs.append(rec(step + 1, "decode", t + 0.2, t + 0.3, [0, 100 + i], [1, 1], [1, 1]))
            t, step = t + 0.3, step + 2
    return recs


@pytest.mark.parametrize("make, truth", [(_static_trace, 0.0), (_interleaved_trace, 10 / 11)])
def test_scraped_overlap_is_reported_only_when_enough_windows_resolve_it(make, truth):
    from quanta.analysis.scrape import MIN_WINDOWS, resolved_scrape_overlap

    records = make()
    assert trace_metrics(records)["overlap"] == pytest.approx(truth)
    coarse, why = resolved_scrape_overlap(_scrapes_from_trace(records, 15.0))  # seed 000's 15 s over a ~20 s run
    assert math.isnan(coarse) and why.startswith("2 scrape windows over") and f"at least {MIN_WINDOWS}" in why
    fine, why = resolved_scrape_overlap(_scrapes_from_trace(records, 1.0))
    assert why is None and fine == pytest.approx(truth, abs=0.1)  # an upper bound: a window with both phases counts whole


def test_the_report_says_why_the_scraped_overlap_is_missing():
    from quanta.analysis.requests import RequestSample
    from quanta.bench.runner import compute_metrics

    s = RequestSample(id=0, scheduled=0.0, sent=0.0, chunks=[[2.0, 1.0], [2.1, 1.0]], done=2.1, completion_tokens=2)
    m = compute_metrics([s], _static_trace(), _scrapes_from_trace(_static_trace(), 15.0), "burst")
    assert math.isnan(m["scrape_overlap"]) and "2 scrape windows" in m["scrape_overlap_note"]
    assert compute_metrics([s], None, [], "burst")["scrape_overlap_note"].startswith("no /metrics scrapes")


def test_replica_traces_merge_into_one_servers_shape_and_feed_a_runs_figures():
    from quanta.analysis.server_trace import merge_replica_traces, trace_itl
    from quanta.bench.runner import run_trace

    def rec(step, start, sid, emitted):
        return {"step": step, "kind": "decode", "start": start, "end": start + 0.01, "seq_ids": [sid],
                "num_new_tokens": [1], "num_emitted": [emitted]}

    a = [rec(0, 0.00, 0, 1), rec(1, 0.05, 0, 1)]  # replica 0: its sequence 0, gap 0.05
    b = [rec(0, 0.01, 0, 1), rec(1, 0.03, 0, 1)]  # replica 1: its own sequence 0, gap 0.02
    merged = merge_replica_traces([a, b])
    assert [(r["replica"], r["seq_ids"]) for r in merged] == [(0, [0]), (1, [1]), (1, [1]), (0, [0])]
    assert sorted(round(g, 6) for g in trace_itl(merged)) == [0.02, 0.05]  # each replica's sequence keeps its own gaps
    assert run_trace({"trace": None, "replica_traces": [a, b]}) == merged
    assert run_trace({"trace": None, "replica_traces": [a, None]}) is None  # a replica that did not answer: no figures
    assert run_trace({"trace": a}) is a and run_trace({"trace": None}) is None
