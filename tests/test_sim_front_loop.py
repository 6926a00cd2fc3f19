"""benchmarks/sim_front_loop.py: the front refitted without its loop queue, and the summary of both comparisons."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from quanta.bench.workloads import Workload
from quanta.sim.run import simulate
from test_sim_front import BURSTS, LOOPED, SCHED, with_front

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sim_front_loop  # noqa: E402


def test_the_variant_is_the_same_runs_fitted_without_the_loop_queue():
    runs = [simulate(with_front(LOOPED), SCHED, Workload(**{**BURSTS.__dict__, "seed": s})) for s in range(2)]
    profile = {"front": {**LOOPED.to_dict(), "response_s": 0.004}, "other": 1}
    varied = sim_front_loop.without_loop(profile, [{"conditions": [{"runs": runs}]}])
    assert varied["front"]["loop_s"] == 0 and varied["front"]["response_s"] == 0.004 and varied["other"] == 1
    assert varied["front"]["request_s"] != pytest.approx(LOOPED.request_s, rel=1e-3)  # the queue went elsewhere
    assert profile["front"]["loop_s"] == LOOPED.loop_s  # the original is left as it was
    with pytest.raises(SystemExit, match="no front model"):
        sim_front_loop.without_loop(profile, [{"conditions": [{"runs": [{**runs[0], "clock_origin": None}]}]}])


def row(stem: str, p50: float, p99: float, misses: list[str]) -> dict:
    return {"source": f"results/run_{stem}.json", "condition": "batched",
            "rel_error": {"ttft_p50": p50, "ttft_p99": p99}, "misses": misses}


def test_summary_keeps_held_out_misses_apart_from_the_fitted_ones():
    doc = {"rows": [row("fit_x4", -0.1, 0.2, ["ttft_p50"]), row("check_x4", 0.05, -0.3, ["ttft_p99"])],
           "also_rows": [row("fit_x4", -0.2, 0.0, []), row("check_x4", -0.15, 0.1, ["ttft_p50", "itl_p99"])]}
    s = sim_front_loop.summarize("run", doc, {"check_x4"})
    assert s["labels"] == ["fit_x4 batched", "check_x4 batched"] and s["held_out"] == [False, True]
    assert s["loop"] == {"ttft_p50_error": [-0.1, 0.05], "ttft_p99_error": [0.2, -0.3],
                         "misses": ["check_x4: ttft_p99"], "fitted_misses": 1}
    assert s["pooled"]["misses"] == ["check_x4: ttft_p50", "check_x4: itl_p99"] and s["pooled"]["fitted_misses"] == 0
    table = sim_front_loop.markdown([s])
    assert "| run | -10% / +20% | +5% / -30% | 1: check_x4: ttft_p99 | 1 |" in table
    assert "| all | mean -20.0% / +0.0% | mean -15.0% / +10.0% | 2 | 0 |" in table


def test_missing_run_files_are_refused_before_any_fit(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        sim_front_loop.main(["--kind", "single", str(tmp_path / "run")])
    assert exc.value.code == 2 and "run_fit_x4.json" in capsys.readouterr().err
