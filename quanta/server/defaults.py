"""What the server fills in when a request leaves it out: the output cap and the sampling settings.

- Output cap: a request without ``max_tokens`` (chat), ``max_completion_tokens``
  or ``max_output_tokens`` (Responses) gets ``--max-tokens-default``
  (:data:`DEFAULT_MAX_TOKENS`), or the room its prompt leaves in
  ``max_model_len`` where that is smaller; ``--max-tokens-default 0`` gives the
  room left (vLLM's behaviour). As llama-server's ``-n`` and Ollama's
  ``num_predict``: a looping model cannot run for minutes by default.
  Completions keep OpenAI's own default of 16; Anthropic's ``max_tokens`` is required.
- Model: a request without ``model`` is for the served model (:func:`served_model`).
- Sampling: ``temperature``, ``top_p``, ``top_k`` and ``min_p`` that a request
  does not send come from ``--temperature`` / ``--top-p`` / ``--top-k``, else from
  the checkpoint's ``generation_config.json`` (a Hugging Face directory's; as
  vLLM's ``--generation-config auto``), else the protocol's defaults.

Both are kept in the server's config (``GET /v1/config``): ``max_tokens_default``
and ``sampling_defaults``.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

#: ``--max-tokens-default``: output tokens for a request that names no cap.
DEFAULT_MAX_TOKENS = 2048

#: generation_config keys taken as request defaults, with the range each must be in.
SAMPLING_RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (1e-9, 1.0),
    "top_k": (-1, 2**31 - 1),
    "min_p": (0.0, 1.0),
}


def generation_defaults(model: str | None) -> dict[str, float | int]:
    """The sampling settings of ``model``'s ``generation_config.json`` (a directory's), in range; {} otherwise.

    A value of the wrong type or out of range is left out (the protocol's default applies).
    """
    if not model:
        return {}
    path = Path(model) / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    out: dict[str, float | int] = {}
    for key, (low, high) in SAMPLING_RANGES.items():
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        if low <= value <= high:
            out[key] = int(value) if key == "top_k" else float(value)
    return out


def sampling_defaults(model: str | None, overrides: dict[str, float | int | None]) -> dict[str, float | int]:
    """``generation_config`` defaults of ``model`` with the given ``overrides`` (None: not given) on top."""
    return {**generation_defaults(model), **{k: v for k, v in overrides.items() if v is not None}}


def output_cap(config: dict, max_model_len: int, prompt_tokens: int, given: int | None) -> int:
    """The request's output cap: ``given``, else ``config['max_tokens_default']`` within the room left
    (0 or absent: the room left). The room's own check is :func:`quanta.server.serving.submit`'s."""
    if given is not None:
        return given
    room = max_model_len - prompt_tokens
    default = config.get("max_tokens_default") or 0
    return min(default, room) if default > 0 else room


def served_model(state, body) -> str:
    """``body.model``, set to the served model's id where the request left it out (as vLLM and llama-server
    do); a model the request names is checked by the route."""
    if body.model is None:
        body.model = state.model_name
    return body.model


def with_defaults(config: dict, body, params):
    """``params`` with the server's sampling defaults for the fields ``body`` (a pydantic request) did not send."""
    defaults = config.get("sampling_defaults") or {}
    changes = {k: v for k, v in defaults.items() if k not in body.model_fields_set and hasattr(params, k)}
    return replace(params, **changes) if changes else params
