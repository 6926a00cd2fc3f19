"""Fitting a cost profile to a server's step trace (``quanta profile-engine --from-bench``).

The traces here come from the simulator run with a known profile, so the fitted
profile's predictions can be checked against the true step costs.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest

from quanta import cli
from quanta.bench import output
from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.sim import Profile
from quanta.sim.fit import WAKE_IDLE_S, FitError, fit, steps_from_trace
from quanta.sim.profile import ProfileError, Wake
from quanta.sim.run import simulate

TRUE = Profile(prefill_points=[(8, 3e-3), (64, 1.5e-3), (256, 1e-3)], decode_points=[(1, 0.03), (4, 0.033), (8, 0.04)],
               overhead_s=0.005, prefill_ctx=1e-7, decode_ctx=1e-6)
TRUE_SLOWER = Profile(**{**TRUE.__dict__, "prefill_points": [(x, 1.5 * y) for x, y in TRUE.prefill_points],
                         "decode_points": [(x, 1.5 * y) for x, y in TRUE.decode_points], "overhead_s": 1.5 * TRUE.overhead_s,
                         "prefill_ctx": 1.5 * TRUE.prefill_ctx, "decode_ctx": 1.5 * TRUE.decode_ctx})
CALIBRATION = Workload(kind="poisson", rate=6.0, num_requests=40, prompt_words=150, max_tokens=24)


def calibration_traces(profile: Profile = TRUE) -> list[list[dict]]:
    out = []
    for q in (16, 64, 256):
        sched = SchedulerConfig("batched", 8, {"prefill_quantum": q, "mixed_prefill_quantum": q})
        out.append(simulate(profile, sched, CALIBRATION)["trace"])
    return out


def rec(step, seq_ids, new, emitted, t0):
    return {"step": step, "kind": "x", "start": t0, "end": t0 + 0.01, "seq_ids": seq_ids, "num_new_tokens": new,
            "num_emitted": emitted}


def test_steps_are_rebuilt_with_prefill_chunks_and_decode_positions():
    records = [rec(0, [1], [10], [1], 0.0), rec(1, [1, 2], [1, 4], [1, 0], 0.0101), rec(2, [2], [4], [1], 0.0203),
               rec(3, [1, 2], [1, 1], [1, 1], 0.5)]
    steps, gaps = steps_from_trace(records)
    assert [(s.prefill, s.decode) for s in steps] == [([(0, 10)], []), ([(0, 4)], [10]), ([(4, 4)], []), ([], [11, 8])]
    assert gaps == pytest.approx([0.0001, 0.0002])  # the step after 0.47 s idle is not back-to-back


def test_a_fitted_profile_predicts_the_steps_it_was_fitted_to():
    traces = calibration_traces()
    fitted = fit(traces, {"name": "fit"})
    errs = []
    for records in traces:
        steps, _ = steps_from_trace(records)
        for s in steps:
            errs.append(abs(fitted.step_cost(s.prefill, s.decode) / TRUE.step_cost(s.prefill, s.decode) - 1))
    assert statistics.median(errs) < 0.02 and max(errs) < 0.2
    assert fitted.meta["fit"]["decode_steps"] > 100 and fitted.meta["fit"]["prefill_steps"] > 30
    assert fitted.step_noise is not None and statistics.median(fitted.step_noise) == pytest.approx(1.0, abs=0.02)
    # batched alternates prefill and decode calls: no fused step, so no interference and no prefix hit is fitted
    assert fitted.meta["fit"]["mixed_steps"] == 0 and fitted.step_model.interference_s_per_row == 0
    assert fitted.step_model.prefix_hit_s_per_token == 0


def test_a_fitted_profile_predicts_another_workload():
    fitted = fit(calibration_traces())
    # inside the calibrated ranges (prefill calls up to ~150 tokens: 8 x 16 here); beyond them the
    # per-token cost is extrapolated flat and the split of the per-call overhead starts to matter
    burst = Workload(kind="burst", num_requests=16, prompt_words=16, max_tokens=16)
    for sched in (SchedulerConfig("static", 8), SchedulerConfig("chunked", 8, {"chunk": 16})):
        true_run, fit_run = simulate(TRUE, sched, burst), simulate(fitted, sched, burst)
        for key in ("throughput",):
            a, b = true_run["metrics"]["client"][key], fit_run["metrics"]["client"][key]
            assert b == pytest.approx(a, rel=0.05)
        a, b = true_run["metrics"]["trace"]["itl"]["p50"], fit_run["metrics"]["trace"]["itl"]["p50"]
        assert b == pytest.approx(a, rel=0.05)


def test_step_noise_is_fitted_from_the_spread_and_drawn_by_the_simulator():
    noisy = Profile(**{**TRUE.__dict__, "step_noise": [0.9, 1.0, 1.0, 1.4]})
    fitted = fit(calibration_traces(noisy))
    assert min(fitted.step_noise) < 0.97 and max(fitted.step_noise) > 1.3
    w = Workload(kind="burst", num_requests=8, prompt_words=16, max_tokens=64)
    itl = simulate(fitted, SchedulerConfig("static", 8), w)["metrics"]["trace"]["itl"]
    assert itl["p99"] > 1.2 * itl["p50"]  # jitter reaches the tail; without noise p99 == p50 here
    plain = simulate(TRUE, SchedulerConfig("static", 8), w)["metrics"]["trace"]["itl"]
    assert plain["p99"] == pytest.approx(plain["p50"], rel=0.05)
    again = simulate(fitted, SchedulerConfig("static", 8), w)["metrics"]["trace"]["itl"]
    assert again == itl  # deterministic given the seed


def test_step_noise_is_fitted_per_bin_of_predicted_cost(tmp_path):
    # decode steps (30-40 ms) jitter by tens of percent, prefill calls (~0.2 s) by 2%: one pooled
    # distribution would give the prefill calls the decode steps' spread
    true = Profile(**{**TRUE.__dict__, "step_noise": [1.0], "step_noise_bins": [(0.05, [0.7, 1.0, 1.0, 1.6]),
                                                                                 (math.inf, [0.98, 1.0, 1.02])]})
    fitted = fit(calibration_traces(true))
    (short, short_f), (long_, long_f) = fitted.step_noise_bins[0], fitted.step_noise_bins[-1]
    assert short == 0.05 and long_ == math.inf
    assert min(short_f) < 0.8 and max(short_f) > 1.4
    assert short_f[89] - short_f[10] > 0.5 and long_f[89] - long_f[10] < 0.1  # the fit's own error widens the long bin a little
    assert fitted.noise_factors(0.03) is short_f and fitted.noise_factors(2.0) is long_f
    fitted.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").step_noise_bins == fitted.step_noise_bins
    w = Workload(kind="burst", num_requests=8, prompt_words=150, max_tokens=4)
    sim = simulate(fitted, SchedulerConfig("static", 8), w)
    prefill = [r["end"] - r["start"] for r in sim["trace"] if r["kind"] == "prefill"]
    exact = fitted.step_cost([(0, 150)] * 8, [])
    assert all(abs(t / exact - 1) < 0.07 for t in prefill), (prefill, exact)  # drawn from the narrow bin


def test_steady_decode_noise_is_fitted_apart_from_first_decodes_and_drawn_for_them(tmp_path):
    # a sequence's first decode step now and then waits several times its cost, a steady decode step does
    # not: the steady steps keep their own narrow spread instead of the short steps' wide one
    true = Profile(**{**TRUE.__dict__, "step_noise": [1.0], "step_noise_bins": [(math.inf, [0.6, 1.0, 1.0, 3.0])],
                      "steady_noise": [0.98, 1.0, 1.02]})
    fitted = fit(calibration_traces(true))
    steady, short = fitted.steady_noise, fitted.step_noise_bins[0][1]
    # the fit's own error, pulled by the first decodes' stalls, widens the steady spread a little
    assert steady is not None and steady[95] - steady[5] < 0.25, steady
    assert min(short) < 0.7 and max(short) > 2.5 and short[95] - short[5] > 1.5
    assert fitted.noise_factors(0.03, steady=True) is steady and fitted.noise_factors(0.03) is short
    fitted.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").steady_noise == steady
    # drawn: every decode step of a sequence that decoded before takes its cost within the steady spread;
    # among the first decodes some draw the wide factors
    w = Workload(kind="burst", num_requests=8, prompt_words=16, max_tokens=32)
    trace = simulate(true, SchedulerConfig("static", 8), w)["trace"]
    steps, _ = steps_from_trace(trace)
    ratios = {kind: [s.t / true.step_cost(s.prefill, s.decode) for s in steps if s.kind == "decode" and s.steady == kind]
              for kind in (True, False)}
    assert len(ratios[True]) > 20 and all(0.97 < r < 1.03 for r in ratios[True]), ratios[True]
    assert ratios[False] and all(r in (0.6, 1.0, 3.0) for r in map(lambda r: round(r, 6), ratios[False]))


def test_first_decodes_are_marked_in_the_rebuilt_steps():
    records = [rec(0, [1, 2], [10, 12], [1, 1], 0.0), rec(1, [1, 2], [1, 1], [1, 1], 0.02), rec(2, [3], [5], [1], 0.04),
               rec(3, [1, 2, 3], [1, 1, 1], [1, 1, 1], 0.06), rec(4, [1, 2, 3], [1, 1, 1], [1, 1, 1], 0.08)]
    steps, _ = steps_from_trace(records)
    assert [(s.kind, s.first_decode, s.steady) for s in steps] == [
        ("prefill", False, False), ("decode", True, False), ("prefill", False, False), ("decode", True, False),
        ("decode", False, True)]


@pytest.mark.parametrize("steady, message", [([], "steady_decode"), ([1.0, -1.0], "steady_decode")])
def test_bad_steady_decode_noise_is_refused(steady, message):
    raw = {**TRUE.to_dict(), "step_noise": {"factors": [1.0], "source": "", "steady_decode": steady}}
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict(raw)


@pytest.mark.parametrize("bins, message", [([{"up_to_s": 0.1, "factors": [1.0]}], "the last null"),
                                           ([{"up_to_s": 0.1, "factors": [1.0]}, {"up_to_s": 0.05, "factors": [1.0]},
                                             {"up_to_s": None, "factors": [1.0]}], "strictly ascending"),
                                           ([{"up_to_s": None, "factors": []}], "non-empty list")])
def test_bad_step_noise_bins_are_refused(bins, message):
    raw = {**TRUE.to_dict(), "step_noise": {"factors": [1.0], "source": "", "by_cost": bins}}
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict(raw)


def test_noise_bins_merge_a_bin_with_too_few_steps_into_its_neighbour():
    from quanta.sim.fit import MIN_NOISE_STEPS, noise_bins

    many, few = [(0.01, 1.0)] * MIN_NOISE_STEPS, [(1.0, 2.0)] * (MIN_NOISE_STEPS - 1)
    middle, top = [(0.1, 1.0)] * MIN_NOISE_STEPS, [(1.0, 2.0)] * MIN_NOISE_STEPS
    assert [b for b, _ in noise_bins(many + middle + top)] == [0.05, 0.5, math.inf]
    assert [b for b, _ in noise_bins(many + top)] == [0.05, math.inf]  # the empty middle bin reaches up to the top's bound
    assert [b for b, _ in noise_bins(many + few)] == [math.inf]  # too few at the top: they join the rest
    bins = noise_bins(many + few[:1] + middle)
    assert [b for b, _ in bins] == [0.05, math.inf] and max(bins[-1][1]) > 1.5  # one top step joins the middle
    assert [b for b, _ in noise_bins(few)] == [math.inf]


def test_too_little_data_is_a_clear_error():
    with pytest.raises(FitError, match="only 1 of the traces' steps have prompt rows; need at least 3"):
        fit([[rec(0, [1], [10], [1], 0.0)]])
    with pytest.raises(FitError, match="only 0 of the traces' steps have decode rows"):
        fit([[rec(i, [i], [10], [1], i * 0.1) for i in range(5)]])


def bench_file(tmp_path, traces, name: str = "cal.json") -> str:
    runs = [{"samples": [], "trace": t, "metrics": None} for t in traces]
    doc = output.document("sweep", "test", CALIBRATION, 1, [{"name": "c", "flags": [], "valid": True, "runs": runs,
                                                              "applied": {"model": "m", "dtype": "bfloat16",
                                                                                  "decode_threads": 3}}], None)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_profile_engine_from_bench_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "fitted.json"
    assert cli.main(["profile-engine", "--from-bench", bench_file(tmp_path, calibration_traces()), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fitted" in printed and "decode" in printed and "p90" in printed
    p = Profile.load(out)
    steady = "/".join(f"{p.steady_noise[i]:.2f}" for i in (50, 90, 99))
    assert f"step noise (measured / predicted time, p50/p90/p99): steady decode steps {steady}; others up to" in printed
    assert p.step_model is not None and p.step_model.threads == {"decode_threads": 3}
    assert {"prefill", "decode"} <= set(p.step_model.fit["residuals"])
    raw = json.loads(out.read_text())
    assert "fitted by quanta profile-engine --from-bench" in raw["source"] and raw["model"] == "m"
    assert raw["step_noise"]["factors"] == p.step_noise and "quantiles" in raw["step_noise"]["source"]


def test_profile_engine_checks_the_fit_on_runs_it_did_not_see(tmp_path, capsys):
    fitted, other = bench_file(tmp_path, calibration_traces()), bench_file(tmp_path, calibration_traces(TRUE_SLOWER), "other.json")
    out = tmp_path / "fitted.json"
    assert cli.main(["profile-engine", "--from-bench", fitted, "--check-bench", other, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "runs of --check-bench (not fitted)" in printed
    check = Profile.load(out).step_model.fit["check"]
    assert check["sources"] == [other]
    assert 0.25 < check["residuals"]["decode"]["median"] < 0.4  # every step of the other runs is 1.5x slower: 1/1.5 - 1
    for argv, message in ((["--from-bench", fitted, "--check-bench", fitted], "is also fitted"),
                          (["--check-bench", other], "--check-bench needs --from-bench")):
        with pytest.raises(SystemExit) as info:
            cli.main(["profile-engine", *argv, "--out", str(out)])
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_profile_engine_from_bench_fits_each_replicas_trace_of_a_cluster_run(tmp_path):
    traces = calibration_traces()
    path = bench_file(tmp_path, [])
    doc = json.loads(open(path).read())
    half = len(traces) // 2
    doc["conditions"][0]["runs"] = [{"samples": [], "trace": None, "metrics": None, "replica_traces": traces[:half]},
                                    {"samples": [], "trace": None, "metrics": None, "replica_traces": [None, *traces[half:]]}]
    open(path, "w").write(json.dumps(doc))
    out = tmp_path / "fitted.json"
    assert cli.main(["profile-engine", "--from-bench", path, "--out", str(out)]) == 0
    both = Profile.load(out).step_model.fit["residuals"]
    assert sum(r["steps"] for r in both.values()) == sum(len(t) for t in traces)  # every replica's steps, none twice


@pytest.mark.parametrize("content, message", [("{", "not a readable quanta bench result"),
                                              (None, "no server trace")])
def test_profile_engine_from_bench_rejects_bad_input(tmp_path, capsys, content, message):
    path = bench_file(tmp_path, [])
    if content is not None:
        open(path, "w").write(content)
    with pytest.raises(SystemExit) as info:
        cli.main(["profile-engine", "--from-bench", path, "--out", str(tmp_path / "x.json")])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_broken_step_records_are_left_out_and_an_all_broken_trace_is_refused():
    traces = calibration_traces()
    bad = [dict(r, end=r["start"] - 1.0) if i % 7 == 0 else r for i, r in enumerate(traces[0])]
    fitted = fit([bad] + traces[1:])
    assert fitted.meta["fit"]["steps"] < sum(len(t) for t in traces)
    assert fitted.step_cost([], [100] * 8) == pytest.approx(fit(traces).step_cost([], [100] * 8), rel=0.02)
    with pytest.raises(FitError):
        fit([[dict(r, end=r["start"]) for r in traces[0]]])


def test_a_simulated_result_is_not_fitted_as_a_measurement(tmp_path, capsys):
    path = bench_file(tmp_path, calibration_traces())
    doc = json.loads(open(path).read())
    doc["kind"] = "simulate"
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(SystemExit) as info:
        cli.main(["profile-engine", "--from-bench", path, "--out", str(tmp_path / "x.json")])
    assert info.value.code == 2 and "simulated, not measured" in capsys.readouterr().err


IDLE_WORKLOAD = Workload(kind="poisson", rate=0.5, num_requests=30, prompt_words=150, max_tokens=24)


def idle_traces(profile: Profile) -> list[list[dict]]:
    """Requests ~2 s apart: each reaches an idle engine, its first prompt chunk (64 tokens, as every other) after
    an idle second or more, its later chunks and decode steps back to back."""
    sched = SchedulerConfig("batched", 8, {"prefill_quantum": 64, "mixed_prefill_quantum": 64})
    return [simulate(profile, sched, replace(IDLE_WORKLOAD, seed=s))["trace"] for s in (1, 2)]


def test_a_step_after_an_idle_engine_is_fitted_as_the_wake_factor():
    woken = fit(idle_traces(Profile(**{**TRUE.__dict__, "wake": Wake(1.0, 1.5)})))
    assert woken.wake is not None and woken.wake.idle_s == WAKE_IDLE_S
    assert woken.wake.factor == pytest.approx(1.5, rel=0.05)
    assert woken.wake.steps >= 15  # requests that met an idle engine (some came while another ran)
    assert statistics.median(woken.step_noise) == pytest.approx(1.0, abs=0.02)  # the factor is not noise too
    plain = fit(idle_traces(TRUE))
    assert plain.wake is not None and plain.wake.factor == pytest.approx(1.0, abs=0.02)


def test_no_wake_factor_without_steps_after_an_idle_engine():
    assert fit(calibration_traces()).wake is None  # 6 requests a second: the engine never idles a second


def test_the_simulator_charges_the_wake_factor_to_the_first_step_after_an_idle_engine():
    w = Workload(kind="burst", num_requests=6, prompt_words=100, max_tokens=8)
    sched, sends = SchedulerConfig("batched", 8), [5.0 * i for i in range(6)]  # each long done before the next
    plain = simulate(TRUE, sched, w, send_delays=sends)
    woken = simulate(Profile(**{**TRUE.__dict__, "wake": Wake(1.0, 2.0)}), sched, w, send_delays=sends)
    def after_idle(run: dict) -> list[int]:
        trace = run["trace"]
        return [i for i, r in enumerate(trace) if i == 0 or r["start"] - trace[i - 1]["end"] >= 1.0]

    firsts = after_idle(plain)
    assert len(firsts) == 6 and after_idle(woken) == firsts  # 5 s between requests that take well under 1 s
    for i, (a, b) in enumerate(zip(plain["trace"], woken["trace"], strict=True)):
        assert b["end"] - b["start"] == pytest.approx((2 if i in firsts else 1) * (a["end"] - a["start"])), i


@pytest.mark.parametrize("wake, message", [({"idle_s": 1.0, "factor": 0.0}, "wake"), ({"idle_s": -1, "factor": 1.2}, "wake"),
                                           ({"factor": 1.2}, "idle_s"), ([1.0, 1.2], "wake must be an object")])
def test_a_bad_wake_block_is_refused(wake, message):
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict({**TRUE.to_dict(), "wake": wake})


def test_the_wake_block_survives_a_round_trip():
    p = Profile(**{**TRUE.__dict__, "wake": Wake(1.0, 1.25, 40)})
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))).wake == Wake(1.0, 1.25, 40)
