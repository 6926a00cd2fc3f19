"""``quanta profile``: a tiny run through the real engine, the report's shape,
the saturation rule, and the files it writes (no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from quanta.launch import load_model
from quanta.moe import formulas
from quanta.moe.advisor import advise, load_cost_report
from quanta.moe.prefill_cost import saturation_point
from quanta.moe.report import cost_report_cache_path, format_report, write_report

from moe_helpers import tiny_moe_dir


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from quanta.moe.prefill_cost import measure_prefill_cost

    loaded = load_model(str(tiny_moe_dir(tmp_path_factory)), torch.bfloat16)
    return measure_prefill_cost(loaded, quanta=(16, 64, 128), prompt_tokens=256, repeats=2, frag_quantum=128, frag_caps=(192,))


def test_report_rows_follow_the_engine_and_the_formulas(report):
    assert report["kind"] == "quanta-prefill-profile"
    assert "random weights" in report["synthetic"]
    assert [r["quantum"] for r in report["rows"]] == [16, 64, 128]
    for r in report["rows"]:
        assert r["calls"] == 256 // r["quantum"]  # pure prefill: equal chunks, nothing else scheduled
        assert r["tokens_per_expert"] == formulas.tokens_per_expert(r["quantum"], 6, 64)
        assert r["unique_experts_expected"] == pytest.approx(formulas.expected_unique_experts(r["quantum"], 6, 64))
        assert 6 <= r["unique_experts"] <= 64
        assert r["tokens_per_active_expert"] == pytest.approx(r["quantum"] * 6 / r["unique_experts"], rel=0.25)
        s = r["ms_per_token"]
        assert len(s["runs"]) == 2 and s["min"] <= s["median"] <= s["max"]
    assert min(r["ratio_to_best"] for r in report["rows"]) == 1.0
    assert report["rows"][0]["unique_experts"] < report["rows"][-1]["unique_experts"]  # bigger chunks wake more experts
    assert report["machine"]["cores"] and report["machine"]["torch"]
    assert len(report["decode_step_ms"]["runs"]) == 16


def test_fragmentation_splits_chunks_at_the_lowered_cap(report):
    frag = report["fragmentation"]
    base, lowered = frag["rows"]
    assert base["prefill_cap"] == 256 and base["chunk_tokens"] == [128, 128] and base["calls_ratio"] == 1.0
    assert lowered["prefill_cap"] == 192 and lowered["chunk_tokens"] == [128, 64, 64]
    assert lowered["calls_ratio"] == 1.5 and lowered["cost_ratio"] > 0


def test_saturation_point_rule():
    def rows(costs):
        return [{"tokens_per_expert": t, "ms_per_token": {"median": c}} for t, c in costs]

    assert saturation_point(rows([(3, 4.0), (12, 1.9), (48, 1.04), (192, 1.0)])) == 48
    assert saturation_point(rows([(3, 4.0), (12, 1.9), (48, 1.06), (192, 1.0)])) == 192
    assert saturation_point(rows([(3, 1.0), (12, 1.2)])) == 3
    assert saturation_point([{"quantum": 1, "ms_per_token": {"median": 1.0}}]) is None


def test_report_files_and_the_advisor_reading_them(report, tmp_path, monkeypatch):
    text = format_report(report)
    assert "Synthetic model" in text and "| quantum | calls | unique experts" in text and "Fragmentation" in text
    paths = write_report(report, tmp_path, cache=False)
    assert [p.suffix for p in paths] == [".json", ".md", ".png"]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths[0].read_text())["rows"] == json.loads(json.dumps(report["rows"]))
    loaded = load_cost_report(paths[0])
    advice = advise(64, 6, 1024, cost_report=loaded, model_name=report["model"]["name"])
    assert advice.target == loaded["saturation_tokens_per_expert"]
    assert any(c.ms_per_token is not None for c in advice.candidates)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cost_report_cache_path("m") == tmp_path / "cache" / "quanta" / "profiles" / "m.json"
    with pytest.raises(ValueError):
        (tmp_path / "bad.json").write_text('{"kind": "other"}')
        load_cost_report(tmp_path / "bad.json")


def test_dense_model_profile_feeds_the_dense_advisor(tmp_path_factory, tmp_path):
    """``quanta profile prefill`` on a dense model: no expert columns, files named by the (dotted) model name."""
    from quanta.launch import LoadedModel
    from quanta.model.config import ModelConfig
    from quanta.model.llama import LlamaModel
    from quanta.model.tokenizer import Tokenizer
    from quanta.moe.prefill_cost import measure_prefill_cost

    torch.manual_seed(0)
    cfg = ModelConfig("llama", 512, 64, 96, 2, 4, 2, 16, max_position_embeddings=256, name="dense.Q4")
    model = LlamaModel(cfg)
    model.to(torch.bfloat16).eval()
    model.pack_weights()
    tokenizer = Tokenizer.from_path(tiny_moe_dir(tmp_path_factory))
    dense = LoadedModel(model, tokenizer, cfg, tmp_path / "dense.Q4.gguf", "dense.Q4")
    report = measure_prefill_cost(dense, quanta=(16, 32), prompt_tokens=64, repeats=1, frag_quantum=None)
    assert report["synthetic"] is None and report["saturation_tokens_per_expert"] is None
    assert [r["calls"] for r in report["rows"]] == [4, 2] and "unique_experts" not in report["rows"][0]
    assert "fragmentation" not in report
    paths = write_report(report, tmp_path / "out", cache=False)
    assert [p.name for p in paths] == ["prefill_profile_dense.Q4.json", "prefill_profile_dense.Q4.md", "prefill_profile_dense.Q4.png"]
    advice = advise(None, None, 4096, cost_report=load_cost_report(paths[0]), model_name="dense.Q4")
    assert advice.dense and advice.quantum in (16, 32) and "measured prefill cost curve" in advice.reason
