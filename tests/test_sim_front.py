"""The server front in the simulation: the trace's arrivals, the fit of the front's latency, its use.

The fitted runs come from the simulator run with a known front model, so the fit can be checked against
the true delays; the engine's own recording is checked on the real (thread-hosted) engine.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from quanta import cli
from quanta.analysis.server_trace import merge_replica_traces
from quanta.bench import output
from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.engine.async_engine import AsyncEngine
from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepResult
from quanta.engine.sampling import SamplingParams
from quanta.sim import Profile, ProfileError
from quanta.sim.front import FrontModel, burst_places, fit_front, paired, reordered_share
from quanta.sim.run import simulate

BASE = Profile(prefill_points=[(8, 3e-3), (256, 1e-3)], decode_points=[(1, 0.03), (8, 0.04)], overhead_s=0.005)
FRONT = FrontModel(request_s=0.006, prompt_token_s=4e-6, response_s=0.0015)
SCHED = SchedulerConfig("batched", 4, {"prefill_quantum": 256, "mixed_prefill_quantum": 64})
WORK = Workload(kind="poisson", rate=4.0, num_requests=24, prompt_words=300, prompt_dist="uniform:0.9", max_tokens=6)


def with_front(front: FrontModel | None) -> Profile:
    return Profile(**{**BASE.__dict__, "front": front})


class Echo(Executor):
    def execute(self, plan, interrupt=None):
        return StepResult([7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None for c in plan.chunks])


def test_the_engine_records_each_arrival_in_the_next_step_once():
    clock = iter(float(t) for t in range(100))
    engine = Engine(SCHED.build(), Echo(), 1000, clock=lambda: next(clock))
    a = engine.add_request([1] * 5, SamplingParams(max_tokens=2, temperature=0), submitted=-0.5)
    b = engine.add_request([1] * 3, SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    first = engine.trace.to_dicts()[0]["arrivals"]
    assert first == [[a.seq_id, -0.5, a.arrival_time, 5], [b.seq_id, b.arrival_time, b.arrival_time, 3]]
    engine.step()
    assert engine.trace.to_dicts()[1]["arrivals"] == []


def test_the_thread_hosted_engine_records_when_the_front_submitted():
    eng = AsyncEngine(Engine(SCHED.build(), Echo(), max_model_len=64))
    eng.start()

    async def one():
        stream = await eng.submit([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
        return [t async for out in stream for t in out.token_ids]

    try:
        assert asyncio.run(asyncio.wait_for(one(), 10)) == [7, 7]
    finally:
        eng.stop()
    (seq_id, submitted, accepted, tokens), = [a for r in eng.trace.to_dicts() for a in r["arrivals"]]
    assert submitted <= accepted and tokens == 3


def test_merged_replica_traces_rename_the_arrivals_as_the_steps():
    recs = [[{"start": 0.0, "seq_ids": [0], "arrivals": [[0, 0.0, 0.1, 4]]}], [{"start": 0.5, "seq_ids": [0], "arrivals": []}],
            [{"start": 0.2, "seq_ids": [1], "arrivals": [[1, 0.1, 0.2, 9]]}]]
    merged = merge_replica_traces(recs)
    assert [(m["seq_ids"], m["arrivals"]) for m in merged] == [([0], [[0, 0.0, 0.1, 4]]), ([5], [[5, 0.1, 0.2, 9]]),
                                                               ([1], [])]


def test_a_simulated_front_delays_each_request_and_token_by_the_model():
    plain, fronted = simulate(with_front(None), SCHED, WORK), simulate(with_front(FRONT), SCHED, WORK)
    submitted = sorted(a[1] for r in fronted["trace"] for a in r["arrivals"])
    assert submitted == pytest.approx(sorted(s["sent"] + FRONT.delay(s["prompt_tokens"]) for s in fronted["samples"]))
    assert [s["sent"] for s in fronted["samples"]] == [s["sent"] for s in plain["samples"]]  # the client sends alike
    ttft = {k: sorted(s["chunks"][0][0] - s["sent"] for s in r["samples"]) for k, r in (("plain", plain), ("front", fronted))}
    assert min(f - p for f, p in zip(ttft["front"], ttft["plain"])) > FRONT.request_s  # every first token later


def test_the_fit_recovers_a_known_front_from_simulated_runs():
    runs = [simulate(with_front(FRONT), SCHED, Workload(**{**WORK.__dict__, "seed": s})) for s in range(3)]
    m = fit_front(runs)
    assert m.request_s == pytest.approx(FRONT.request_s, rel=1e-3)
    assert m.prompt_token_s == pytest.approx(FRONT.prompt_token_s, rel=1e-3)
    assert m.response_s == pytest.approx(FRONT.response_s, rel=1e-3)
    assert m.fit["requests"] == 72 and m.fit["runs_left_out"] == 0 and m.fit["residual_p90_s"] < 1e-6


BURSTS = Workload(kind="burst", num_requests=12, prompt_words=300, prompt_dist="uniform:0.9", max_tokens=4)
LOOPED = FrontModel(request_s=0.006, prompt_token_s=2e-6, response_s=0.0015, loop_s=0.002)


def test_a_burst_leaves_the_loop_one_request_at_a_time():
    stages = LOOPED.stages()
    handed = [stages.cross(1.0, n) for n in (300, 300, 300)]
    assert handed == pytest.approx([1.0 + LOOPED.request_s + 6e-4 + k * LOOPED.loop_s for k in range(3)])
    # a prompt 1,500 tokens longer falls back behind the next one; 300 tokens longer keeps its place
    a, b = (lambda st: (st.cross(2.0, 1800), st.cross(2.0, 300)))(LOOPED.stages())
    c, d = (lambda st: (st.cross(2.0, 600), st.cross(2.0, 300)))(LOOPED.stages())
    assert b < a and c < d
    no_loop = FrontModel(request_s=0.006, prompt_token_s=2e-6).stages()
    e, f = no_loop.cross(2.0, 600), no_loop.cross(2.0, 300)
    assert f < e  # without loop_s a burst leaves the loop at once and the shorter prompt passes


def test_burst_places_count_the_requests_sent_ahead_within_the_burst():
    assert burst_places([0.0, 0.001, 0.004, 0.0095, 0.5, 0.503, 0.2]) == [0, 1, 2, 0, 0, 1, 0]


def test_the_fit_separates_the_loops_queue_from_the_per_token_term():
    runs = [simulate(with_front(LOOPED), SCHED, Workload(**{**BURSTS.__dict__, "seed": s})) for s in range(3)]
    m = fit_front(runs)
    assert m.loop_s == pytest.approx(LOOPED.loop_s, rel=1e-3)
    assert m.prompt_token_s == pytest.approx(LOOPED.prompt_token_s, rel=1e-3)
    assert m.request_s == pytest.approx(LOOPED.request_s, rel=1e-3) and m.fit["residual_p90_s"] < 1e-6
    assert Profile.from_dict(json.loads(json.dumps(with_front(m).to_dict()))).front.loop_s == m.loop_s
    pooled = fit_front(runs, loop=False)  # the sizes alone cannot say how long a request queued in the loop
    assert pooled.loop_s == 0 and pooled.fit["residual_median_s"] > 1e-3


def test_runs_that_cannot_be_paired_are_left_out():
    run = simulate(with_front(FRONT), SCHED, WORK)
    assert paired(run) is not None
    for broken in ({**run, "clock_origin": None}, {**run, "samples": run["samples"][1:]},
                   {**run, "clock_origin": 1e6}):  # a client clock not the server host's: negative delays
        assert paired(broken) is None
    assert fit_front([{**run, "clock_origin": 1e6}]) is None


def test_a_profile_keeps_its_front_and_refuses_a_bad_one():
    d = with_front(FRONT).to_dict()
    assert Profile.from_dict(json.loads(json.dumps(d))).front == FRONT
    for bad in ({"request_s": -1.0}, {"prompt_token_s": 1.0}, {"request_s": 0.01, "loop_s": -0.001}, "fast"):
        with pytest.raises(ProfileError, match="front"):
            Profile.from_dict({**d, "front": bad})


def test_profile_engine_from_bench_fits_the_front_where_runs_recorded_it(tmp_path, capsys):
    runs = [simulate(with_front(FRONT), SCHED, Workload(**{**WORK.__dict__, "seed": s})) for s in range(3)]
    doc = output.document("sweep", "test", WORK, 1, [{"name": "c", "flags": [], "valid": True, "runs": runs,
                                                       "applied": {"model": "m"}}], None)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "p.json"
    assert cli.main(["profile-engine", "--from-bench", str(path), "--out", str(out)]) == 0
    assert "front: 6.00 ms + 4.00 us per prompt token" in capsys.readouterr().out
    assert Profile.load(out).front.response_s == pytest.approx(FRONT.response_s)
    for r in runs:
        del r["clock_origin"]
    path.write_text(json.dumps(output.document("sweep", "test", WORK, 1, [{"name": "c", "flags": [], "valid": True,
                                                                             "runs": runs, "applied": {}}], None)))
    assert cli.main(["profile-engine", "--from-bench", str(path), "--out", str(out)]) == 0
    assert "front: not fitted" in capsys.readouterr().out and Profile.load(out).front is None


def test_pairing_follows_prompt_sizes_when_the_front_reorders_a_burst():
    samples = [{"id": 0, "sent": 1.000, "prompt_tokens": 900, "error": None, "chunks": [[1.5, 1.0]]},
               {"id": 1, "sent": 1.001, "prompt_tokens": 30, "error": None, "chunks": [[1.2, 1.0]]}]
    trace = [{"seq_ids": [7], "num_emitted": [1], "end": 101.19, "arrivals": [[7, 101.010, 101.011, 30]]},
             {"seq_ids": [6], "num_emitted": [1], "end": 101.49, "arrivals": [[6, 101.020, 101.19, 900]]}]
    pairs = paired({"clock_origin": 100.0, "samples": samples, "trace": trace})
    assert [(s["id"], a[0]) for s, a in pairs] == [(1, 7), (0, 6)]  # the short prompt got through first
    assert [round(a[1] - s["sent"], 6) for s, a in pairs] == [0.009, 0.02]
    assert reordered_share([{"clock_origin": 100.0, "samples": samples, "trace": trace}]) == 1.0


def test_the_front_noise_is_fitted_and_its_loop_keeps_the_send_order():
    noisy = FrontModel(0.006, 2e-6, 0.001, noise=[-0.002, -0.001, 0.0, 0.001, 0.004], workers=1)
    burst = Workload(kind="burst", num_requests=8, prompt_words=400, prompt_dist="uniform:0.9", max_tokens=2)
    delays = set()
    for seed in range(4):
        run = simulate(with_front(noisy), SCHED, Workload(**{**burst.__dict__, "seed": seed}))
        pairs = paired(run)
        assert len({s["prompt_tokens"] for s, _ in pairs}) == 8  # distinct sizes: the pairing is exact
        assert [s["sent"] for s, _ in pairs] == sorted(s["sent"] for s, _ in pairs)  # one thread: in send order
        delays |= {round(a[1] - s["sent"], 6) for s, a in pairs}
        assert all(a[1] - s["sent"] >= 0.004 - 1e-9 for s, a in pairs)
    assert len(delays) > 8  # the noise varies each request's delay
    runs = [simulate(with_front(noisy), SCHED, Workload(**{**WORK.__dict__, "seed": s})) for s in range(4)]
    m = fit_front(runs)
    assert m.request_s == pytest.approx(0.006, abs=3e-4) and m.prompt_token_s == pytest.approx(2e-6, abs=5e-7)
    assert m.noise[0] == pytest.approx(-0.002, abs=3e-4) and m.noise[-1] == pytest.approx(0.004, abs=3e-4)


@pytest.mark.parametrize("workers, handed", [
    (2, [(1, 0.0065), (2, 0.0076), (3, 0.0087), (0, 0.025)]),  # the long prompt holds one thread, the rest pass
    (1, [(0, 0.025), (1, 0.0255), (2, 0.0261), (3, 0.0268)]),  # one thread: each waits for the one before
    (4, [(1, 0.0065), (2, 0.0076), (3, 0.0087), (0, 0.025)]),
])
def test_a_burst_crosses_the_loop_in_send_order_then_the_tokenizing_threads(workers, handed):
    front = FrontModel(request_s=0.005, prompt_token_s=1e-5, workers=workers)
    w = Workload(kind="burst", num_requests=4, prompt_words=10, max_tokens=1)
    # sent at 0, 1, 2, 3 ms; the loop takes each 5 ms after its send, then a thread 10 us per token
    run = simulate(with_front(front), SCHED, w, prompt_lengths=[2000, 50, 60, 70], send_delays=[0.0, 0.001, 0.002, 0.003])
    sent = {s["prompt_tokens"]: s["id"] for s in run["samples"]}
    arrivals = sorted((a[1], sent[a[3]]) for rec in run["trace"] for a in rec["arrivals"])
    assert [i for _, i in arrivals] == [i for i, _ in handed]
    assert [t for t, _ in arrivals] == pytest.approx([t for _, t in handed])
    if workers > 1:
        assert reordered_share([{**run, "clock_origin": 0.0}]) == pytest.approx(0.5)  # 3 of the 6 pairs


def test_a_profile_front_without_workers_has_the_servers_and_refuses_bad_ones():
    from quanta.server.limits import PROMPT_WORKERS

    d = with_front(FRONT).to_dict()
    del d["front"]["workers"]
    assert Profile.from_dict(d).front.workers == PROMPT_WORKERS
    for bad in (0, 1.5, "2", None):
        with pytest.raises(ProfileError, match="workers"):
            Profile.from_dict({**d, "front": {**d["front"], "workers": bad}})
