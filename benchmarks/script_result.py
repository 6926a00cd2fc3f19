"""What a benchmark script's ``--out`` writes: its Markdown, and its JSON with where it came from."""

from __future__ import annotations

import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

from quanta.bench.output import code_version, machine, machine_text, write_json


def provenance(script: str, argv: list[str] | None) -> dict:
    """The command that ran ``script`` (``argv``: its arguments, None: this process's), the date and the code."""
    args = sys.argv[1:] if argv is None else argv
    return {"command": f"python benchmarks/{script} " + shlex.join(args),
            "created": datetime.now(UTC).isoformat(timespec="seconds"), "code": code_version()}


def header(title: str, meta: dict) -> str:
    """A Markdown title and the lines saying where the result came from: date, command, code (``meta``,
    :func:`provenance`) and this machine."""
    return (f"# {title}\n\n- date: {meta['created']}\n- command: `{meta['command']}`\n- code: {meta['code']}\n"
            f"- machine: {machine_text(machine())}\n")


def write_result(out: str, markdown: str, doc: dict, meta: dict) -> None:
    """``out``.md holds ``markdown``; ``out``.json ``doc`` with ``meta`` (:func:`provenance`) and this machine."""
    Path(out + ".md").write_text(markdown)
    write_json({**doc, **meta, "machine": machine()}, Path(out + ".json"))
