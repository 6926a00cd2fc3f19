"""``quanta simulate --compare``: replaying a bench result on the cost model.

The "measured" documents here are themselves simulated (with a known profile),
so the expected errors are known exactly: replaying with the same profile
gives zero error and the same schedule; a profile with every cost doubled
gives +100% ITL and -50% rates.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest

from quanta import cli
from quanta.analysis.report import repeat_figures
from quanta.bench import output
from quanta.bench.workloads import Workload
from quanta.sim import Profile
from quanta.sim.compare import (
    FIGURES,
    STEPS,
    CompareError,
    chance,
    compare,
    ratio_rows,
    row,
    sched_config,
    simulate_condition,
    summary,
)
from quanta.sim.compare_report import markdown_table, ratio_table, summary_lines
from quanta.sim.run import Simulation, condition


def prof(scale: float = 1.0) -> Profile:
    return Profile(prefill_points=[(8, 3e-3 * scale), (256, 1e-3 * scale)], decode_points=[(1, 0.03 * scale), (8, 0.04 * scale)],
                   overhead_s=0.005 * scale, prefill_ctx=1e-7 * scale, decode_ctx=1e-6 * scale)


GRID = [["--scheduler", "static", "--max-num-seqs", "4"],
        ["--scheduler", "continuous", "--admit-k", "2", "--max-num-seqs", "4"],
        ["--scheduler", "chunked", "--chunk", "8", "--max-num-seqs", "4"],
        ["--scheduler", "batched", "--mixed-prefill-quantum", "16", "--max-num-seqs", "4"]]


def bench_doc(profile: Profile, w: Workload, repeats: int = 2) -> dict:
    """A bench-shaped result whose runs were produced by the simulator with ``profile``,
    with prompt lengths that differ per request (as a tokenizer's would)."""
    conds = []
    for flags in GRID:
        runs = []
        for r in range(repeats):
            lengths = [20 + (7 * i + r) % 13 for i in range(w.total_requests())]
            runs.append(Simulation(profile, sched_config(flags), replace(w, seed=w.seed + r), prompt_lengths=lengths).run())
        conds.append(condition(" ".join(flags[:4]), runs, flags))
    return output.document("sweep", "test", w, repeats, conds, None)


BURST = Workload(kind="burst", num_requests=10, prompt_words=24, max_tokens=12)


def test_scheduler_config_comes_from_the_serve_parser():
    s = sched_config(["--scheduler", "chunked", "--chunk", "16", "--max-num-seqs", "4", "--max-model-len", "256"])
    assert (s.name, s.max_num_seqs, s.knobs["chunk"]) == ("chunked", 4, 16)
    assert sched_config([]).name == "batched"  # serve's default
    with pytest.raises(CompareError, match="--chunk does not apply"):
        sched_config(["--scheduler", "static", "--chunk", "8"])
    with pytest.raises(CompareError, match="invalid choice: 'bogus'"):
        sched_config(["--scheduler", "bogus"])


def test_prompt_lengths_are_replayed_by_request_id_and_fall_back_to_words():
    run = Simulation(prof(), sched_config([]), Workload(num_requests=4, prompt_words=10, max_tokens=2),
                     prompt_lengths=[5, 0, 9]).run()
    assert [s["prompt_tokens"] for s in run["samples"]] == [5, 10, 9, 10]


@pytest.mark.parametrize("w", [BURST, Workload(kind="probe", sessions=2, prompt_words=8, session_tokens=200,
                                                 probe_words=300, max_tokens=2, probe_delay=0.2)])
def test_replaying_with_the_measuring_profile_gives_zero_error_and_the_same_schedule(w):
    rows = compare(prof(), [("m.json", bench_doc(prof(), w))])
    assert len(rows) == len(GRID)
    for r in rows:
        for k, _, _ in FIGURES:
            assert r["rel_error"][k] == pytest.approx(0.0, abs=1e-9), (r["condition"], k)
        assert [r["simulated"][k] for k in STEPS] == [r["measured"][k] for k in STEPS]
    assert summary(rows)["all"] == pytest.approx(0.0, abs=1e-9)


def test_a_profile_twice_as_slow_doubles_itl_and_halves_the_rates():
    rows = compare(prof(2.0), [("m.json", bench_doc(prof(), BURST))])
    for r in rows:
        assert r["rel_error"]["itl_p50"] == pytest.approx(1.0, rel=1e-6)
        assert r["rel_error"]["itl_p99"] == pytest.approx(1.0, rel=1e-6)
        assert r["rel_error"]["throughput"] == pytest.approx(-0.5, rel=1e-6)
        assert r["rel_error"]["prefill_rate"] == pytest.approx(-0.5, rel=1e-6)
    s = summary(rows)
    assert s["itl_p50"] == pytest.approx(1.0) and s["throughput"] == pytest.approx(0.5)


def test_each_draw_simulates_a_measured_repeat_with_its_own_step_noise():
    noisy = Profile(**{**prof().__dict__, "step_noise": [0.5, 1.0, 2.0]})
    doc = bench_doc(prof(), BURST, repeats=2)
    cond, w = doc["conditions"][0], Workload.from_dict(doc["workload"])
    one, five = simulate_condition(noisy, cond, w, 3600.0), simulate_condition(noisy, cond, w, 3600.0, draws=5)
    assert len(one) == 2 and len(five) == 10
    assert [r["trace"] for r in five[::5]] == [r["trace"] for r in one]  # the first draw is the workload's own seed
    itl = {r["metrics"]["trace"]["itl"]["p50"] for r in five[:5]}
    assert len(itl) > 1  # the other draws differ in their step times
    (row_,) = [r for r in compare(noisy, [("m.json", doc)], draws=5) if r["condition"] == cond["name"]]
    assert row_["simulated"]["itl_p50"][0] == pytest.approx(statistics.median(
        [repeat_figures(r["metrics"])["itl_p50"] for r in five]))


def test_each_figure_is_checked_against_the_measured_spread():
    keys = [k for k, _, _ in FIGURES]
    measured = [{k: 1.0 for k in keys}, {k: 1.2 for k in keys}, {k: 1.1 for k in keys}]
    sims = {"ttft_p50": 1.15, "ttft_p99": 1.25, "itl_p50": 1.0, "itl_p99": 0.995, "throughput": 2.0, "prefill_rate": 1.2}
    r = row("m.json", "c", None, BURST.describe(), measured, [sims])
    assert r["spread"]["ttft_p50"] == (1.0, 1.2)
    assert r["outside"] == ["ttft_p99", "itl_p99", "throughput"]  # 1.25 > 1.2, 0.995 < 1.0, 2.0 > 1.2
    assert r["misses"] == ["ttft_p99", "throughput"]  # 0.995 is within 10% of the median 1.1; 1.25 and 2.0 are not
    table = markdown_table([r])
    assert table.count("**miss**") == 2 and table.count(" out") == 1
    assert summary([r])["misses"] == 2 and summary([r])["figures"] == 6


def test_ratios_between_the_conditions_of_a_file_are_compared():
    keys = [k for k, _, _ in FIGURES]
    base = row("m.json", "q128", None, BURST.describe(), [{k: 2.0 for k in keys}], [{k: 2.0 for k in keys}])
    other = row("m.json", "q2048", None, BURST.describe(), [{k: 1.0 for k in keys}], [{k: 1.1 for k in keys}])
    alone = row("n.json", "x", None, BURST.describe(), [{k: 1.0 for k in keys}], [{k: 1.0 for k in keys}])
    (r,) = ratio_rows([base, other, alone])  # n.json has one condition: no ratio
    assert (r["condition"], r["over"]) == ("q2048", "q128")
    assert r["ratio"]["ttft_p99"] == pytest.approx((0.55, 0.5)) and r["rel_error"]["ttft_p99"] == pytest.approx(0.1)
    assert "| q2048 over q128 | 0.55 / 0.50 (0.50-0.50) +10% **miss** |" in ratio_table([r])  # one repeat: no spread
    # two repeats each: the measured ratio spreads 0.4-0.6 (repeat by repeat), so 0.55 is inside and 0.7 a miss
    base = row("m.json", "q128", None, BURST.describe(), [{k: 2.0 for k in keys}, {k: 2.5 for k in keys}], [{k: 2.0 for k in keys}])
    wide = row("m.json", "q2048", None, BURST.describe(), [{k: 1.2 for k in keys}, {k: 1.0 for k in keys}],
               [{**{k: 1.1 for k in keys}, "itl_p99": 1.4}])
    (r,) = ratio_rows([base, wide])
    assert r["spread"]["ttft_p99"] == pytest.approx((0.4, 0.6)) and r["outside"] == r["misses"] == ["itl_p99"]
    assert "0.70 / 0.49 (0.40-0.60) +43% **miss**" in ratio_table([r])


def test_a_slower_profile_is_flagged_outside_the_spread():
    rows = compare(prof(2.0), [("m.json", bench_doc(prof(), BURST))])
    for r in rows:
        assert {"itl_p50", "itl_p99", "throughput", "ttft_p50"} <= set(r["misses"])
        assert r["rel_error"]["ttft_p50"] > 0.5


def test_documents_that_are_not_bench_results_are_refused():
    with pytest.raises(CompareError, match="not a quanta bench result"):
        compare(prof(), [("x.json", {"kind": "sim-compare"})])
    doc = bench_doc(prof(), BURST, repeats=1)
    for c in doc["conditions"]:
        c["valid"] = False
    with pytest.raises(CompareError, match="no measured condition"):
        compare(prof(), [("x.json", doc)])


def test_cli_writes_the_comparison_report_with_a_second_profile(tmp_path, capsys):
    measured, p1, p2 = tmp_path / "m.json", tmp_path / "p1.json", tmp_path / "p2.json"
    output.write_json(bench_doc(prof(), BURST), measured)
    prof().save(p1)
    prof(2.0).save(p2)
    prefix = tmp_path / "cmp"
    assert cli.main(["simulate", "--profile", str(p1), "--compare", str(measured), "--also-profile", str(p2),
                     "--out", str(prefix)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| condition | TTFT p50 ms") and "Median absolute relative error: **0%**" in out
    assert f"0 of {6 * len(GRID)} figures are outside the measured min-max" in out
    doc = json.loads(prefix.with_suffix(".json").read_text())
    assert doc["kind"] == "sim-compare" and len(doc["rows"]) == len(GRID) == len(doc["also_rows"])
    assert doc["summary"]["all"] == pytest.approx(0.0, abs=1e-4)  # the JSON rounds times to microseconds
    assert doc["also_summary"]["itl_p99"] == pytest.approx(1.0, rel=1e-3)
    md = prefix.with_suffix(".md").read_text()
    assert "second profile" in md and md.count("| --scheduler static") == 2 and "+100%" in md


@pytest.mark.parametrize("extra, message", [
    (["--compare", "/nonexistent.json"], "cannot read /nonexistent.json"),
    (["--also-profile", "p.json"], "--also-profile needs --compare"),
    (["--draws", "3"], "--draws needs --compare"),
    (["--compare", "{m}", "--draws", "0"], "--draws must be 1-100"),
    (["--compare", "{m}", "--sweep", "--scheduler static"], "does not take --sweep"),
    (["--compare", "{p}"], "not a quanta bench result"),
])
def test_cli_rejects_bad_compare_input(tmp_path, capsys, extra, message):
    measured, p1 = tmp_path / "m.json", tmp_path / "p1.json"
    output.write_json(bench_doc(prof(), BURST, repeats=1), measured)
    prof().save(p1)
    argv = ["simulate", "--profile", str(p1), *[a.format(m=measured, p=p1) for a in extra]]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err



def test_auto_quantum_of_a_bench_condition_is_the_value_the_server_applied():
    flags = ["--scheduler", "batched", "--mixed-prefill-quantum", "auto"]
    assert sched_config(flags, {"mixed_prefill_quantum": 64}).knobs["mixed_prefill_quantum"] == 64
    with pytest.raises(CompareError, match="no applied mixed_prefill_quantum"):
        sched_config(flags, {})


def test_a_bench_run_condition_is_simulated_from_the_config_the_server_reported():
    doc = bench_doc(prof(), BURST, repeats=1)
    doc["conditions"] = doc["conditions"][2:3]  # chunked C=8 on 4 slots
    cond = doc["conditions"][0]
    cond["flags"] = None  # as quanta bench run records it
    cond["applied"] = {"model": "m", "dtype": "bfloat16", "scheduler": "chunked", "max_num_seqs": 4, "chunk": 8,
                       "admit_k": 1, "prefill_cap": 4096, "prefix_cache": False}
    (r,) = compare(prof(), [("run.json", doc)])
    assert r["rel_error"]["itl_p99"] == pytest.approx(0.0, abs=1e-9)
    cond["applied"] = None  # another server: no /v1/config
    with pytest.raises(CompareError, match="scheduler is unknown"):
        compare(prof(), [("run.json", doc)])
    doc["workload"]["bogus"] = 1
    with pytest.raises(CompareError, match="not one quanta bench knows"):
        compare(prof(), [("run.json", doc)])


def test_simulated_malformed_and_truncated_inputs_are_refused():
    sim_doc = bench_doc(prof(), BURST, repeats=1)
    sim_doc["kind"] = "simulate"
    with pytest.raises(CompareError, match="simulated, not measured"):
        compare(prof(), [("s.json", sim_doc)])
    broken = bench_doc(prof(), BURST, repeats=1)
    del broken["conditions"][0]["runs"][0]["samples"]
    with pytest.raises(CompareError, match="malformed quanta bench result"):
        compare(prof(), [("b.json", broken)])
    with pytest.raises(CompareError, match="ran past --max-duration 0.1 s"):
        compare(prof(), [("m.json", bench_doc(prof(), BURST, repeats=1))], max_duration=0.1)


@pytest.mark.parametrize("extra, message", [
    (["--num-requests", "5"], "drop --num-requests"),
    (["--scheduler", "static"], "drop --scheduler"),
    (["--scheduler", "batched", "--max-num-seqs", "8"], "drop --max-num-seqs, --scheduler"),  # defaults too
    (["--compare", "{m}"], "the same file is given twice"),
])
def test_cli_compare_refuses_flags_it_would_ignore(tmp_path, capsys, extra, message):
    measured, p1 = tmp_path / "m.json", tmp_path / "p1.json"
    output.write_json(bench_doc(prof(), BURST, repeats=1), measured)
    prof().save(p1)
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "--profile", str(p1), "--compare", str(measured), *[a.format(m=measured) for a in extra]])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_cli_sweep_refuses_flags_that_are_not_scheduler_flags(tmp_path, capsys):
    p1 = tmp_path / "p1.json"
    prof().save(p1)
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "--profile", str(p1), "--sweep", "--scheduler batched --num-requests 10,20"])
    assert info.value.code == 2 and "--max-num-seqs and the knobs), not --num-requests" in capsys.readouterr().err


