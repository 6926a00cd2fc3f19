"""``quanta bench``: a load generator for any OpenAI-compatible server and
sweeps over quanta's own scheduling flags.

- :mod:`.client` — one streamed request -> :class:`quanta.analysis.requests.RequestSample`.
- :mod:`.prompts` — prompt text of a given size, unique per run when asked.
- :mod:`.workloads` — burst, poisson, gamma, concurrency, probe and replay.
- :mod:`.runner` — one measured run: server discovery, trace, scrapes, metrics.
- :mod:`.server` — start, verify and stop a local ``quanta serve``.
- :mod:`.sweep` — the grid of server flags and the sweep loop.
- :mod:`.output` — JSON, markdown and PNG outputs.
- :mod:`.cli` — ``quanta bench run|sweep|report|trace``.
"""
