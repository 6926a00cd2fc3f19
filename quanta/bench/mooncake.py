"""Request traces in the Mooncake format (``--workload trace --trace FILE``).

One JSON object a line (the public traces of the Mooncake paper, FAST'25,
``kvcache-ai/Mooncake`` ``FAST25-release/traces/``; GuideLLM's ``mooncake``
data kind)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp``: ms from the trace start (non-decreasing); ``input_length`` /
``output_length``: tokens; ``hash_ids``: ids of the prompt's 512-token
blocks, equal ids meaning an equal block (so shared prefixes can be rebuilt).

Replay: a window of ``limit`` requests from line ``start`` (0-based); request
``i`` is scheduled ``(timestamp_i - timestamp_start) / 1000 * time_scale``
seconds into the run (``time_scale`` 2: arrivals twice as far apart); prompt
and output lengths are ``round(length * length_scale)`` (at least 1) and so is
the block, ``max(1, round(512 * length_scale))`` tokens, so the block
structure (and the share of reused blocks) is kept at any scale. Outputs are
exact: ``max_tokens`` = the (scaled) output length with ``ignore_eos``.

Equal hash ids give equal token blocks: block ``h`` is drawn from a generator
seeded with ``(salt, h)``; prompt tokens past the last block (a trace whose
``input_length`` exceeds its blocks) are unique to the request. The bench
client sends a block as words of :data:`quanta.bench.prompts.WORDS` (about
one token each) with a fresh salt per run, so one run's blocks never hit the
cache of an earlier run; the simulator sends token ids, salted by the seed.
"""

from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from quanta.bench.prompts import WORDS

#: tokens per hash block of the Mooncake traces
BLOCK_TOKENS = 512
FIELDS = {"timestamp": "ms from the trace start", "input_length": "prompt tokens", "output_length": "output tokens",
          "hash_ids": "ids of 512-token prompt blocks"}


class TraceError(ValueError):
    """A trace file that cannot be replayed (unreadable, a missing or malformed field, time going backwards)."""


@dataclass(frozen=True)
class TraceRequest:
    """One replayed request: ``t`` seconds into the run (scaled), lengths in tokens (scaled)."""

    index: int
    t: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def block_tokens(length_scale: float) -> int:
    """Tokens per block at ``length_scale`` (512 at 1)."""
    return max(1, round(BLOCK_TOKENS * length_scale))


def _field(obj: dict, key: str, where: str):
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r} ({FIELDS[key]}); every line needs {', '.join(FIELDS)}")
    v = obj[key]
    if key == "hash_ids":
        if not isinstance(v, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in v):
            raise TraceError(f"{where}: hash_ids must be a list of integers, got {str(v)[:60]}")
        return tuple(v)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if key == "timestamp" and not (ok and v >= 0):
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {v!r}")
    if key != "timestamp" and not (ok and float(v).is_integer() and v >= 1):
        raise TraceError(f"{where}: {key} must be a positive integer, got {v!r}")
    return v if key == "timestamp" else int(v)


@functools.lru_cache(maxsize=8)
def load(path: str, start: int = 0, limit: int | None = None, time_scale: float = 1.0,
         length_scale: float = 1.0) -> tuple[TraceRequest, ...]:
    """The replayed window of a Mooncake trace (every line up to the window's end is checked).

    Raises:
        TraceError: unreadable file, a line that is not a JSON object, a missing or malformed field,
            a timestamp earlier than the line before, or an empty window.
    """
    try:
        f = Path(path).open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    out, prev = [], -math.inf
    end = math.inf if limit is None else start + limit
    with f:
        for i, line in enumerate(f):
            if i >= end:
                break
            where = f"{path}, line {i + 1}"
            if not line.strip():
                raise TraceError(f"{where}: empty line")
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise TraceError(f"{where}: not JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            ts = _field(obj, "timestamp", where)
            if ts < prev:
                raise TraceError(f"{where}: timestamp {ts} is earlier than the line before ({prev}); "
                                 "a trace's timestamps must not decrease")
            prev = ts
            if i < start:
                continue
            if not out:
                t0 = ts
            out.append(TraceRequest(i, (ts - t0) / 1000.0 * time_scale,
                                    max(1, round(_field(obj, "input_length", where) * length_scale)),
                                    max(1, round(_field(obj, "output_length", where) * length_scale)),
                                    _field(obj, "hash_ids", where)))
    if not out:
        raise TraceError(f"{path}: the window --start {start} --limit {limit} holds no request")
    return tuple(out)


def _blocks(r: TraceRequest, block: int) -> list[tuple[int | None, int]]:
    """``(hash id or None for request-unique filler, tokens)`` pieces of the prompt of ``r``."""
    pieces, left = [], r.prompt_tokens
    for h in r.hash_ids:
        if left <= 0:
            break
        pieces.append((h, min(block, left)))
        left -= block
    if left > 0:
        pieces.append((None, left))
    return pieces


def _draw(r: TraceRequest, block: int, salt, pick) -> list:
    """``pick(rng)`` once per prompt token of ``r``; a block's generator is seeded by ``(salt, hash id)``, so
    equal ids draw equal blocks (a partial block is the start of the full one)."""
    out: list = []
    for h, n in _blocks(r, block):
        rng = random.Random(f"{salt}:{h}" if h is not None else f"{salt}:unique:{r.index}")
        out += [pick(rng) for _ in range(n)]
    return out


def prompt_ids(r: TraceRequest, block: int, salt, vocab: int) -> list[int]:
    """Token ids (1..vocab-1) of the prompt of ``r``: equal hash ids give equal blocks under one ``salt``."""
    return _draw(r, block, salt, lambda rng: rng.randrange(1, vocab))


def prompt_text(r: TraceRequest, block: int, salt) -> str:
    """The prompt of ``r`` as words (about one token each): equal hash ids give equal word blocks."""
    return " ".join(_draw(r, block, salt, lambda rng: rng.choice(WORDS)))


def reuse(reqs: tuple[TraceRequest, ...] | list[TraceRequest], block: int) -> dict:
    """The window's own block reuse, for comparison with the prefix-hit share a server reports.

    Returns ``blocks`` (prompt blocks sent), ``repeated_blocks`` (whose hash id an earlier request of the
    window sent), ``block_reuse`` (their share), and ``prefix_reuse``: the share of prompt tokens an
    unbounded prefix cache could serve (each request's leading blocks already seen, capped at its
    prompt length - 1, as a server must compute at least one token).
    """
    seen: dict[int, int] = {}  # hash id -> most tokens of that block any earlier request sent
    blocks = repeated = reusable = prompt = 0
    for r in reqs:
        lead, leading, sent = 0, True, []
        for h, n in _blocks(r, block):
            if h is None:
                continue
            sent.append((h, n))
            blocks += 1
            repeated += h in seen
            if leading and h in seen:
                lead += min(n, seen[h])
                leading = seen[h] >= n  # a block seen only in part ends the reusable prefix
            else:
                leading = False
        for h, n in sent:
            seen[h] = max(n, seen.get(h, 0))
        reusable += min(lead, r.prompt_tokens - 1)
        prompt += r.prompt_tokens
    return {"requests": len(reqs), "blocks": blocks, "repeated_blocks": repeated,
            "block_reuse": repeated / blocks if blocks else math.nan,
            "prefix_reuse": reusable / prompt if prompt else math.nan, "block_tokens": block}
