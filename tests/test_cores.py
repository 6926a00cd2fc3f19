"""The cores a process may use (:mod:`quanta.model.cores`): the cgroup quota read from files laid
out as the kernel lays them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from quanta.model.cores import cgroup_quota, usable_cores


def _cgroup(tmp_path: Path, own: str | None, root: str | None = None) -> tuple[Path, Path]:
    fs, self_cgroup = tmp_path / "fs", tmp_path / "cgroup"
    (fs / "app.slice").mkdir(parents=True)
    self_cgroup.write_text("0::/app.slice\n")
    if own is not None:
        (fs / "app.slice" / "cpu.max").write_text(own)
    if root is not None:
        (fs / "cpu.max").write_text(root)
    return fs, self_cgroup


@pytest.mark.parametrize("own,root,quota", [
    ("150000 100000\n", None, 1.5),      # the process's own cgroup: 1.5 CPUs
    ("max 100000\n", "50000 100000\n", 0.5),  # no quota of its own: the root's
    ("max 100000\n", None, None),        # no quota anywhere
    (None, None, None),                  # no cgroup files at all
])
def test_the_cgroup_v2_quota_is_read_from_the_processs_own_cgroup_first(tmp_path, own, root, quota):
    fs, self_cgroup = _cgroup(tmp_path, own, root)
    assert cgroup_quota(fs, self_cgroup) == quota


def test_the_cgroup_v1_quota_is_the_ratio_of_quota_to_period(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(tmp_path, tmp_path / "none") == 2.5


def test_usable_cores_is_the_affinity_at_most(monkeypatch):
    import os

    usable_cores.cache_clear()
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    monkeypatch.setattr("quanta.model.cores.cgroup_quota", lambda: 1.5)
    try:
        assert usable_cores() == 2
    finally:
        usable_cores.cache_clear()
