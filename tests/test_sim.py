"""The simulator: cost profiles, CostModelExecutor on quanta's own schedulers
and Engine, the shipped seed profile, and ``quanta simulate``.

No timing assertions: every time here is virtual (the cost model's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quanta import cli
from quanta.analysis.report import main_table, repeat_figures
from quanta.analysis.server_trace import trace_metrics
from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepResult
from quanta.engine.sampling import SamplingParams
from quanta.sim import CostModelExecutor, Profile, ProfileError, VirtualClock
from quanta.sim.front import FrontModel
from quanta.sim.run import condition, simulate

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "profiles" / "ds4_m3_ultra_seed.json"


def prof(**kw) -> Profile:
    base = dict(prefill_points=[(128, 4e-3), (1024, 2e-3)], decode_points=[(1, 0.05), (4, 0.08)], overhead_s=0.01)
    return Profile(**{**base, **kw})


# --------------------------------------------------------------------------- profile and cost model


def test_seed_profile_holds_the_published_numbers_and_says_what_is_assumed():
    raw = json.loads(SEED.read_text())
    p = Profile.load(SEED)
    assert raw["source"] and raw["published"] and raw["assumed"]
    for q, ms in [(128, 3.22), (512, 2.67), (1024, 2.18), (2048, 1.88), (4096, 1.79)]:
        assert p.prefill_per_token(q) == pytest.approx(ms / 1e3)
    assert 11 <= 1 / p.decode_cost([1000] * 3) <= 12  # tok/s per session with 3 sessions
    assert raw["scheduler"]["prefill_cap"] == 4096
    assert any("overhead_s" in a for a in raw["assumed"]) and any("mixed_decode_factor" in a for a in raw["assumed"])


def test_interpolation_is_exact_at_points_monotone_between_and_flat_beyond():
    p = prof()
    assert p.prefill_per_token(128) == 4e-3 and p.prefill_per_token(1024) == 2e-3
    assert p.prefill_per_token(16) == 4e-3 and p.prefill_per_token(8192) == 2e-3
    mid = p.prefill_per_token(int(math.sqrt(128 * 1024)))  # geometric midpoint: log-linear
    assert mid == pytest.approx(3e-3, rel=1e-3)
    xs = [p.prefill_per_token(n) for n in range(128, 1025, 7)]
    assert all(a >= b for a, b in zip(xs, xs[1:]))
    assert p.decode_cost([0]) == 0.05 and p.decode_cost([0] * 4) == 0.08
    assert p.decode_cost([0] * 7) == pytest.approx(0.11)  # linear past the last point


def test_context_terms():
    p = prof(prefill_ctx=1e-6, decode_ctx=1e-5)
    # chunk of 10 tokens at positions 100..109: mean position 104.5
    assert p.prefill_cost([(100, 10)]) == pytest.approx(10 * p.prefill_per_token(10) + 1e-6 * 10 * 104.5)
    assert p.decode_cost([100, 300]) == pytest.approx(p.decode_cost([0, 0]) + 1e-5 * 400)


@pytest.mark.parametrize("factor", [1.0, 0.5, 0.0])
def test_combination_rule_of_fused_steps(factor):
    # stated rule: overhead + prefill(all prefill chunks together) + f * decode(decodes); f = 1 without prefill
    p = prof(mixed_decode_factor=factor)
    pre, dec = [(0, 200), (0, 56)], [10, 20, 30]
    assert p.step_cost(pre, dec) == pytest.approx(0.01 + 256 * p.prefill_per_token(256) + factor * p.decode_cost(dec))
    assert p.step_cost([], dec) == pytest.approx(0.01 + p.decode_cost(dec))
    assert p.step_cost(pre, []) == pytest.approx(0.01 + 256 * p.prefill_per_token(256))


def test_moe_axis_uses_tokens_per_expert():
    p = prof(prefill_axis="tokens_per_expert", moe={"num_experts": 64, "top_k": 4}, prefill_points=[(1, 4e-3), (16, 1e-3)])
    assert p.prefill_x(1) == pytest.approx(4 / (64 * (1 - (63 / 64) ** 4)))  # ~1: 4 slots on ~3.9 distinct experts
    assert p.prefill_x(4096) == pytest.approx(4096 * 4 / 64, rel=1e-6)  # every expert hit
    assert p.prefill_per_token(4096) == 1e-3


def test_profile_json_round_trip_and_errors(tmp_path):
    p = Profile.load(SEED)
    f = tmp_path / "p.json"
    p.save(f)
    q = Profile.load(f)
    assert q.to_dict() == p.to_dict()
    bad = p.to_dict()
    bad["prefill"]["points"] = [[512, 1e-3], [128, 2e-3]]
    f.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match="ascending"):
        Profile.load(f)
    f.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ProfileError, match="format"):
        Profile.load(f)
    with pytest.raises(ProfileError, match="tokens_per_expert"):
        prof(prefill_axis="tokens_per_expert").validate()


# --------------------------------------------------------------------------- executor on the shared scheduler classes


class Recorder(Executor):
    """Plain executor (no cost model) to get the policy's own step sequence."""

    def __init__(self):
        self.t = 0.0

    def execute(self, plan, interrupt=None):
        self.t += 1.0
        return StepResult([7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None for c in plan.chunks])


