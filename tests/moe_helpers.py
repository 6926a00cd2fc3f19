"""A synthetic MoE model made once per test session (``quanta make-model --preset tiny-moe``)."""

from __future__ import annotations

from pathlib import Path

from quanta.model.presets import make_model

_MADE: dict[str, Path] = {}


def tiny_moe_dir(tmp_path_factory) -> Path:
    """Directory of the ``tiny-moe`` preset (64 experts, top-6, 1 shared, 2 layers of width 128).

    Its name is unique to the session, so no cached profile of an earlier
    ``quanta profile`` run changes what the advisor picks for it.
    """
    if "tiny" not in _MADE:
        path = tmp_path_factory.mktemp("moe") / "tiny-moe-under-test"
        _MADE["tiny"] = make_model("tiny-moe", path)
    return _MADE["tiny"]
