"""Sweep grids, applied-value checks and workload schedules (no server)."""

import random

import pytest

from quanta.bench.server import requested_values, verify
from quanta.bench.sweep import Condition, GridError, expand, validate
from quanta.bench.workloads import Workload, arrival_times


def test_seed_002_grid_is_a_union_of_grids():
    conds = expand(["--scheduler static", "--scheduler continuous --admit-k 1,2,4,8,16,32", "--scheduler chunked --chunk 8,16,32"],
                   "--max-num-seqs 32")
    assert [c.name for c in conds] == (["static"] + [f"continuous K={k}" for k in (1, 2, 4, 8, 16, 32)]
                                       + [f"chunked C={c}" for c in (8, 16, 32)])
    assert conds[1].flags == ["--scheduler", "continuous", "--admit-k", "1", "--max-num-seqs", "32"]
    cross = expand(["--scheduler batched --prefill-quantum 64,128 --mixed-prefill-quantum 32,64"])
    assert len(cross) == 4 and cross[-1].name == "batched pq=128 mpq=64"


@pytest.mark.parametrize("specs, common, message", [
    (["--admit-k 1 --admit-k 2"], "", "more than once"),
    (["--admit-k 1,,2"], "", "empty value"),
    (["admit-k 1"], "", "expected a --flag"),
    (["--admit-k 1"], "--admit-k 2", "both"),
    (["--admit-k 1,1"], "", "twice"),
    (["--scheduler static"], "--max-num-seqs 4,8", "lists belong in --grid"),
])
def test_bad_grids_are_refused(specs, common, message):
    with pytest.raises(GridError, match=message):
        expand(specs, common)


def test_validate_marks_configurations_quanta_rejects_and_refuses_unknown_flags():
    ok, bad = expand(["--scheduler continuous --admit-k 4,32"], "--max-num-seqs 16")
    validate(ok)
    validate(bad)
    assert ok.invalid_reason is None
    assert "larger than --max-num-seqs" in bad.invalid_reason
    with pytest.raises(GridError, match="unrecognized arguments: --bogus"):
        validate(Condition("x", ["--bogus", "1"]))
    (missing,) = expand(["--admit-k"])  # a flag without a value reads as a switch; serve's parser refuses it
    with pytest.raises(GridError, match="expected one argument"):
        validate(missing)


def test_switches_are_flags_without_a_value():
    conds = expand(["--scheduler static,continuous --no-prefix-cache"], "--max-num-seqs 4")
    assert [c.name for c in conds] == ["static no-prefix-cache", "continuous no-prefix-cache"]
    assert conds[1].flags == ["--scheduler", "continuous", "--no-prefix-cache", "--max-num-seqs", "4"]
    (c,) = expand(["--scheduler static"], "--no-prefix-cache --max-num-seqs 4")
    assert c.flags == ["--scheduler", "static", "--no-prefix-cache", "--max-num-seqs", "4"]
    validate(c)
    assert c.invalid_reason is None


def test_applied_values_must_equal_requested_ones():
    req = requested_values(["--scheduler", "chunked", "--chunk", "8", "--max-num-seqs", "16", "--max-model-len", "256"])
    assert req == {"scheduler": "chunked", "chunk": "8", "max_num_seqs": "16"}
    assert verify(req, {"scheduler": "chunked", "chunk": 8, "max_num_seqs": 16, "admit_k": 1}) is None
    assert verify(req, {"scheduler": "chunked", "chunk": 512, "max_num_seqs": 16}) == "requested chunk=8, server applied chunk=512"
    assert "no applied values" in verify(req, None)


def test_arrival_schedules():
    assert arrival_times("burst", 3, 1.0, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]
    t = arrival_times("poisson", 2000, 10.0, 1.0, random.Random(1))
    assert t[0] == 0.0 and t == sorted(t)
    assert t[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    g = arrival_times("gamma", 2000, 10.0, 0.5, random.Random(2))
    assert g[-1] / 1999 == pytest.approx(0.1, rel=0.15)
    with pytest.raises(ValueError):
        arrival_times("concurrency", 3, 1.0, 1.0, random.Random(0))
    assert Workload(kind="probe", sessions=3).total_requests() == 4
    assert Workload(kind="replay", sessions=3, turns=2).total_requests() == 6


def _canned_metrics(thr):
    s = {"n": 1, "mean": 0.1, "p50": 0.1, "p90": 0.1, "p99": 0.2, "max": 0.2}
    return {"client": {"throughput": thr, "ttft": s, "e2e": s, "itl": s, "queue": s, "num_failed": 0, "num_ok": 1}, "trace": None}


@pytest.mark.parametrize("interleave, order", [(False, ["A0", "A1", "B0", "B1"]), (True, ["A0", "B0", "A1", "B1"])])
def test_sweep_order_and_every_server_stopped(monkeypatch, tmp_path, interleave, order):
    import quanta.bench.sweep as sweep

    calls, stopped = [], []

    class FakeServer:
        def __init__(self, name):
            self.name = name

        def stop(self):
            stopped.append(self.name)

    monkeypatch.setattr(sweep, "bring_up", lambda cond, w, st, log_dir, res: (FakeServer(cond.name), cond.name))

    def fake_measure(target, w, **kw):
        calls.append(f"{target}{len([c for c in calls if c.startswith(target)])}")
        return {"metrics": _canned_metrics(10.0)}

    monkeypatch.setattr(sweep, "measure", fake_measure)
    conds = [Condition("A", []), Condition("B", [])]
    out = sweep.run_sweep(conds, Workload(), sweep.Settings(repeats=2, progress=False), interleave=interleave,
                          log_dir=tmp_path, say=lambda m: None)
    assert calls == order
    assert sorted(stopped) == ["A", "B"]
    assert all(r["valid"] and len(r["figures"]) == 2 and r["summary"]["throughput"][0] == 10.0 for r in out)


def test_throughput_ratio_paired_per_round():
    from quanta.analysis.report import throughput_ratios

    base = {"figures": [{"throughput": 100.0}, {"throughput": 50.0}, {"throughput": 80.0}]}
    cond = {"figures": [{"throughput": 200.0}, {"throughput": 100.0}, {"throughput": 160.0}]}
    assert throughput_ratios(cond, base, paired=True) == [2.0, 2.0, 2.0]
    assert throughput_ratios(cond, base) == [2.5, 1.25, 2.0]  # over the baseline's median (80)
    assert throughput_ratios(cond, None) == []
