"""Fitting the per-step cost model to step records made from known coefficients (quanta.sim.fit).

The records are built step by step as an engine would write them (sequence ids, new tokens, emitted
tokens, positions), each step's time the true model's cost times a small random factor; the fit must
find the coefficients again, and a fit that leaves the interference term out must miss the fused steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.sim import Profile
from quanta.sim.fit import FitError, fit, fit_step_model, steps_from_trace
from quanta.sim.pool import PoolSpec
from quanta.sim.run import Simulation
from quanta.sim.step_model import StepModel

TRUE = StepModel(overhead_s=0.004, prefill_knots=[16.0, 128.0, 1024.0], prefill_s_per_row=[2.5e-3, 1.4e-3, 1e-3],
                 decode_knots=[1.0, 4.0, 8.0], decode_s=[0.03, 0.034, 0.042], prefill_ctx_s=2e-7, decode_ctx_s=1.5e-6,
                 interference_s_per_row=0.02, prefix_hit_s_per_token=3e-6)
NOISE = 0.01


def synthetic_records(model: StepModel, num_steps: int, seed: int) -> list[dict]:
    """Step records of a mixed workload priced by ``model`` (times ``1 + N(0, NOISE)``), 1 s apart."""
    rng = np.random.default_rng(seed)
    decoding: dict[int, int] = {}  # seq id -> position
    records, next_id, t = [], 0, 0.0
    for step in range(num_steps):
        kind = rng.choice(["prefill", "decode", "mixed"], p=[0.25, 0.45, 0.3])
        ids, decode, chunks, hit = [], [], [], 0
        if kind != "prefill" and decoding:
            ids = [int(i) for i in rng.choice(list(decoding), size=min(len(decoding), int(rng.integers(1, 13))), replace=False)]
            decode = [decoding[i] for i in ids]
            for i in ids:
                decoding[i] += 1
        if kind != "decode" or not ids:
            for _ in range(int(rng.integers(1, 3))):
                start = int(rng.choice([0, 0, 32 * int(rng.integers(1, 64))]))
                n = int(np.exp(rng.uniform(np.log(8), np.log(1500))))
                ids.append(next_id), chunks.append((start, n))
                hit += start
                decoding[next_id] = start + n  # its first token comes out of this step
                next_id += 1
        while len(decoding) > 16:
            decoding.pop(next(iter(decoding)))
        new = [1] * len(decode) + [n for _, n in chunks]
        pos = decode + [s for s, _ in chunks]
        cost = model.cost(chunks, decode, hit) * (1 + NOISE * rng.standard_normal())
        records.append({"step": step, "kind": "mixed" if chunks and decode else "prefill" if chunks else "decode",
                        "start": t, "end": t + cost, "seq_ids": ids, "num_new_tokens": new, "num_emitted": [1] * len(ids),
                        "positions": pos})
        t += cost + 1.0
    return records


def test_steps_are_read_with_the_recorded_positions_and_prefix_hits():
    records = synthetic_records(TRUE, 200, seed=3)
    steps, gaps = steps_from_trace(records)
    assert gaps == []  # 1 s apart: no step is back to back
    for s, r in zip(steps, records, strict=True):
        assert s.t == pytest.approx(r["end"] - r["start"])
        assert s.t == pytest.approx(TRUE.cost(s.prefill, s.decode, s.hit), rel=6 * NOISE)
    assert sum(s.hit for s in steps) > 0 and any(s.kind == "mixed" for s in steps)


def test_the_fit_recovers_known_coefficients():
    steps, _ = steps_from_trace(synthetic_records(TRUE, 1500, seed=1))
    got = fit_step_model(steps, TRUE.prefill_knots, TRUE.decode_knots)
    for name, want, have in zip(TRUE.names(), TRUE.coefficients(), got.coefficients(), strict=True):
        assert have == pytest.approx(want, rel=0.1), name
    res = got.fit["residuals"]
    assert set(res) == {"prefill", "decode", "mixed"}
    assert all(r["median"] < 1.5 * NOISE and r["p90"] < 3 * NOISE for r in res.values())


def test_a_fit_without_the_interference_term_misses_the_fused_steps():
    steps, _ = steps_from_trace(synthetic_records(TRUE, 1500, seed=2))
    full = fit_step_model(steps, TRUE.prefill_knots, TRUE.decode_knots)
    plain = fit_step_model(steps, TRUE.prefill_knots, TRUE.decode_knots, without=("interference_s_per_row",))
    assert plain.interference_s_per_row == 0
    assert full.fit["residuals"]["mixed"]["median"] < 1.5 * NOISE
    assert plain.fit["residuals"]["mixed"]["median"] > 0.1  # the additive model cannot price a fused step
    with pytest.raises(FitError, match="unknown term"):
        fit_step_model(steps, without=("speed",))


def test_a_fitted_profile_with_its_own_knots_predicts_other_steps():
    prof = fit([synthetic_records(TRUE, 1500, seed=4)], {"name": "fit"}, threads={"decode_threads": 3})
    assert prof.step_model.threads == {"decode_threads": 3} and prof.meta["fit"]["mixed_steps"] > 300
    other, _ = steps_from_trace(synthetic_records(TRUE, 300, seed=5))
    err = [abs(prof.step_cost(s.prefill, s.decode, s.hit) / TRUE.cost(s.prefill, s.decode, s.hit) - 1) for s in other]
    assert np.median(err) < 0.03 and np.quantile(err, 0.9) < 0.08


def test_the_engine_records_positions_and_the_simulator_charges_prefix_hits():
    model = StepModel(overhead_s=0.01, prefill_knots=[1.0], prefill_s_per_row=[2e-3], decode_knots=[1.0], decode_s=[0.05],
                      prefix_hit_s_per_token=1e-4)
    p = Profile(prefill_points=[(1, 2e-3)], decode_points=[(1, 0.05)], step_model=model)
    sim = Simulation(p, SchedulerConfig("batched", 2), Workload(kind="burst", num_requests=0), pool=PoolSpec(40, 32, True))
    prefix = list(range(1, 331))
    for i, t in enumerate((0.0, 100.0)):
        sim.schedule(t, 400, 2, prompt_ids=prefix + [1000 + i] * 70)
    trace = sim.run()["trace"]
    second = [r for r in trace if r["seq_ids"] == [1]]
    assert second[0]["positions"] == [320] and second[1]["positions"] == [400]
    assert second[0]["end"] - second[0]["start"] == pytest.approx(0.01 + 80 * 2e-3 + 320 * 1e-4)
    steps, _ = steps_from_trace(trace)
    assert [s.hit for s in steps if s.prefill] == [0, 320]
