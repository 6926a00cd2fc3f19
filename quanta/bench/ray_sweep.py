"""``quanta bench sweep --ray``: the conditions of a sweep as Ray tasks, in parallel.

Each condition is one Ray task (``num_cpus`` = its cores) that does what the
sequential sweep does for it (:func:`quanta.bench.sweep.measure_condition`:
start a fresh ``quanta serve``, verify it, warm up, measure every repeat, stop
it) and returns the same result dict, so the report is the sequential sweep's.
A task first takes a slot of its node's cores (consecutive groups of
``cores`` logical CPUs of the worker's affinity, each slot a file lock under
the node's temp directory, so two tasks on one node never share a core and a
task that dies frees its slot) and pins itself there with
``os.sched_setaffinity``; the server and the bench client it starts inherit
the pin, and the server's thread counts follow it (``OMP_NUM_THREADS``,
``QUANTA_NATIVE_THREADS``). Ray's own CPU accounting keeps at most as many
tasks per node as it has slots.

Ray is imported only here, and this module only by ``--ray``. Without
``--ray-address`` a local Ray is started for the sweep (as many CPUs as this
process may run on) and stopped after; with it the tasks go to that cluster,
whose nodes need quanta installed (the local checkout's path is put on the
workers' ``PYTHONPATH`` too, which serves one-machine clusters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import tempfile
import time
from pathlib import Path

import quanta
from quanta.bench.sweep import Condition, Settings, _new_result, measure_condition, summarized
from quanta.bench.workloads import Workload

SLOT_WAIT_S = 600.0


class RayStartError(RuntimeError):
    """Ray could not be started or reached."""


@contextlib.contextmanager
def core_slot(cores: int, wait_s: float = SLOT_WAIT_S):
    """Hold a free slot of ``cores`` logical CPUs of this process's affinity (a file lock) and pin
    this process to it; yields the CPU ids. The affinity before is restored on exit.

    Raises:
        RuntimeError: the node has fewer than ``cores`` CPUs, or no slot was free within ``wait_s``.
    """
    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    slots = [cpus[i:i + cores] for i in range(0, len(cpus) - cores + 1, cores)]
    if not slots:
        raise RuntimeError(f"a condition asks for {cores} cores; this node runs tasks on {len(cpus)}")
    lock_dir = Path(tempfile.gettempdir()) / "quanta-core-slots"
    lock_dir.mkdir(exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        for slot in slots:
            f = open(lock_dir / ("cpus-" + "-".join(map(str, slot)) + ".lock"), "w")  # held while pinned
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                os.sched_setaffinity(0, slot)
                yield slot
            finally:
                os.sched_setaffinity(0, before)
                f.close()
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no free slot of {cores} cores on this node after {wait_s:.0f} s")
        time.sleep(0.5)


def run_condition(cond: Condition, w: Workload, st: Settings, cores: int) -> dict:
    """One condition, measured on its own pinned cores (the body of the Ray task)."""
    res = _new_result(cond)
    with core_slot(cores) as cpus, tempfile.TemporaryDirectory(prefix="quanta-sweep-") as log_dir:
        threads = {"OMP_NUM_THREADS": str(cores), "QUANTA_NATIVE_THREADS": str(cores)}
        saved = {k: os.environ.get(k) for k in threads}
        os.environ.update(threads)
        try:
            print(f"{cond.name}: on CPUs {','.join(map(str, cpus))}: {' '.join(cond.flags)}", flush=True)
            measure_condition(cond, res, w, st, Path(log_dir), lambda line: print(line, flush=True))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return res


def run_sweep_ray(conds: list[Condition], w: Workload, st: Settings, *, cores: int = 1,
                  address: str | None = None, say=print) -> list[dict]:
    """Every condition as a Ray task; their result dicts in grid order (as :func:`quanta.bench.sweep.run_sweep`).

    Raises:
        RayStartError: Ray is not installed, or did not start (local) or answer (``address``).
    """
    try:
        import ray
    except ImportError as exc:
        raise RayStartError(f"Ray is not installed ({exc}); pip install 'ray[serve]==2.60.0'") from exc
    started = not ray.is_initialized()
    if started:
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
            [str(Path(quanta.__file__).resolve().parents[1])] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}}
        try:
            ray.init(address=address, num_cpus=None if address else len(os.sched_getaffinity(0)),
                     include_dashboard=False, runtime_env=env, logging_level="WARNING")
        except Exception as exc:  # Ray raises many kinds (ConnectionError, RuntimeError, ValueError, ...)
            raise RayStartError(f"Ray did not start{f' at {address}' if address else ''}: {exc}") from exc
    task = ray.remote(num_cpus=cores, max_retries=0)(run_condition)
    quiet = dataclasses.replace(st, progress=False)
    refs = [task.remote(c, w, quiet, cores) for c in conds]
    names = {ref: c.name for ref, c in zip(refs, conds)}
    try:
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            say(f"[{len(refs) - len(pending)}/{len(refs)}] {names[done[0]]} done")
        return summarized(ray.get(refs))
    except BaseException:
        for ref in refs:  # a cancelled task unwinds (KeyboardInterrupt in it): its server is stopped
            ray.cancel(ref)
        ray.wait(refs, num_returns=len(refs), timeout=30)
        raise
    finally:
        if started:
            ray.shutdown()