def _drive(sched_cfg, executor, clock, requests):
    engine = Engine(sched_cfg.build(), executor, 100_000, clock=clock)
    for n, m in requests:
        engine.add_request([1] * n, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    return engine.trace.to_dicts()


CONFIGS = [SchedulerConfig("batched", 4, {"prefill_quantum": 256, "mixed_prefill_quantum": 64, "prefill_cap": 512}),
           SchedulerConfig("static", 4), SchedulerConfig("continuous", 4, {"admit_k": 2}),
           SchedulerConfig("chunked", 4, {"chunk": 64, "admit_k": 1, "prefill_cap": 512}),
           SchedulerConfig("budget", 4, {"max_num_batched_tokens": 96})]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_cost_model_executor_runs_the_policies_step_for_step_and_times_each_step_by_the_model(cfg):
    reqs = [(300, 5), (40, 9), (700, 3), (10, 12), (129, 4), (64, 2)]
    rec = Recorder()
    plain = _drive(cfg, rec, lambda: rec.t, reqs)
    p = prof(prefill_ctx=1e-7, decode_ctx=1e-6, mixed_decode_factor=0.7)
    clock = VirtualClock()
    ex = CostModelExecutor(p, clock)
    costs = []
    orig = ex.cost
    ex.cost = lambda plan: costs.append(orig(plan)) or costs[-1]
    sim = _drive(cfg, ex, clock, reqs)
    key = lambda r: (r["kind"], r["seq_ids"], r["num_new_tokens"], r["num_emitted"])  # noqa: E731
    assert list(map(key, sim)) == list(map(key, plain))  # same scheduler decisions
    assert [r["end"] - r["start"] for r in sim] == pytest.approx(costs)
    assert all(a["end"] == b["start"] for a, b in zip(sim, sim[1:]))  # back to back: all arrive at 0
    # the first step is a pure prefill from position 0: the rule by hand
    first = sim[0]
    n = sum(first["num_new_tokens"])
    expected = 0.01 + n * p.prefill_per_token(n) + 1e-7 * sum(c * (c - 1) / 2 for c in first["num_new_tokens"])
    assert first["kind"] == "prefill" and first["end"] - first["start"] == pytest.approx(expected)


def test_mixed_steps_are_costed_by_the_rule():
    cfg = SchedulerConfig("budget", 4, {"max_num_batched_tokens": 64})
    p = prof(mixed_decode_factor=0.5)
    clock = VirtualClock()
    sim = _drive(cfg, CostModelExecutor(p, clock), clock, [(8, 20), (500, 2)])
    mixed = [r for r in sim if r["kind"] == "mixed"]
    assert mixed
    for r in mixed:  # one decode (seq 0) and one prefill chunk of seq 1, whose start position is known
        (d_i,) = [i for i, s in enumerate(r["seq_ids"]) if s == 0]
        pre = sum(n for i, n in enumerate(r["num_new_tokens"]) if i != d_i)
        assert r["end"] - r["start"] == pytest.approx(0.01 + pre * p.prefill_per_token(pre) + 0.5 * 0.05)


def test_prefill_rate_without_decode_does_not_depend_on_the_mixed_quantum():
    # burst of long prompts, max_tokens 1: the first token ends each request at its
    # prefill, so nothing ever decodes and the mixed quantum is never used.
    p = Profile.load(SEED)
    w = Workload(kind="burst", num_requests=6, prompt_words=4096, max_tokens=1)
    rates = {}
    for mpq in (128, 512, 1024, 2048, 4096):
        cfg = SchedulerConfig("batched", 8, {"prefill_quantum": 2048, "mixed_prefill_quantum": mpq, "prefill_cap": 4096})
        run = simulate(p, cfg, w)
        t = run["metrics"]["trace"]
        assert t["steps"]["decode"] == t["steps"]["mixed"] == 0
        rates[mpq] = t["prefill_rate"]
    assert len(set(rates.values())) == 1, rates
    # while the (pure) prefill quantum itself does move it: the check is not vacuous
    other = simulate(p, SchedulerConfig("batched", 8, {"prefill_quantum": 512, "mixed_prefill_quantum": 2048,
                                                        "prefill_cap": 4096}), w)
    assert other["metrics"]["trace"]["prefill_rate"] < rates[2048]
    assert rates[2048] == pytest.approx(1 / 1.88e-3, rel=0.01)  # 2048-token calls at 1.88 ms/token


# --------------------------------------------------------------------------- workloads, determinism, analysis


def test_256_request_burst_completes_and_is_deterministic():
    p = Profile.load(SEED)
    cfg = SchedulerConfig("continuous", 32, {"admit_k": 8})
    w = Workload(kind="burst", num_requests=256, prompt_words=64, max_tokens=32, seed=3)
    a, b = simulate(p, cfg, w), simulate(p, cfg, w)
    assert a["samples"] == b["samples"] and a["trace"] == b["trace"]
    c = a["metrics"]["client"]
    assert c["num_ok"] == 256 and c["num_failed"] == 0 and c["output_tokens"] == 256 * 32


@pytest.mark.parametrize("front", [None, FrontModel(0.006, 2e-6, 0.001, noise=[-0.002, 0.0, 0.003])], ids=["no front", "front"])
@pytest.mark.parametrize("kind", ["poisson", "gamma", "concurrency", "probe", "replay"])
def test_every_bench_workload_runs_and_feeds_the_bench_analysis(kind, front):
    p = Profile.load(SEED)
    p.front = front
    cfg = SchedulerConfig("chunked", 4, {"chunk": 512})
    w = Workload(kind=kind, num_requests=12, prompt_words=100, max_tokens=8, rate=2.0, concurrency=3, sessions=2,
                 session_tokens=400, probe_words=3000, probe_delay=0.5, turns=2, tool_words=50, stagger=1.0, seed=1)
    run = simulate(p, cfg, w)
    assert run == simulate(p, cfg, w)
    assert run["metrics"]["client"]["num_failed"] == 0
    assert run["metrics"]["client"]["num_ok"] == w.total_requests()
    assert trace_metrics(run["trace"]) == run["metrics"]["trace"]
    f = repeat_figures(run["metrics"])
    assert f["itl_source"] == "server trace" and f["throughput"] > 0
    if kind == "probe":
        assert run["metrics"]["probe"] is not None
    if kind == "poisson":
        other = simulate(p, cfg, Workload(**{**w.to_dict(), "seed": 2}))
        assert [s["scheduled"] for s in other["samples"]] != [s["scheduled"] for s in run["samples"]]
    table = main_table([condition(kind, [run])], None)
    assert table.count("\n") == 2 and f"| {kind} |" in table


# --------------------------------------------------------------------------- CLI


def test_simulate_cli_prints_the_bench_table(capsys):
    assert cli.main(["simulate", "--profile", str(SEED), "--num-requests", "16", "--max-tokens", "8",
                     "--scheduler", "chunked", "--chunk", "256"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| condition | prefill calls | decode steps |") and "| chunked |" in out


def test_simulate_cli_sweep_writes_the_report(tmp_path, capsys):
    prefix = tmp_path / "sim_sweep"
    assert cli.main(["simulate", "--profile", str(SEED), "--num-requests", "12", "--max-tokens", "4",
                     "--sweep", "--scheduler continuous --admit-k 1,4", "--sweep", "--scheduler static",
                     "--sweep", "--scheduler chunked --chunk 64,256", "--out", str(prefix)]) == 0
    out = capsys.readouterr().out
    assert "continuous K=1" in out and "continuous K=4" in out and "| static |" in out and "chunked C=256" in out
    doc = json.loads(prefix.with_suffix(".json").read_text())
    assert doc["kind"] == "simulate" and len(doc["conditions"]) == 5
    md = prefix.with_suffix(".md").read_text()
    for plot in ("frontier", "itl-cdf", "prefill-rate"):  # the bench report's plots, linked from the report
        png = tmp_path / f"sim_sweep-{plot}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.name in md


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--profile", "/nonexistent.json"], "cannot read profile"),
    (["simulate", "--profile", str(SEED), "--scheduler", "static", "--chunk", "8"], "--chunk does not apply"),
    (["simulate", "--profile", str(SEED), "--prefill-cap", "1", "--prefill-cap", "2"], "more than once"),
])
def test_simulate_cli_rejects_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_profile_engine_measures_a_loadable_profile(tmp_path, capsys):
    # real model, smallest sizes (seconds on a loaded 2-core machine); no timing asserted
    out = tmp_path / "engine.json"
    assert cli.main(["profile-engine", "--out", str(out), "--chunks", "4,8", "--positions", "0,16", "--batches", "1,2",
                     "--decode-contexts", "8,32", "--repeats", "1", "--dtype", "fp32"]) == 0
    p = Profile.load(out)
    raw = json.loads(out.read_text())
    assert "measured by quanta profile-engine" in raw["source"] and set(raw["spread"]) == {"decode", "prefill"}
    # the KV geometry of the embedded model and the cache --kv-cache-dtype auto gives an fp32 model
    assert raw["kv"] == {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "float16"}
    assert [x for x, _ in p.prefill_points] == [4.0, 8.0] and [x for x, _ in p.decode_points] == [1.0, 2.0]
    assert p.overhead_s >= 0 and p.prefill_ctx >= 0 and p.decode_ctx >= 0 and "2@32" in raw["spread"]["decode"]
    # points are stored net of overhead and context terms: the cost model gives back each measured median
    # (unless a point was clamped at 0, which only a noisy measurement can cause)
    for b, net in p.decode_points:
        if net > 0:
            assert p.step_cost([], [8] * int(b)) == pytest.approx(raw["spread"]["decode"][str(int(b))][1])
    for n, net in p.prefill_points:
        if net > 0:
            assert p.step_cost([(0, int(n))], []) == pytest.approx(raw["spread"]["prefill"][f"{int(n)}@0"][1])
    run = simulate(p, SchedulerConfig("batched", 2), Workload(num_requests=3, prompt_words=8, max_tokens=3))
    assert run["metrics"]["client"]["num_ok"] == 3


def test_profile_engine_rejects_bad_lists_before_loading(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["profile-engine", "--out", "x.json", "--chunks", "a,b"])
    assert info.value.code == 2 and "--chunks" in capsys.readouterr().err


# --------------------------------------------------------------------------- --mixed-prefill-quantum auto


def test_auto_quantum_of_a_moe_profile_follows_the_tokens_per_expert_rule():
    from quanta.sim.auto import resolve_auto

    p = prof(prefill_axis="tokens_per_expert", moe={"num_experts": 256, "top_k": 6})
    sched, advice = resolve_auto(p, SchedulerConfig("batched", 4, {"mixed_prefill_quantum": 1}))
    assert sched.knobs["mixed_prefill_quantum"] == advice.quantum == 2048  # 48 tokens/expert x 256 / 6
    assert "E=256" in advice.reason


def test_auto_quantum_of_a_dense_profile_is_the_smallest_within_5_percent_of_the_best(capsys):
    from quanta.moe.formulas import power_of_two_divisors

    p = Profile.load(SEED)
    assert cli.main(["simulate", "--profile", str(SEED), "--mixed-prefill-quantum", "auto", "--num-requests", "4",
                     "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    q = int(err.split("mixed_prefill_quantum=auto -> ")[1].split(":")[0])
    costs = {c: p.prefill_per_token(c) for c in power_of_two_divisors(4096)}
    best = min(costs.values())
    assert costs[q] <= best * 1.05 and all(costs[c] > best * 1.05 for c in costs if c < q)


def test_cancelled_probe_sessions_get_no_usage_and_their_tokens_count_in_the_throughput():
    w = Workload(kind="probe", sessions=2, prompt_words=8, session_tokens=500, probe_words=64, max_tokens=3, probe_delay=0.2)
    run = simulate(prof(), SchedulerConfig("batched", 4), w)
    sessions = [s for s in run["samples"] if s["tag"] == "session"]
    assert len(sessions) == 2
    assert all(s["completion_tokens"] is None and s["finish_reason"] == "client_cancel" and s["chunks"] for s in sessions)
    # the run's tokens: the probe's 3 (its usage) and every token the sessions streamed (one chunk each)
    streamed = sum(len(s["chunks"]) for s in sessions)
    assert streamed > 2 and run["metrics"]["client"]["output_tokens"] == 3 + streamed
    wall = run["metrics"]["client"]["wall"]
    assert run["metrics"]["client"]["throughput"] == pytest.approx((3 + streamed) / wall)


def test_the_probe_is_one_command_list_and_the_simulator_runs_it_on_its_clock():
    from quanta.analysis.requests import RequestSample
    from quanta.bench import probe, prompts

    w = Workload(kind="probe", sessions=2, prompt_words=8, session_tokens=500, probe_words=64, max_tokens=3, probe_delay=0.2)
    gen, cmds, answer = probe.steps(w), [], None
    while True:
        try:
            cmds.append(gen.send(answer))
        except StopIteration:
            break
        answer = RequestSample(id=len(cmds), scheduled=0.0) if isinstance(cmds[-1], probe.Send) else None
    assert [type(c).__name__ for c in cmds] == ["Send", "Send", "Until", "Sleep", "Send", "Until", "Sleep", "Cancel"]
    assert (cmds[4].words, cmds[4].nonce_chars, cmds[4].max_tokens, cmds[4].tag) == (64, prompts.PROBE_NONCE_CHARS, 3, "probe")
    assert cmds[0].nonce_chars == prompts.NONCE_CHARS and [s.id for s in cmds[7].samples] == [1, 2]
    run = simulate(prof(), SchedulerConfig("batched", 4), w)
    sessions = [s for s in run["samples"] if s["tag"] == "session"]
    (p,) = [s for s in run["samples"] if s["tag"] == "probe"]
    # every prompt carries its nonce's tokens, as the bench client's text does
    assert p["prompt_tokens"] == 64 + prompts.nonce_tokens(prompts.PROBE_NONCE_CHARS)
    assert {s["prompt_size"] for s in sessions} == {8 + prompts.nonce_tokens(prompts.NONCE_CHARS)}
    streaming = max(s["chunks"][0][0] for s in sessions)  # every session streams: the probe is due probe_delay later
    assert p["scheduled"] == pytest.approx(streaming + 0.2)
    # cancelled probe_delay after it ends: at the end of the decode step running then (< 0.1 s in this profile)
    assert all(p["done"] + 0.2 <= s["done"] < p["done"] + 0.3 for s in sessions), (p["done"], [s["done"] for s in sessions])


def test_auto_quantum_never_comes_from_below_the_profiles_measured_range():
    from quanta.sim.auto import resolve_auto

    # cheapest per token at its first point, flat below it: 'auto' must not pick 1, 2, 4 or 8
    p = prof(prefill_points=[(16, 1e-4), (256, 2e-3)], overhead_s=0.0)
    sched, _ = resolve_auto(p, SchedulerConfig("batched", 4, {"mixed_prefill_quantum": 1}))
    assert sched.knobs["mixed_prefill_quantum"] == 16


@pytest.mark.parametrize("raw, message", [
    ([1, 2], "not a cost profile"),
    ({"format": "quanta-cost-profile/1", "overhead_s": float("nan"), "prefill": {"points": [[1, 1e-3]]},
      "decode": {"points": [[1, 0.01]]}}, "finite"),
    ({"format": "quanta-cost-profile/1", "prefill": {"points": [[1, 1e-3]], "axis": "tokens_per_expert",
                                                     "moe": {"num_experts": "abc", "top_k": 2}},
      "decode": {"points": [[1, 0.01]]}}, "integer num_experts"),
])
def test_malformed_profiles_are_refused(raw, message):
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict(raw)


def test_the_auto_choice_is_recorded_in_the_report(tmp_path, capsys):
    prefix = tmp_path / "auto"
    assert cli.main(["simulate", "--profile", str(SEED), "--sweep", "--scheduler batched --mixed-prefill-quantum auto,512",
                     "--num-requests", "4", "--max-tokens", "4", "--no-plots", "--out", str(prefix)]) == 0
    q = int(capsys.readouterr().err.split("mixed_prefill_quantum=auto -> ")[1].split(":")[0])
    assert f"batched mpq=auto: mixed_prefill_quantum=auto ran as {q}" in prefix.with_suffix(".md").read_text()