def test_unwritable_out_is_refused_before_any_work(tmp_path, capsys):
    p1, blocker = tmp_path / "p1.json", tmp_path / "afile"
    prof().save(p1)
    blocker.write_text("x")
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "--profile", str(p1), "--num-requests", "2", "--out", str(blocker / "x")])
    assert info.value.code == 2 and "--out: cannot create" in capsys.readouterr().err


def test_a_cluster_condition_is_replayed_on_replicas_behind_its_router():
    from quanta.sim.compare import replica_settings, simulate_condition
    from quanta.sim.replicas import simulate_replicas

    w = Workload(kind="replay", sessions=4, turns=3, prompt_words=200, tool_words=20, max_tokens=8, stagger=0.5)
    sched = sched_config(["--scheduler", "batched", "--max-num-seqs", "4"])
    applied = {"scheduler": "batched", "max_num_seqs": 4, "mixed_prefill_quantum": 2048, "prefill_quantum": 2048,
               "prefill_cap": 4096, "prefix_cache": True,
               "cluster": {"replicas": 2, "routing": "prefix", "routed": [0, 0]}}  # a front before load_tokens
    assert replica_settings(applied) == {"replicas": 2, "routing": "prefix", "max_waiting": 4, "load_tokens": 0}
    measured = simulate_replicas(prof(), sched, w, replicas=2, routing="prefix", load_tokens=0, prefix_cache=True)
    cond = condition("prefix", [measured])
    cond["applied"] = applied
    (sim,) = simulate_condition(prof(), cond, w, 3600.0)
    assert sim["replicas"]["requests"] == measured["replicas"]["requests"] and min(sim["replicas"]["requests"]) > 0
    assert [s["cached_tokens"] for s in sim["samples"]] == [s["cached_tokens"] for s in measured["samples"]]
    # a cluster's bench result has no server trace: its trace figures are missing, the rest compared
    cond["figures"] = [{k: v for k, v in f.items() if k not in ("prefill_rate", *STEPS)} for f in cond["figures"]]
    (r,) = compare(prof(), [("cluster.json", output.document("run", "test", w, 1, [cond], None))])
    assert r["rel_error"]["throughput"] == pytest.approx(0.0, abs=1e-9) and math.isnan(r["rel_error"]["prefill_rate"])
    assert "/ - |" in markdown_table([r]) and "vs -/-/- |" in markdown_table([r])
    applied["cluster"]["routing"] = "round-robin"
    (rr,) = simulate_condition(prof(), cond, w, 3600.0)
    assert rr["replicas"]["routing"] == "round-robin"
    assert rr["metrics"]["client"]["prefix_hit_share"] < sim["metrics"]["client"]["prefix_hit_share"]
    applied["cluster"]["replicas"] = "two"
    with pytest.raises(CompareError, match="cluster settings"):
        simulate_condition(prof(), cond, w, 3600.0)


