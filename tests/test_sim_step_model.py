"""The per-step cost model (quanta.sim.step_model) and its place in a cost profile."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quanta.sim import Profile
from quanta.sim.profile import ProfileError
from quanta.sim.step_model import StepModel, nnls

MODEL = StepModel(overhead_s=0.004, prefill_knots=[8.0, 64.0, 512.0], prefill_s_per_row=[3e-3, 1.5e-3, 1e-3],
                  decode_knots=[1.0, 4.0, 8.0], decode_s=[0.03, 0.033, 0.04], prefill_ctx_s=1e-7, decode_ctx_s=1e-6,
                  interference_s_per_row=0.02, prefix_hit_s_per_token=2e-6, threads={"decode_threads": 2})


def test_each_term_prices_its_own_part_of_a_step():
    m = MODEL
    assert m.cost([], [0]) == pytest.approx(0.004 + 0.03)
    assert m.cost([], [100, 300]) == pytest.approx(0.004 + 0.03 + 0.001 + 1e-6 * 400)  # B=2: a third of the way to 4
    assert m.cost([], [0] * 12) == pytest.approx(0.004 + 0.04 + 4 * 0.007 / 4)  # past the last knot: linear
    assert m.cost([(0, 64)], []) == pytest.approx(0.004 + 64 * 1.5e-3 + 1e-7 * 64 * 31.5)
    assert m.cost([(0, 4)], []) == pytest.approx(0.004 + 4 * 3e-3 + 1e-7 * 6)  # below the first knot: flat
    mid = m.cost([(0, 128)], []) - 0.004 - 1e-7 * 128 * 63.5
    assert mid / 128 == pytest.approx(1.5e-3 - 0.5e-3 / 3)  # log-linear: 128 is a third of the way from 64 to 512
    # interference: each decode row pays extra while prompt rows share the step
    fused = m.cost([(0, 64)], [0, 0])
    assert fused == pytest.approx(m.cost([(0, 64)], []) + m.cost([], [0, 0]) - 0.004 + 2 * 0.02)
    # prefix-hit tokens are priced apart from the context they leave to attend over
    assert m.cost([(1000, 10)], [], prefix_hit=1000) - m.cost([(1000, 10)], []) == pytest.approx(2e-3)


def test_cost_is_features_times_coefficients():
    rng = np.random.default_rng(1)
    for _ in range(20):
        pre = [(int(s), int(n)) for s, n in rng.integers(1, 900, size=(int(rng.integers(0, 3)), 2))]
        dec = [int(p) for p in rng.integers(0, 4000, size=int(rng.integers(0, 10)))]
        assert MODEL.cost(pre, dec, 7) == pytest.approx(float(MODEL.features(pre, dec, 7) @ MODEL.coefficients()))
    assert MODEL.with_coefficients(MODEL.coefficients()) == MODEL
    assert len(MODEL.names()) == len(MODEL.coefficients())


def test_nnls_keeps_coefficients_non_negative_and_solves_plain_problems():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, size=(50, 4)) * [1, 1e3, 1e6, 1]  # columns of very different scales
    x = np.array([0.5, 2e-3, 3e-7, 0.0])
    assert nnls(a, a @ x) == pytest.approx(x, rel=1e-6, abs=1e-12)
    b = a @ np.array([1.0, -1e-3, 0, 0])  # the unconstrained answer has a negative coefficient
    got = nnls(a, b)
    assert (got >= 0).all() and np.linalg.norm(a @ got - b) <= np.linalg.norm(b) + 1e-12


def test_a_profile_with_a_step_model_round_trips_and_prices_by_it(tmp_path):
    old = Profile(prefill_points=[(8, 3e-3)], decode_points=[(1, 0.03)], overhead_s=0.004)
    p = Profile(**{**old.__dict__, "step_model": MODEL})
    p.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back.step_model == MODEL and "step_model" not in back.meta
    assert back.step_cost([(0, 64)], [5, 9]) == MODEL.cost([(0, 64)], [5, 9])
    assert back.step_cost([(0, 64)], [5, 9]) != old.step_cost([(0, 64)], [5, 9])


def test_a_profile_without_a_step_model_prices_as_before(tmp_path):
    old = Profile(prefill_points=[(8, 3e-3), (64, 1.5e-3)], decode_points=[(1, 0.03), (4, 0.033)], overhead_s=0.004,
                  prefill_ctx=1e-7, decode_ctx=1e-6, mixed_decode_factor=0.5)
    old.save(tmp_path / "old.json")
    assert "step_model" not in json.loads((tmp_path / "old.json").read_text())
    back = Profile.load(tmp_path / "old.json")
    assert back.step_model is None
    assert back.step_cost([(10, 20)], [30, 40], prefix_hit=500) == pytest.approx(
        0.004 + back.prefill_cost([(10, 20)]) + 0.5 * back.decode_cost([30, 40]))


@pytest.mark.parametrize("change, message", [({"decode_knots": [4.0, 1.0, 8.0]}, "ascending"),
                                             ({"interference_s_per_row": -1.0}, ">= 0"),
                                             ({"prefill_s_per_row": [1e-3]}, "equal length"),
                                             ({"overhead_s": "x"}, "malformed step_model")])
def test_a_bad_step_model_is_a_clear_profile_error(change, message):
    d = Profile(prefill_points=[(8, 3e-3)], decode_points=[(1, 0.03)], step_model=MODEL).to_dict()
    d["step_model"].update(change)
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict(d)
