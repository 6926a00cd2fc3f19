"""Several quanta replicas behind one endpoint (``quanta serve --replicas N``; docs/CLUSTER.md).

- :mod:`.routing` — which replica a request goes to (prefix affinity with a load bound,
  least-loaded, round-robin); pure Python, shared by the Ray Serve deployment and
  ``quanta simulate --replicas``.
- :mod:`.forward` — one HTTP request through an ASGI app in process, as picklable parts.
- :mod:`.prompts` — a request body's prompt ids, rendered as the replicas' routes render them.
- :mod:`.metrics` — the replicas' Prometheus texts as one, with a ``replica`` label.
- :mod:`.replica` — one engine replica: the single server's app over its own engine.
- :mod:`.front` — the endpoint: routes, forwards, turns a replica's failure into the route's error.
- :mod:`.app` — the Ray Serve application (deployments, local Ray or ``--ray-address``, the command).

Nothing here imports Ray at import time: Ray is imported only where a command asks for it
(:mod:`.app`, which only ``--replicas`` and Ray's ``serve run`` import).
"""
