"""The peer benchmarks' result files are named as given: a name with dots (a GGUF's stem) keeps them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import peer_llama_cpp  # noqa: E402


def test_a_dotted_name_keeps_its_whole_stem(tmp_path):
    for name in ("peer_gguf_llama-3.2-1b_load", "peer_gguf_llama-3.2-3b_load"):
        peer_llama_cpp.write_result(tmp_path / name, f"# {name}\n", {"name": name})
    for name in ("peer_gguf_llama-3.2-1b_load", "peer_gguf_llama-3.2-3b_load"):
        assert (tmp_path / f"{name}.md").read_text() == f"# {name}\n"
        assert json.loads((tmp_path / f"{name}.json").read_text()) == {"name": name}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"peer_gguf_llama-3.2-{s}b_load.{ext}" for s in (1, 3) for ext in ("md", "json"))


def test_a_bench_run_is_read_from_its_whole_name(tmp_path):
    prefix = tmp_path / "quanta_llama-3.2-1b_r1"
    (tmp_path / "quanta_llama-3.2-1b_r1.json").write_text(json.dumps({"conditions": [{"runs": [{"ttft": 1.5}]}]}))
    assert peer_llama_cpp.read_run(prefix) == {"ttft": 1.5}
