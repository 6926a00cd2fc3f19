"""Prometheus text parsing and figures from periodic ``/metrics`` scrapes.

A scrape every ``S`` seconds of ``quanta:engine_step_seconds_total{kind}``
(busy seconds by step kind) gives per-window busy deltas. The scrape-based
overlap ratio is the share of prefill busy time that fell in windows where
decode was busy too: coarse (a window of 15 s, as seed 000 used, calls most
prefill "overlapped"), but available without a trace. A ``mixed`` step
counts as both prefill and decode time.

A window holding both phases counts all its prefill as overlapped, so the
figure is only meaningful when windows are short against the run: it is
reported when the run spans at least :data:`MIN_WINDOWS` scrape windows
(each at most a tenth of the run), else n/a with the reason
(:func:`resolved_scrape_overlap`). Even then, phases that alternate faster than
the window are counted as overlapped: the trace's overlap is the exact one.
"""

from __future__ import annotations

import math
import re

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

STEP_SECONDS = "engine_step_seconds_total"
STEPS = "engine_steps_total"
#: scrape windows a run must span before its scraped overlap is reported
MIN_WINDOWS = 10


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of every sample line; comments and malformed lines skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), value))
    return out


def by_kind(samples: list[tuple[str, dict[str, str], float]], suffix: str) -> dict[str, float]:
    """``kind`` label -> value for metrics whose name ends with ``:suffix``
    (any prefix: ``quanta:``, ``vllm:``...). Empty when the server has none."""
    return {labels["kind"]: v for name, labels, v in samples if name.endswith(":" + suffix) and "kind" in labels}


def scrape_deltas(scrapes: list[dict]) -> list[dict]:
    """Per window between consecutive scrapes (``{"t", "busy": {kind: s}}``):
    ``{"t0", "t1", "prefill", "decode"}`` busy-second deltas, mixed in both."""
    out = []
    for a, b in zip(scrapes, scrapes[1:]):
        d = {k: b["busy"].get(k, 0.0) - a["busy"].get(k, 0.0) for k in set(a["busy"]) | set(b["busy"])}
        mixed = d.get("mixed", 0.0)
        out.append({"t0": a["t"], "t1": b["t"], "prefill": d.get("prefill", 0.0) + mixed, "decode": d.get("decode", 0.0) + mixed})
    return out


def scrape_overlap(scrapes: list[dict]) -> float:
    """Share of prefill busy time in windows that also had decode busy time
    (0..1); NaN with fewer than two scrapes or no prefill time."""
    windows = scrape_deltas(scrapes)
    total = sum(w["prefill"] for w in windows)
    if total <= 0:
        return math.nan
    return sum(w["prefill"] for w in windows if w["decode"] > 0) / total


def resolved_scrape_overlap(scrapes: list[dict]) -> tuple[float, str | None]:
    """``(overlap, None)`` when the scrapes resolve it (:data:`MIN_WINDOWS` windows at least), else
    ``(NaN, reason)`` naming how many windows there were."""
    windows = max(0, len(scrapes) - 1)
    if not scrapes:
        return math.nan, "no /metrics scrapes (--scrape S, quanta-style step metrics)"
    if windows < MIN_WINDOWS:
        span = scrapes[-1]["t"] - scrapes[0]["t"]
        return math.nan, (f"{windows} scrape window{'s' * (windows != 1)} over {span:.1f} s; at least {MIN_WINDOWS} "
                          "are needed to tell the phases apart (scrape more often)")
    value = scrape_overlap(scrapes)
    return (value, None) if not math.isnan(value) else (value, "no prefill time between the scrapes")
