"""The quantum advisor: recommendations for several (E, K, cap) shapes, the
use of a measured profile, dense models, the command line, and
``--mixed-prefill-quantum auto`` (checked before any weight loads)."""

from __future__ import annotations

import pytest

from quanta import cli
from quanta.config import SchedulerConfig
from quanta.model.loader import embedded_model_path
from quanta.moe.advisor import advise, format_advice
from quanta.moe.auto import resolve_auto_from_model

# (E, K, cap, target) -> quantum: T*E/K rounded (log2-nearest) to a power of two dividing the cap
SHAPES = [
    ((256, 6, 4096, None), 2048),  # the seed's model: 48 x 256 / 6 = 2048 exactly
    ((256, 6, 1024, None), 1024),  # the cap limits it
    ((256, 6, 3072, None), 1024),  # 2048 does not divide 3072
    ((256, 6, 4096, 24), 1024),  # an explicit target
    ((256, 8, 4096, None), 2048),  # DeepSeek-V3: 1536 -> 2048 (log2 10.58)
    ((128, 8, 4096, None), 1024),  # Qwen3-30B-A3B: 768 -> 1024
    ((64, 8, 4096, None), 512),  # OLMoE: 384 -> 512
    ((8, 2, 4096, None), 256),  # Mixtral: 192 -> 256
    ((60, 4, 4096, None), 512),  # Qwen1.5-MoE-A2.7B: 720 -> 512 (log2 9.49)
]


@pytest.mark.parametrize("args,quantum", SHAPES, ids=[f"E{a[0]}-K{a[1]}-cap{a[2]}-T{a[3]}" for a, _ in SHAPES])
def test_recommendation_for_shape(args, quantum):
    e, k, cap, target = args
    advice = advise(e, k, cap, target)
    assert advice.quantum == quantum
    assert cap % advice.quantum == 0 and advice.quantum & (advice.quantum - 1) == 0
    assert not advice.dense
    assert advice.target == (target or 48)
    qs = [c.quantum for c in advice.candidates]
    assert quantum in qs and qs == sorted(qs) and all(cap % q == 0 for q in qs)
    chosen = next(c for c in advice.candidates if c.quantum == quantum)
    assert chosen.tokens_per_expert == pytest.approx(quantum * k / e)
    assert chosen.ms_per_token is None and chosen.decode_gap_ms is None  # nothing measured


def test_seed_reason_spells_out_the_arithmetic():
    advice = advise(256, 6, 4096)
    assert "48 x 256 / 6 = 2048" in advice.reason and "seed study" in advice.reason
    assert [c.quantum for c in advice.candidates] == [512, 1024, 2048, 4096]
    assert "cap limits" in advise(256, 6, 1024).reason
    text = format_advice(advice)
    assert "2048" in text and "<- recommended" in text and "tokens/expert" in text


def _report(name="m", e=256, k=6, saturation=96.0):
    rows = [{"quantum": q, "ms_per_token": {"median": c}} for q, c in [(512, 2.0), (1024, 1.5), (2048, 1.1), (4096, 1.0)]]
    return {"kind": "quanta-prefill-profile", "model": {"name": name, "num_experts": e, "top_k": k},
            "machine": {"date": "2026-11-29"}, "rows": rows, "saturation_tokens_per_expert": saturation,
            "decode_step_ms": {"median": 10.0}}


def test_profile_sets_the_target_and_fills_costs_for_the_same_model():
    advice = advise(256, 6, 4096, cost_report=_report(), model_name="m")
    assert advice.target == 96 and advice.quantum == 4096 and "measured" in advice.target_source
    by_q = {c.quantum: c for c in advice.candidates}
    assert by_q[2048].ms_per_token == 1.1 and by_q[2048].moe_ms_per_token is None  # not in this profile
    assert by_q[2048].decode_gap_ms == pytest.approx(10.0 + 2048 * 1.1)  # one decode step + one quantum
    other = advise(256, 6, 4096, cost_report=_report(name="other"), model_name="m")
    assert other.quantum == 4096 and all(c.ms_per_token is None for c in other.candidates)  # target only
    assert advise(256, 6, 4096, target=48, cost_report=_report(), model_name="m").quantum == 2048  # explicit wins


def test_dense_model_falls_back_to_the_measured_curve():
    advice = advise(None, None, 4096)
    assert advice.dense and advice.quantum == 2048 and "does not apply" in advice.reason
    assert "No measured prefill cost curve" in advice.reason
    measured = advise(None, None, 4096, cost_report=_report(e=None, k=None), model_name="m")
    assert measured.dense and "measured prefill cost curve" in measured.reason
    assert measured.quantum == 4096  # 2048 costs 10% more than the best; 4096 is within 5%
    assert advise(None, None, 1024).quantum == 1024
    assert "n/a" in format_advice(advice)


def test_advise_command(capsys):
    assert cli.main(["advise", "--num-experts", "256", "--top-k", "6", "--prefill-cap", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mixed prefill quantum: 2048")


@pytest.mark.parametrize("argv,fragment", [
    (["advise"], "--num-experts"),
    (["advise", "--num-experts", "4", "--top-k", "7"], "--top-k"),
    (["advise", "--model", "x", "--top-k", "2", "--num-experts", "8"], "not both"),
    (["advise", "--num-experts", "8", "--top-k", "2", "--prefill-cap", "0"], "--prefill-cap"),
    (["advise", "--num-experts", "8", "--top-k", "2", "--top-k", "2"], "more than once"),
    (["serve", "--mixed-prefill-quantum", "auto", "--scheduler", "static"], "--mixed-prefill-quantum"),
    (["serve", "--mixed-prefill-quantum", "soon"], "invalid"),
    (["serve", "--mixed-prefill-quantum", "auto", "--mixed-prefill-quantum", "auto"], "more than once"),
    (["serve", "--mixed-prefill-quantum", "auto", "--prefill-cap", "0"], "--prefill-cap"),
    (["serve", "--mixed-prefill-quantum", "auto", "--model", "/nonexistent/model"], "--model /nonexistent/model: no such file"),
])
def test_bad_command_lines_exit_2_before_loading(argv, fragment, capsys, monkeypatch):
    import quanta.launch
    import quanta.server.run

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the command line was validated")

    monkeypatch.setattr(quanta.launch, "load_model", refuse)
    monkeypatch.setattr(quanta.server.run, "load_model", refuse)
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_auto_on_the_dense_embedded_model_keeps_the_default_and_says_why(caplog):
    sched = SchedulerConfig("batched", 8, {"mixed_prefill_quantum": 1, "prefill_cap": 4096})
    with caplog.at_level("INFO", logger="quanta"):
        resolved, advice = resolve_auto_from_model(None, sched)
    assert advice.dense and resolved.knobs["mixed_prefill_quantum"] == 2048
    assert resolved.knobs["prefill_cap"] == 4096 and resolved.knobs["prefill_quantum"] == 2048
    assert "tokens-per-expert argument does not apply" in caplog.text
    assert embedded_model_path().exists()
