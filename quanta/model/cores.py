"""The cores this process may use (its CPU affinity, capped by a cgroup CPU quota), and the C
kernels' threads per decode step that follow from them (:func:`default_threads`).

A container limited to 1.5 CPUs, or a server started under ``taskset -c 0``, has fewer cores
than ``os.cpu_count()`` says; threads beyond them only wait for each other (the C kernels'
pool, ``pool.c``, also watches at run time whether the cores it has are taken by other work).
"""

from __future__ import annotations

import math
import os
from functools import cache
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@cache
def usable_cores() -> int:
    """CPUs in this process's affinity mask, at most its cgroup quota (rounded up); at least 1.
    Read once per process (prompt attention asks at every call)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def cgroup_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs a cgroup quota allows this process (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``
    over ``cpu.cfs_period_us``); None where no quota is set or none can be read."""
    for path in _v2_files(root, self_cgroup):
        quota = _ratio(path.read_text().split()) if path.is_file() else None
        if quota:
            return quota
    v1 = root / "cpu"
    try:
        return _ratio([(v1 / "cpu.cfs_quota_us").read_text(), (v1 / "cpu.cfs_period_us").read_text()])
    except OSError:
        return None


def _v2_files(root: Path, self_cgroup: Path) -> list[Path]:
    """``cpu.max`` of this process's cgroup and of the root, in that order."""
    files = []
    try:
        for line in self_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                files.append(root / line[3:].strip().lstrip("/") / "cpu.max")
    except OSError:
        pass
    return [*files, root / "cpu.max"]


def _ratio(fields: list[str]) -> float | None:
    """quota / period from two fields; None for ``max``, ``-1`` or anything unreadable."""
    try:
        quota, period = int(fields[0]), int(fields[1])
    except (ValueError, IndexError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def default_threads() -> int:
    """Threads of the C kernels in a decode step: 2 where this process may use 2 cores or more
    (:func:`~quanta.model.cores.usable_cores`), else 1.

    Every matmul's output columns and attention's cache positions are cut into chunks
    that both threads claim (``pool.c``). Measured on the 2-core dev VM (AVX-512 + bf16, embedded
    model, ``QUANTA_NATIVE_THREADS=1|2 benchmarks/peer_llama_cpp.py --servers quanta
    --workloads 2,3,4 --rounds 1``, two runs each, alternating): one stream 5.6-5.7 ->
    4.6-5.3 ms a token, 8 streams 252-255 -> 250-278 tok/s, 32 requests on 8 slots
    339-345 -> 377-447 tok/s, with 2 instead of 1, although the event loop shares the
    second core. Where other work shares the cores, each step's count is found by trying
    (:class:`~quanta.model.thread_tuner.ThreadTuner`). ``$QUANTA_NATIVE_THREADS`` sets it for
    good.
    """
    env = os.environ.get("QUANTA_NATIVE_THREADS")
    if env:
        return 2 if int(env) >= 2 else 1
    return 2 if usable_cores() >= 2 else 1


def threads_set_by_hand() -> bool:
    """Whether ``$QUANTA_NATIVE_THREADS`` fixes the pool's threads (else each decode step's
    count is found by trying)."""
    return bool(os.environ.get("QUANTA_NATIVE_THREADS"))
