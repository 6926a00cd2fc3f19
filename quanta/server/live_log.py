"""What ``quanta serve`` logs while it works: a stats line every few seconds and a line per finished request.

- Stats (logger ``quanta.stats``, every ``--stats-interval`` seconds while a
  request runs or waits, or tokens were computed since the last line): prompt
  and generation throughput over the interval (tokens of the steps that ended
  in it: a prefill step longer than the interval counts where it ends),
  requests running and waiting, KV slots in use, the prefix cache's hit rate
  (prompt tokens served from it, since start), each resident prefill's
  progress (prompt tokens computed / prompt tokens, as of the last step's end),
  the step now running when it has run for :data:`LONG_STEP_S` or more
  (measured from its start; nothing between steps), and the requests aborted
  in the interval by cause and phase. The line comes from a timer on the
  event loop, so it appears during a long prefill step too.
- Requests (logger ``quanta.requests``, one per finished request): the response
  id, route, prompt / cached / generated tokens, time to first token, decode rate
  (tokens after the first per second), end-to-end time and the finish reason.

Outputs and steps are observed on the engine thread; the routes name a request
(:meth:`LiveLog.label`) once the engine accepted it, which may be after it
finished: whichever comes second writes the line. Each line carries its values
as structured ``fields`` (``--log-format json``, :mod:`quanta.logs`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from quanta.engine.output import RequestOutput
from quanta.engine.trace import StepRecord

stats_log = logging.getLogger("quanta.stats")
request_log = logging.getLogger("quanta.requests")

#: ``--stats-interval`` default, seconds.
DEFAULT_STATS_INTERVAL_S = 5.0
#: finished requests kept while their route has not named them yet (then logged unnamed).
_MAX_UNLABELED = 1024
#: a running step is named in the stats line once it has run this long, seconds.
LONG_STEP_S = 1.0
#: resident prefills named in the stats line at most.
_MAX_PREFILLS = 4


@dataclass(slots=True)
class _Finished:
    fields: dict


class LiveLog:
    """Counters for the stats line and the per-request lines.

    Args:
        num_running / num_waiting: callables (the async engine's counts).
        num_slots: KV slots (``--max-num-seqs``).
        clock: seconds, the engine's clock (outputs carry its times).
        kv_blocks: the KV pool's block counts (``used``, ``cached``, ``total``,
            :meth:`quanta.engine.async_engine.AsyncEngine.kv_blocks`); None: not reported.
        engine: where the running step and the resident prefills are read
            (:attr:`~quanta.engine.async_engine.AsyncEngine.step_running_s`,
            :meth:`~quanta.engine.async_engine.AsyncEngine.prefills`); None: not reported.
    """

    def __init__(self, num_running: Callable[[], int], num_waiting: Callable[[], int], num_slots: int,
                 clock: Callable[[], float], kv_blocks: Callable[[], dict[str, int]] | None = None,
                 engine=None) -> None:
        self.num_running, self.num_waiting, self.num_slots, self.clock = num_running, num_waiting, num_slots, clock
        self.kv_blocks = kv_blocks
        self.engine = engine
        self._lock = threading.Lock()
        self._prompt = self._generated = 0  # since the last stats line
        self._aborts: dict[str, int] = {}  # "cause/phase" -> requests aborted since the last stats line
        self._since = clock()
        self._queried = self._hits = 0  # prefix cache, since start, in prompt tokens
        self._run = {"requests": 0, "aborted": 0, "prompt": 0, "generated": 0}  # finished requests, since start
        self._first: dict[int, float] = {}  # seq_id -> first token's time
        self._labels: dict[int, tuple[str, str]] = {}
        self._unlabeled: OrderedDict[int, _Finished] = OrderedDict()

    # ----------------------------------------------------------------- engine thread

    def observe_step(self, rec: StepRecord) -> None:
        """Count the step's prompt tokens (rows of more than one token, or that emitted none) and generated tokens."""
        prompt = sum(n for n, e in zip(rec.num_new_tokens, rec.num_emitted, strict=False) if n > 1 or e == 0)
        with self._lock:
            self._prompt += prompt
            self._generated += sum(rec.num_emitted)

    def observe_abort(self, cause: str, phase: str) -> None:
        """Count one aborted request (``AsyncEngine.on_abort``)."""
        key = f"{cause}/{phase}"
        with self._lock:
            self._aborts[key] = self._aborts.get(key, 0) + 1

    def observe_output(self, out: RequestOutput) -> None:
        """Note a request's first token; write its line when it finished (if its route named it)."""
        if out.token_ids and out.seq_id not in self._first:
            self._first[out.seq_id] = out.time
            with self._lock:
                self._queried += out.num_prompt_tokens
                self._hits += out.num_cached_tokens
        if not out.finished:
            return
        first = self._first.pop(out.seq_id, None)
        decode = out.time - first if first is not None else 0.0
        fields = {
            "prompt_tokens": out.num_prompt_tokens, "cached_tokens": out.num_cached_tokens,
            "generated_tokens": out.num_output_tokens,
            "ttft_s": round(first - out.arrival_time, 3) if first is not None else None,
            "decode_tok_s": round((out.num_output_tokens - 1) / decode, 1) if decode > 0 else None,
            "e2e_s": round(out.time - out.arrival_time, 3), "finish_reason": out.finish_reason,
        }
        overflow = None
        with self._lock:
            self._count_run(out)
            label = self._labels.pop(out.seq_id, None)
            if label is None:
                self._unlabeled[out.seq_id] = _Finished(fields)
                overflow = self._unlabeled.popitem(last=False) if len(self._unlabeled) > _MAX_UNLABELED else None
        if label is not None:
            _write_request(label, fields)
        elif overflow is not None:
            _write_request(("-", "-"), overflow[1].fields)

    def _count_run(self, out: RequestOutput) -> None:
        run = self._run
        run["requests"] += 1
        run["aborted"] += out.finish_reason == "abort"
        run["prompt"] += out.num_prompt_tokens
        run["generated"] += out.num_output_tokens

    def run_summary(self) -> str:
        """The run's totals for the stop line: finished requests (aborted ones among them), their tokens."""
        with self._lock:
            run = dict(self._run)
        return (f"{run['requests']} request(s) ({run['aborted']} aborted), "
                f"{run['prompt']:,} prompt and {run['generated']:,} generated tokens")

    # ----------------------------------------------------------------- event loop

    def label(self, seq_id: int | None, request_id: str, route: str) -> None:
        """Name an accepted request (its response id and route) for its line."""
        if seq_id is None:
            return
        with self._lock:
            done = self._unlabeled.pop(seq_id, None)
            if done is None:
                self._labels[seq_id] = (request_id, route)
        if done is not None:
            _write_request((request_id, route), done.fields)

    def stats_fields(self) -> dict | None:
        """The stats since the previous call, or None when nothing ran or waited."""
        running, waiting = self.num_running(), self.num_waiting()
        now = self.clock()
        with self._lock:
            prompt, generated, self._prompt, self._generated = self._prompt, self._generated, 0, 0
            aborts, self._aborts = self._aborts, {}
            queried, hits = self._queried, self._hits
            span, self._since = max(now - self._since, 1e-9), now
        if not (running or waiting or prompt or generated or aborts):
            return None
        blocks = self.kv_blocks() if self.kv_blocks is not None else {}
        step = self.engine.step_running_s if self.engine is not None else None
        return {
            "kv_blocks_used": blocks.get("used"), "kv_blocks_cached": blocks.get("cached"), "kv_blocks": blocks.get("total"),
            "prompt_tok_s": round(prompt / span, 1), "generation_tok_s": round(generated / span, 1),
            "running": running, "waiting": waiting, "kv_slots_used": running, "kv_slots": self.num_slots,
            "prefix_cache_hit_rate": round(hits / queried, 4) if queried else None, "interval_s": round(span, 2),
            # the step now running, from its start, once it is long (a large prefill quantum)
            "step_running_s": round(step, 1) if step is not None and step >= LONG_STEP_S else None,
            "prefills": self._prefills(), "aborts": aborts or None,
        }

    def _prefills(self) -> list[dict] | None:
        """Resident prefills: the route's id for the request (else its seq id), tokens done and total."""
        if self.engine is None:
            return None
        found = self.engine.prefills()[:_MAX_PREFILLS]
        with self._lock:
            named = [(self._labels.get(seq_id, (f"seq {seq_id}", ""))[0], done, total) for seq_id, done, total in found]
        return [{"id": name, "done": done, "total": total} for name, done, total in named] or None

    def write_stats(self) -> None:
        fields = self.stats_fields()
        if fields is None:
            return
        rate = fields["prefix_cache_hit_rate"]
        blocks = "" if fields["kv_blocks"] is None else \
            f", KV blocks {fields['kv_blocks_used']}/{fields['kv_blocks']} in use ({fields['kv_blocks_cached']} cached)"
        stats_log.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV slots %d/%d in use%s, prefix cache hits %s%s",
            fields["prompt_tok_s"], fields["generation_tok_s"], fields["running"], fields["waiting"],
            fields["kv_slots_used"], fields["kv_slots"], blocks, "-" if rate is None else f"{rate:.1%}",
            _progress_text(fields), extra={"fields": fields})

    async def run(self, interval: float) -> None:
        """Write the stats line every ``interval`` seconds (while anything happened) until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.write_stats()
            except Exception:  # the stats line must never stop the server
                stats_log.exception("stats line failed")


def _progress_text(fields: dict) -> str:
    """The stats line's tail: prefills in progress, a long running step, aborts."""
    parts = []
    if fields["prefills"]:
        parts.append("prefill " + ", ".join(f"{p['id']} {p['done']}/{p['total']}" for p in fields["prefills"]))
    if fields["step_running_s"] is not None:
        parts.append(f"the running step has run for {fields['step_running_s']:.1f} s")
    if fields["aborts"]:
        parts.append("aborted " + ", ".join(f"{n} ({_abort_words(key)})" for key, n in sorted(fields["aborts"].items())))
    return "".join(f"; {p}" for p in parts)


def _abort_words(key: str) -> str:
    cause, phase = key.split("/")
    return f"{cause} {'while queued' if phase == 'queued' else 'during ' + phase}"


def _write_request(label: tuple[str, str], fields: dict) -> None:
    request_id, route = label
    fields = {"id": request_id, "route": route, **fields}
    ttft, rate = fields["ttft_s"], fields["decode_tok_s"]
    request_log.info(
        "%s %s: prompt %d (cached %d), generated %d, ttft %s, %s, e2e %.2f s, finish %s",
        request_id, route, fields["prompt_tokens"], fields["cached_tokens"], fields["generated_tokens"],
        "-" if ttft is None else f"{ttft:.2f} s", "-" if rate is None else f"{rate:.1f} tok/s",
        fields["e2e_s"], fields["finish_reason"], extra={"fields": fields})


def label_request(live: LiveLog | None, stream, request_id: str, route: str) -> None:
    """``live.label`` for a route's ``stream`` once the engine accepted it (no-op without a live log)."""
    if live is not None:
        stream.when_accepted(lambda seq_id: live.label(seq_id, request_id, route))
