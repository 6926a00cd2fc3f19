"""Prometheus metrics, named after vLLM's (``vllm:`` -> ``quanta:``).

Latencies are observed on the engine thread from each request's outputs: TTFT
from arrival to the first token, ITL between consecutive tokens of the same
request (never from the previous step of any kind), E2E from arrival to the
last token. Histogram buckets start at 1 ms so millisecond ITLs resolve.
Prefix-cache queries and hits are counted in prompt tokens, as vLLM counts
them, when a request's first token comes out (its cache lookup is done by then).
``quanta:request_aborts_total`` counts requests aborted before their end by
``cause`` (``disconnect``: the client went away; ``step_failed``) and ``phase``
(``queued``, ``prefill``, ``decode``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from quanta.engine.output import RequestOutput
from quanta.engine.trace import StepRecord

LATENCY_BUCKETS = (
    0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0,
)

#: buckets of the expert histograms (experts, or tokens per expert): powers of two to 1024
EXPERT_BUCKETS = tuple(float(2**i) for i in range(11))


class EngineMetrics:
    """All of quanta's metrics in their own registry (one per server).

    Args:
        num_running / num_waiting: callables read at scrape time.
        prefix_cache: the engine reuses cached prefixes (else the prefix-cache
            counters stay at 0).
        kv_blocks: callable read at scrape time, the KV pool's block counts
            (:meth:`quanta.engine.async_engine.AsyncEngine.kv_blocks`); None: not exported.
    """

    def __init__(self, num_running, num_waiting, prefix_cache: bool = False, kv_blocks=None) -> None:
        self.registry = r = CollectorRegistry()
        Gauge("quanta:num_requests_running", "Requests resident in a KV slot.", registry=r).set_function(num_running)
        Gauge("quanta:num_requests_waiting", "Requests queued for a slot.", registry=r).set_function(num_waiting)
        if kv_blocks is not None:
            for key, text in (("used", "held by resident requests"), ("cached", "kept for prefix reuse (evictable)"),
                              ("free", "free"), ("total", "in the pool")):
                Gauge(f"quanta:kv_blocks_{key}", f"KV cache blocks {text}.", registry=r).set_function(
                    lambda key=key: kv_blocks()[key])
            Gauge("quanta:num_preemptions", "Requests preempted (KV blocks freed, recomputed later) since start.",
                  registry=r).set_function(lambda: kv_blocks()["preemptions"])
            for name in ("quanta:kv_usage_ratio", "quanta:kv_cache_usage_perc"):  # the second: vLLM's name
                Gauge(name, "Share of the KV pool's blocks held by resident requests (0-1; cached blocks are free "
                      "to take).", registry=r).set_function(lambda: _usage(kv_blocks()))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self.prompt_tokens = Counter("quanta:prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter("quanta:generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter(
            "quanta:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.request_aborts = Counter(
            "quanta:request_aborts", "Requests aborted before their end, by cause and the phase they were in.",
            ["cause", "phase"], registry=r,
        )
        self.ttft = Histogram("quanta:time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "quanta:inter_token_latency_seconds", "Gap between consecutive tokens of one request.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram("quanta:e2e_request_latency_seconds", "Arrival to last token.", buckets=LATENCY_BUCKETS, registry=r)
        self.prefix_cache = prefix_cache
        self.prefix_cache_queries = Counter(
            "quanta:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "quanta:prefix_cache_hits", "Prompt tokens served from the prefix cache (not computed).", registry=r
        )
        self.steps = Counter("quanta:engine_steps", "Executed steps by kind.", ["kind"], registry=r)
        # MoE models: per executed step, averaged over MoE layers (empty for dense models).
        self.moe_unique_experts = Histogram(
            "quanta:moe_unique_experts", "Routed experts hit at least once per step (mean over MoE layers).",
            buckets=EXPERT_BUCKETS, registry=r,
        )
        self.moe_tokens_per_expert = Histogram(
            "quanta:moe_tokens_per_expert", "Rows computed per active expert per step, T*K/unique (mean over MoE layers).",
            buckets=EXPERT_BUCKETS, registry=r,
        )
        self.moe_last_unique_experts = Gauge("quanta:moe_last_unique_experts", "Unique experts of the last step.", registry=r)
        self.moe_last_tokens_per_expert = Gauge("quanta:moe_last_tokens_per_expert", "Tokens per active expert of the last step.",
                                                registry=r)
        self.step_seconds = Counter("quanta:engine_step_seconds", "Busy time of executed steps by kind.", ["kind"], registry=r)
        self._last_token_time: dict[int, float] = {}
        #: the stats and per-request log lines (:class:`quanta.server.live_log.LiveLog`), set by ``quanta serve``
        self.live = None

    def observe_output(self, out: RequestOutput) -> None:
        """Record one request output (called on the engine thread)."""
        if out.token_ids:
            self.generation_tokens.inc(len(out.token_ids))
            last = self._last_token_time.get(out.seq_id)
            if last is None:
                self.ttft.observe(out.time - out.arrival_time)
                self.prompt_tokens.inc(out.num_prompt_tokens)
                if self.prefix_cache:
                    self.prefix_cache_queries.inc(out.num_prompt_tokens)
                    self.prefix_cache_hits.inc(out.num_cached_tokens)
            else:
                self.itl.observe(out.time - last)
            self._last_token_time[out.seq_id] = out.time
        if out.finished:
            self._last_token_time.pop(out.seq_id, None)
            self.request_success.labels(out.finish_reason).inc()
            if out.finish_reason != "abort":
                self.e2e.observe(out.time - out.arrival_time)

    def observe_abort(self, cause: str, phase: str) -> None:
        """Count one aborted request (called on the engine thread, ``AsyncEngine.on_abort``)."""
        self.request_aborts.labels(cause, phase).inc()

    def observe_step(self, rec: StepRecord) -> None:
        """Count one executed step and its busy time (and its expert activity on MoE models)."""
        self.steps.labels(rec.kind).inc()
        self.step_seconds.labels(rec.kind).inc(rec.duration)
        if rec.experts:
            self.moe_unique_experts.observe(rec.experts["unique_experts"])
            self.moe_tokens_per_expert.observe(rec.experts["tokens_per_expert"])
            self.moe_last_unique_experts.set(rec.experts["unique_experts"])
            self.moe_last_tokens_per_expert.set(rec.experts["tokens_per_expert"])


def _usage(blocks: dict) -> float:
    """Used blocks over the pool's blocks (0 for an empty pool)."""
    return blocks["used"] / blocks["total"] if blocks["total"] else 0.0
