"""``quanta bench sweep --ray``: conditions as Ray tasks on pinned cores, the sequential sweep's result format.

One small live sweep (two conditions, two requests each, real servers); skipped, with Ray's own
message, where Ray is missing or cannot start a local cluster.
"""

from __future__ import annotations

import json
import os

import pytest

from quanta.bench.ray_sweep import core_slot
from quanta.bench.sweep import Condition, _new_result
from quanta.cli import main


def test_core_slots_are_disjoint_and_the_pin_is_undone():
    before = os.sched_getaffinity(0)
    with core_slot(1) as first:
        assert os.sched_getaffinity(0) == set(first) and len(first) == 1
        if len(before) >= 2:
            os.sched_setaffinity(0, before)  # as another task's process, unpinned, would start
            with core_slot(1, wait_s=0) as second:  # the first slot's lock is held: the next slot
                assert not set(first) & set(second)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError, match="asks for"):
        with core_slot(len(before) + 1):
            pass


@pytest.mark.parametrize("argv, message", [
    (["--ray-cores", "2"], "--ray-address and --ray-cores need --ray"),
    (["--ray", "--interleave"], "does not take --interleave"),
])
def test_ray_flags_reject_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "sweep", "--grid", "--scheduler static", "--out", "x", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_ray_sweep_measures_each_condition_in_the_sequential_format(tmp_path, capsys):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[serve]==2.60.0')")
    prefix = tmp_path / "ray_sweep"
    code = main(["bench", "sweep", "--ray", "--grid", "--scheduler continuous --admit-k 1,2",
                 "--server-flags", "--max-num-seqs 2 --max-model-len 256", "--num-requests", "2", "--max-tokens", "4",
                 "--prompt-words", "8", "--repeats", "1", "--warmup", "0", "--no-progress", "--out", str(prefix)])
    err = capsys.readouterr().err
    if code == 1 and "Ray did not start" in err:
        pytest.skip(err.strip().splitlines()[-1])
    assert code == 0, err
    doc = json.loads(prefix.with_suffix(".json").read_text())
    assert [c["name"] for c in doc["conditions"]] == ["continuous K=1", "continuous K=2"]
    keys = set(_new_result(Condition("x", []))) | {"summary"}
    for k, cond in enumerate(doc["conditions"], start=1):
        assert set(cond) == keys and cond["valid"] and cond["applied"]["admit_k"] == k
        assert len(cond["runs"]) == 1 and cond["runs"][0]["metrics"]["client"]["num_ok"] == 2
        assert cond["summary"]["throughput"][0] > 0
    assert "Ray tasks, each pinned to 1 logical CPU" in doc["note"] and not doc["interleaved"]
    assert "| continuous K=2 |" in prefix.with_suffix(".md").read_text()
