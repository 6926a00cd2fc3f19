"""OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

#: Default ``--max-request-bytes`` (:class:`quanta.server.limits.BodyLimit`): 16 MiB,
#: far above what ``max_model_len`` tokens of text or token ids take in JSON
#: for the contexts quanta serves. Here so the CLI needs no server imports.
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20

#: Environment variable with the API key: ``quanta serve`` requires it where
#: ``--api-key`` is not given, ``quanta bench`` sends it.
API_KEY_ENV = "QUANTA_API_KEY"

#: Environment variable with the admin key (``/metrics``, ``/v1/trace``, ``/v1/config``):
#: ``quanta serve`` reads it where ``--admin-key`` is not given, ``quanta bench`` sends it there.
ADMIN_KEY_ENV = "QUANTA_ADMIN_KEY"