def test_a_cancelled_stream_takes_its_prompt_length_from_the_trace_cached_prefix_included():
    from quanta.sim.compare import prompt_lengths

    trace = [{"step": 0, "kind": "prefill", "start": 0.0, "end": 0.1, "seq_ids": [0], "num_new_tokens": [50],
              "num_emitted": [1], "positions": [0]},
             {"step": 1, "kind": "prefill", "start": 0.2, "end": 0.3, "seq_ids": [1], "num_new_tokens": [80],
              "num_emitted": [1], "positions": [320]}]
    run = {"samples": [{"id": 0, "prompt_tokens": 50, "sent": 0.0}, {"id": 1, "prompt_tokens": None, "sent": 0.1}],
           "trace": trace}
    assert prompt_lengths(run) == [50, 400]
    old = [{k: v for k, v in r.items() if k != "positions"} for r in trace]  # a trace without positions
    assert prompt_lengths({**run, "trace": old}) == [50, 80]


def draws_row(name: str, source: str, draws: list[list[float]]) -> dict:
    """A row whose simulated draws (``[repeat][draw]``) have every figure at ``scale x (its index + 1)``."""
    figs = [[{k: v * (i + 1) for i, (k, _, _) in enumerate(FIGURES)} for v in d] for d in draws]
    r = row(source, name, None, BURST.describe(), [d[0] for d in figs], [f for d in figs for f in d[1:]])
    r["draws"] = figs
    return r


