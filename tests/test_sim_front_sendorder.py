"""benchmarks/sim_front_sendorder.py: the send-order front variant and the summary of two fronts' comparisons."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from quanta.sim.front import FrontModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sim_front_sendorder  # noqa: E402

FRONT = {"request_s": 0.02, "prompt_token_s": 6e-6, "response_s": 0.0015, "noise": [], "workers": 2}


def handover_order(front: dict) -> list[int]:
    """The order a burst (a 3,000-token prompt sent first, then two 30-token ones) reaches the engine."""
    stages = FrontModel.from_dict(front).stages()
    done = [stages.cross(t, n) for t, n in ((0.0, 3000), (0.0005, 30), (0.001, 30))]
    return sorted(range(3), key=done.__getitem__)


def test_the_variant_folds_the_per_token_term_into_the_loop_and_keeps_the_send_order():
    profile = {"front": dict(FRONT), "other": 1}
    varied = sim_front_sendorder.send_order(profile, 200)
    assert varied["front"]["prompt_token_s"] == 0.0
    assert varied["front"]["request_s"] == pytest.approx(0.02 + 6e-6 * 200)
    assert profile["front"]["prompt_token_s"] == 6e-6 and varied["other"] == 1  # the original is left as it was
    assert handover_order(profile["front"]) == [1, 2, 0]  # two stages: the short prompts pass the long one
    assert handover_order(varied["front"]) == [0, 1, 2]


def comparison_row(condition: str, ttft_err: float, misses: list[str]) -> dict:
    return {"source": f"results/run_check_{condition}.json", "condition": condition,
            "rel_error": {"ttft_p50": ttft_err}, "misses": misses}


def test_summary_counts_each_fronts_misses_and_averages_the_ttft_error_per_row():
    doc_a = {"rows": [comparison_row("x4", -0.2, ["ttft_p50"]), comparison_row("x2", 0.0, [])],
             "also_rows": [comparison_row("x4", 0.1, []), comparison_row("x2", 0.3, ["ttft_p50", "itl_p99"])]}
    doc_b = {"rows": [comparison_row("x4", 0.0, []), comparison_row("x2", 0.1, [])],
             "also_rows": [comparison_row("x4", 0.3, ["ttft_p50"]), comparison_row("x2", 0.1, [])]}
    s = [sim_front_sendorder.summarize("run", doc_a), sim_front_sendorder.summarize("b", doc_b)]
    assert s[0]["labels"] == ["check_x4 x4", "check_x2 x2"]
    assert s[0]["stages"] == {"ttft_p50_error": [-0.2, 0.0], "misses": ["x4: ttft_p50"]}
    assert s[0]["send"]["misses"] == ["x2: ttft_p50", "x2: itl_p99"]
    table = sim_front_sendorder.markdown(s)
    assert table.startswith("| run | two stages: check_x4 x4 TTFT p50 | two stages: check_x2 x2 TTFT p50 |")
    assert table.splitlines()[-1] == "| all | mean -10.0% | mean +5.0% | 1 | mean +20.0% | mean +20.0% | 3 |"
    assert "| run | -20% | +0% | 1: x4: ttft_p50 | +10% | +30% | 2: x2: ttft_p50, x2: itl_p99 |" in table


def test_missing_run_files_are_refused_before_any_fit(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        sim_front_sendorder.main(["--kind", "replicas", str(tmp_path / "run")])
    assert exc.value.code == 2 and "run_rep_fit.json" in capsys.readouterr().err
