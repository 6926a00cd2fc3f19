"""Logging set-up of ``quanta serve``: ``--log-level`` and ``--log-format text|json``.

``text``: ``TIME LEVEL LOGGER: MESSAGE`` lines (uvicorn keeps its own format).
``json``: one JSON object per line for every logger, uvicorn's included
(``time``, ``level``, ``logger``, ``message``, and the record's structured
fields under ``fields`` where it carries them, as the per-request and stats
lines of :mod:`quanta.server.live_log` do). Standard library only.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A record as one JSON line; ``record.fields`` (a dict, via ``extra={"fields": ...}``) is kept as is."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line["fields"] = fields
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Root logging at ``level`` in format ``fmt`` (replaces any handler the root logger had)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def uvicorn_log_config(fmt: str) -> dict | None:
    """uvicorn's ``log_config``: its own (coloured text) for ``text``; None for ``json``, so its
    loggers propagate to the root's JSON handler."""
    if fmt == "json":
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