def test_chance_takes_each_draw_as_the_measured_repeats_against_the_others():
    # 3 repeats x 4 draws; draw 2 of every repeat is 1.5x the others: taken as measured it is 33% off the
    # others' median and outside its own (zero) spread; any other draw against the rest is inside its spread
    r = draws_row("c", "a.json", [[1.5 if k == 2 else 1.0 + 0.01 * rep for k in range(4)] for rep in range(3)])
    c = chance([r])
    assert c["draws"] == 4 and c["misses"] == [0, 0, len(FIGURES), 0]
    assert c["none"] == 0.75 and c["per_figure"] == {k: 0.25 for k, _, _ in FIGURES}
    assert c["ratio_misses"] == [0, 0, 0, 0]  # one condition: no ratio


def test_chance_counts_the_ratios_between_a_files_conditions_apart():
    # the second condition's draw 0 is 3x the first's, its other draws 2x: draw 0 taken as measured misses
    # the second condition's figures and every ratio by a third; the other draws against the rest miss nothing
    first = draws_row("q128", "p.json", [[1.0] * 8 for _ in range(3)])
    second = draws_row("q2048", "p.json", [[3.0 if k == 0 else 2.0 for k in range(8)] for _ in range(3)])
    c = chance([first, second])
    assert c["misses"] == [len(FIGURES)] + [0] * 7
    assert c["ratio_misses"] == [len(FIGURES)] + [0] * 7


def test_compare_reports_the_chance_misses_with_two_draws_or_more():
    noisy = Profile(**{**prof().__dict__, "step_noise": [0.5, 1.0, 2.0]})
    doc = bench_doc(prof(), BURST, repeats=2)
    assert summary(compare(noisy, [("m.json", doc)]))["chance"] is None  # one draw: nothing to stand in
    rows = compare(noisy, [("m.json", doc)], draws=3)
    assert all(len(r["draws"]) == 2 and all(len(d) == 3 for d in r["draws"]) for r in rows)
    c = summary(rows)["chance"]
    assert c["draws"] == 3 and len(c["misses"]) == 3 and 0 <= c["none"] <= 1
    assert "an exact simulator would miss" in summary_lines(summary(rows))
