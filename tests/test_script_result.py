"""benchmarks/script_result.py: what a benchmark script's --out writes beside its table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import script_result  # noqa: E402


def test_the_json_carries_the_command_date_code_and_machine_beside_the_document(tmp_path):
    meta = script_result.provenance("some_script.py", ["--kind", "a b", "x.json"])
    assert meta["command"] == "python benchmarks/some_script.py --kind 'a b' x.json"
    assert meta["created"].startswith("20") and "code" in meta
    script_result.write_result(str(tmp_path / "out"), "| table |\n", {"rows": [1, 2]}, meta)
    assert (tmp_path / "out.md").read_text() == "| table |\n"
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["rows"] == [1, 2] and doc["command"] == meta["command"] and doc["created"] == meta["created"]
    assert doc["machine"]["logical_cores"] >= 1


def test_the_markdown_header_names_the_date_command_code_and_machine():
    meta = {"created": "2026-12-07T00:00:00+00:00", "command": "python benchmarks/x.py", "code": "abc1234"}
    lines = script_result.header("A title", meta).splitlines()
    assert lines[:5] == ["# A title", "", "- date: 2026-12-07T00:00:00+00:00", "- command: `python benchmarks/x.py`",
                         "- code: abc1234"]
    assert lines[5].startswith("- machine: ") and "logical cores" in lines[5] and len(lines) == 6
