"""Several quanta replicas behind one endpoint.

- :mod:`.routing` — which replica a request goes to (prefix affinity with a load bound,
  least-loaded, round-robin); pure Python, shared by the Ray Serve deployment and
  ``quanta simulate --replicas``.

Nothing here imports Ray at import time: Ray is imported only where a command asks for it.
"""
