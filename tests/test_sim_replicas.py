"""``quanta simulate --replicas``: N simulated servers behind quanta.cluster's routers (virtual clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from quanta import cli
from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.sim import Profile
from quanta.sim.replicas import simulate_replicas
from quanta.sim.run import simulate

SEED = Path(__file__).resolve().parents[1] / "profiles" / "ds4_m3_ultra_seed.json"
CFG = SchedulerConfig("continuous", 8, {"admit_k": 4})
REPLAY = Workload(kind="replay", sessions=6, turns=4, prompt_words=300, tool_words=100, max_tokens=16, stagger=1.0, seed=1)


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize("w", [REPLAY, Workload(kind="poisson", num_requests=20, prompt_words=300, max_tokens=16, rate=2.0)])
def test_one_replica_is_the_single_server(w):
    p = Profile.load(SEED)
    one = simulate(p, CFG, w, prefix_cache=True)
    routed = simulate_replicas(p, CFG, w, replicas=1, routing="round-robin", prefix_cache=True)
    # sent: the replicas' loop stamps a request when it reaches the router, the single loop when the engine takes it
    assert [_without(s, "sent") for s in routed["samples"]] == [_without(s, "sent") for s in one["samples"]]
    assert [_without(r, "replica") for r in routed["trace"]] == one["trace"]
    assert routed["replicas"] == {"count": 1, "routing": "round-robin", "max_waiting": 4, "requests": [w.total_requests()]}


def test_prefix_routing_keeps_the_single_servers_hits_and_round_robin_loses_them():
    p = Profile.load(SEED)
    single = simulate(p, CFG, REPLAY, prefix_cache=True)["metrics"]["client"]["prefix_hit_share"]
    runs = {pol: simulate_replicas(p, CFG, REPLAY, replicas=2, routing=pol, prefix_cache=True)
            for pol in ("prefix", "round-robin", "least-loaded")}
    hits = {pol: r["metrics"]["client"]["prefix_hit_share"] for pol, r in runs.items()}
    assert single > 0.5 and hits["prefix"] >= 0.95 * single
    assert hits["round-robin"] < hits["prefix"] - 0.1
    for r in runs.values():
        c = r["metrics"]["client"]
        assert c["num_ok"] == REPLAY.total_requests() and c["num_failed"] == 0
        assert sum(r["replicas"]["requests"]) == REPLAY.total_requests() and min(r["replicas"]["requests"]) > 0
        assert {rec["replica"] for rec in r["trace"]} == {0, 1}
        starts = [rec["start"] for rec in r["trace"]]
        assert starts == sorted(starts)
    assert runs["prefix"] == simulate_replicas(p, CFG, REPLAY, replicas=2, routing="prefix", prefix_cache=True)


def test_more_replicas_cut_the_queue_of_an_overloaded_server():
    p = Profile.load(SEED)
    w = Workload(kind="poisson", num_requests=40, prompt_words=600, max_tokens=16, rate=4.0, seed=2)
    p99 = [simulate_replicas(p, CFG, w, replicas=n, routing="least-loaded")["metrics"]["client"]["ttft"]["p99"]
           for n in (1, 4)]
    assert p99[1] < p99[0] / 2


def test_simulate_cli_runs_each_count_and_policy_and_reports_the_split(tmp_path, capsys):
    out = tmp_path / "scale"
    assert cli.main(["simulate", "--profile", str(SEED), "--workload", "replay", "--sessions", "3", "--turns", "2",
                     "--prompt-words", "100", "--max-tokens", "4", "--replicas", "1,2", "--routing", "prefix,round-robin",
                     "--no-plots", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("batched, 1 x prefix", "batched, 2 x prefix", "batched, 1 x round-robin", "batched, 2 x round-robin"):
        assert f"| {name} |" in printed
    assert "| requests per replica |" in printed and "## Replicas" in (tmp_path / "scale.md").read_text()


@pytest.mark.parametrize("extra, message", [
    (["--routing", "random", "--replicas", "2"], "--routing must be a comma list of prefix, least-loaded, round-robin"),
    (["--routing", "round-robin"], "--routing, --max-waiting and --load-tokens need --replicas"),
    (["--replicas", "0"], "--replicas must be a comma list of positive integers"),
    (["--replicas", "2", "--workload", "probe"], "the probe workload watches one engine"),
])
def test_replica_flags_reject_bad_input(extra, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "--profile", str(SEED), *extra])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_the_router_sees_each_replicas_load_as_the_real_front_does():
    from quanta.cluster.routing import ReplicaLoad
    from quanta.sim.replicas import ReplicaSimulation

    w = Workload(kind="burst", num_requests=12, prompt_words=400, max_tokens=4)
    sim = ReplicaSimulation(Profile.load(SEED), SchedulerConfig("batched", 4), w, replicas=2, routing="least-loaded")
    run = sim.run()
    assert run["replicas"]["requests"] == [6, 6]
    sim._live_on[0] = dict.fromkeys(range(6))  # six requests in flight on a 4-slot replica, whatever its scheduler holds
    assert sim.loads() == [ReplicaLoad(waiting=2, running=4), ReplicaLoad(waiting=0, running=0)]
