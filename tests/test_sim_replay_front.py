"""``quanta simulate --compare --replay-front``: each request reaches the simulated engine when the measured
front handed it over, so what is left of an error is the engine model's.

The "measured" runs are simulated through a known noisy front; replayed with a profile whose front model is
far off, every figure comes back exact, and the same profile without the replay misses.
"""

from __future__ import annotations

import json

import pytest

from quanta import cli
from quanta.bench import output
from quanta.bench.workloads import Workload
from quanta.sim import Profile
from quanta.sim.compare import FIGURES, CompareError, compare, handover_delays, simulate_condition
from quanta.sim.front import FrontModel
from test_sim_compare import bench_doc, prof

MEASURED_FRONT = FrontModel(request_s=0.004, prompt_token_s=2e-5, response_s=0.001, noise=[-0.003, 0.0, 0.002, 0.009])
WRONG_FRONT = FrontModel(request_s=0.03, response_s=0.001)  # 30 ms in, no per-token term, no noise
BURST = Workload(kind="burst", num_requests=10, prompt_words=24, max_tokens=12)


def with_front(front: FrontModel) -> Profile:
    return Profile(**{**prof().__dict__, "front": front})


def arrivals(run: dict) -> list[float]:
    """When the front handed each sequence over, in sequence-id order."""
    return [t for _, t in sorted((a[0], a[1]) for rec in run["trace"] for a in rec["arrivals"])]


def test_the_measured_handovers_are_replayed_request_by_request():
    doc = bench_doc(with_front(MEASURED_FRONT), BURST, repeats=2)
    cond, w = doc["conditions"][3], Workload.from_dict(doc["workload"])
    replayed = simulate_condition(with_front(WRONG_FRONT), cond, w, 3600.0, replay_front=True)
    modelled = simulate_condition(with_front(WRONG_FRONT), cond, w, 3600.0)
    for measured, again, other in zip(cond["runs"], replayed, modelled):
        assert arrivals(again) == pytest.approx(arrivals(measured))
        assert arrivals(other) != pytest.approx(arrivals(measured))
    delays = handover_delays(cond["runs"][0])
    samples = sorted(cond["runs"][0]["samples"], key=lambda s: s["id"])
    assert len(delays) == len(samples) and all(d >= s["sent"] - s["scheduled"] for d, s in zip(delays, samples))


def test_with_the_front_replayed_only_the_engine_models_error_is_left():
    doc = bench_doc(with_front(MEASURED_FRONT), BURST)
    off = compare(with_front(WRONG_FRONT), [("m.json", doc)])
    replayed = compare(with_front(WRONG_FRONT), [("m.json", doc)], replay_front=True)
    assert max(abs(r["rel_error"]["ttft_p50"]) for r in off) > 0.05
    for r in replayed:
        for k, _, _ in FIGURES:
            assert r["rel_error"][k] == pytest.approx(0.0, abs=1e-9), (r["condition"], k)
    slow = compare(Profile(**{**prof(2.0).__dict__, "front": WRONG_FRONT}), [("m.json", doc)], replay_front=True)
    assert all(r["rel_error"]["itl_p50"] == pytest.approx(1.0, rel=1e-6) for r in slow)  # the engine's error stays


def test_a_repeat_that_cannot_be_paired_is_refused_with_its_file_and_condition():
    doc = bench_doc(prof(), BURST, repeats=1)
    doc["conditions"] = doc["conditions"][:1]
    doc["conditions"][0]["runs"][0]["clock_origin"] = None  # as a server on another host: no common clock
    with pytest.raises(CompareError, match=r"m.json: condition '--scheduler static .*': --replay-front: .*cannot be paired"):
        compare(prof(), [("m.json", doc)], replay_front=True)
    assert compare(prof(), [("m.json", doc)])  # without the replay the same file compares


def test_cli_replays_the_front_and_says_so(tmp_path, capsys):
    measured, p = tmp_path / "m.json", tmp_path / "p.json"
    output.write_json(bench_doc(with_front(MEASURED_FRONT), BURST, repeats=1), measured)
    with_front(WRONG_FRONT).save(p)
    prefix = tmp_path / "cmp"
    assert cli.main(["simulate", "--profile", str(p), "--compare", str(measured), "--replay-front", "--out", str(prefix)]) == 0
    assert "Median absolute relative error: **0%**" in capsys.readouterr().out
    doc = json.loads(prefix.with_suffix(".json").read_text())
    assert doc["replay_front"] is True
    assert "- front: replayed" in prefix.with_suffix(".md").read_text()
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "--profile", str(p), "--replay-front"])
    assert info.value.code == 2 and "--replay-front needs --compare" in capsys.readouterr().err
