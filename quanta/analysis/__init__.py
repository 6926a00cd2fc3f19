"""Pure analysis of benchmark samples and engine traces (no I/O except ``plots``).

- :mod:`.stats` — percentiles, summaries, median with IQR over repeats.
- :mod:`.intervals` — union of intervals, intersections, busy time, overlap.
- :mod:`.requests` — client-side per-request TTFT/E2E/TPOT/ITL from streamed samples.
- :mod:`.server_trace` — server-side ITL, step counts, busy rates and overlap from a quanta trace.
- :mod:`.scrape` — Prometheus text parsing and overlap from periodic ``/metrics`` scrapes.
- :mod:`.frontier` — Pareto frontier of (throughput, p99 ITL).
- :mod:`.report` — aggregation over repeats and the markdown tables.
- :mod:`.plots` — PNG figures (matplotlib).

Times are seconds unless a name says otherwise (``_ms``).
"""
