"""Figures from quanta's engine trace (``GET /v1/trace`` or a JSONL dump).

A record is one executed step: ``step``, ``kind`` (prefill/decode/mixed),
``start``/``end`` (server monotonic seconds), ``seq_ids``, ``num_new_tokens``
and ``num_emitted`` per sequence (see :class:`quanta.engine.trace.StepRecord`).

Server-side ITL is measured for each request from the end of the previous
step that *emitted a token for that request* to the end of the step that
emitted the next one. Measuring from the previous step of any kind (what seed
002's first measurement did) would cut a prefill stall out of the gap it
delays, hiding every stall.

A sequence's tokens are prefill tokens until it emits its first token, decode
tokens afterwards; a ``mixed`` step counts as both prefill and decode time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator

from quanta.analysis.intervals import Interval, busy_rate, occupancy, overlap_ratio, union_length
from quanta.analysis.stats import summarize


def load_trace_file(path: str) -> list[dict]:
    """Records from a JSONL file (one record per line) or a JSON file holding a
    list or ``{"records": [...]}``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("[") or stripped.startswith("{\"records\""):
        data = json.loads(text)
        return data["records"] if isinstance(data, dict) else data
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def merge_replica_traces(traces: list[list[dict]]) -> list[dict]:
    """One trace of N replicas' own traces, shaped as one server's: each record gains ``replica``, its
    sequence ids become ``seq_id * N + replica`` (distinct across replicas; in ``arrivals`` too), records
    ordered by start."""
    n = len(traces)
    merged = [{**rec, "replica": i, "seq_ids": [s * n + i for s in rec["seq_ids"]],
               **({"arrivals": [[a[0] * n + i, *a[1:]] for a in rec["arrivals"]]} if rec.get("arrivals") else {})}
              for i, records in enumerate(traces) for rec in records]
    return sorted(merged, key=lambda rec: (rec["start"], rec["replica"]))


def emission_times(records: Iterable[dict]) -> dict[int, list[float]]:
    """Sequence id -> end time of each step that emitted one of its tokens (a
    step emitting ``k`` tokens for it contributes ``k`` entries)."""
    out: dict[int, list[float]] = {}
    for r in sorted(records, key=lambda r: r["step"]):
        for sid, emitted in zip(r["seq_ids"], r["num_emitted"]):
            if emitted:
                out.setdefault(sid, []).extend([r["end"]] * emitted)
    return out


def trace_itl(records: Iterable[dict]) -> list[float]:
    """Pooled ITL samples (seconds): per sequence, gaps between consecutive emissions."""
    return [b - a for times in emission_times(records).values() for a, b in zip(times, times[1:])]


def step_counts(records: Iterable[dict]) -> dict[str, int]:
    """Steps by kind: ``{"prefill", "decode", "mixed"}``."""
    counts = {"prefill": 0, "decode": 0, "mixed": 0}
    for r in records:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    return counts


def trace_entries(records: Iterable[dict]) -> Iterator[tuple[dict, list[tuple[int, int, int, bool, int]]]]:
    """Each record in step order with its entries ``(seq_id, position, num_new_tokens, is_decode, num_emitted)``.

    ``position``: the sequence's tokens computed in earlier records of the trace; ``is_decode``: the
    sequence had emitted a token before this record (its tokens are prefill until its first emission).
    """
    computed: dict[int, int] = {}
    decoding: set[int] = set()
    for r in sorted(records, key=lambda r: r["step"]):
        row = []
        for sid, new, emitted in zip(r["seq_ids"], r["num_new_tokens"], r["num_emitted"]):
            pos = computed.get(sid, 0)
            row.append((sid, pos, new, sid in decoding, emitted))
            computed[sid] = pos + new
            if emitted:
                decoding.add(sid)
        yield r, row


def phase_split(records: Iterable[dict]) -> dict:
    """Tokens and busy intervals by phase.

    Returns ``prefill_tokens`` / ``decode_tokens`` (new tokens computed in each
    phase) and ``prefill_intervals`` / ``decode_intervals`` (``[start, end]``
    of the steps that carried any token of that phase).
    """
    out = {"prefill_tokens": 0, "decode_tokens": 0, "prefill_intervals": [], "decode_intervals": []}
    for r, row in trace_entries(records):
        has = {"prefill": False, "decode": False}
        for _, _, new, is_decode, _ in row:
            phase = "decode" if is_decode else "prefill"
            out[f"{phase}_tokens"] += new
            has[phase] = has[phase] or new > 0
        for phase in ("prefill", "decode"):
            if has[phase]:
                out[f"{phase}_intervals"].append((r["start"], r["end"]))
    return out


def decoding_intervals(records: Iterable[dict]) -> list[Interval]:
    """Per sequence, ``[first emission, last emission]``: the span in which it
    was decoding and any other step delayed its next token."""
    return [(t[0], t[-1]) for t in emission_times(records).values() if len(t) > 1]


def trace_metrics(records: list[dict]) -> dict:
    """All trace figures of one run.

    Keys: ``steps`` (counts by kind), ``itl`` (summary, seconds),
    ``prefill_tokens``, ``decode_tokens``, ``prefill_busy`` / ``decode_busy``
    (union seconds), ``prefill_rate`` / ``decode_rate`` (tokens per busy
    second), ``wall`` (first step start to last step end), ``occupancy``
    (any step busy / wall), ``prefill_occupancy``, ``decode_occupancy`` and
    ``overlap`` (share of prefill time during which another request was
    decoding, 0..1).
    """
    records = list(records)
    split = phase_split(records)
    p_iv, d_iv = split["prefill_intervals"], split["decode_intervals"]
    wall = (max(r["end"] for r in records) - min(r["start"] for r in records)) if records else 0.0
    all_iv = [(r["start"], r["end"]) for r in records]
    return {
        "steps": step_counts(records),
        "itl": summarize(trace_itl(records)),
        "prefill_tokens": split["prefill_tokens"],
        "decode_tokens": split["decode_tokens"],
        "prefill_busy": union_length(p_iv),
        "decode_busy": union_length(d_iv),
        "prefill_rate": busy_rate(split["prefill_tokens"], p_iv),
        "decode_rate": busy_rate(split["decode_tokens"], d_iv),
        "wall": wall,
        "occupancy": occupancy(all_iv, wall),
        "prefill_occupancy": occupancy(p_iv, wall),
        "decode_occupancy": occupancy(d_iv, wall),
        "overlap": overlap_ratio(p_iv, decoding_intervals(records)) if p_iv else math.nan,
    }
