"""N simulated replicas behind one router: ``quanta simulate --replicas N --routing POLICY``.

Each replica is what :class:`~quanta.sim.run.Simulation` builds for one server (its own
scheduler, engine, :class:`~quanta.sim.executor.CostModelExecutor` and
:class:`~quanta.sim.executor.VirtualClock`); the requests are the workload's, as for one
server; each request, when it reaches the endpoint, goes to the replica that the router of
:mod:`quanta.cluster.routing` chooses (the same code as the Ray deployment's), given every
replica's load as the real front sees it (its requests in flight,
:func:`~quanta.cluster.routing.front_loads`), and the router records it.

Time is a discrete-event loop over one global clock: arrivals, and the ends of each replica's
steps. An idle replica starts a step when a request reaches it; a busy one starts its next
step when the current one ends. A step is computed when it starts, but its outputs are
delivered at its end, so a request routed while a replica's step is in flight counts the
requests that step will finish as still in flight, as the front does. Replica 0's executor draws the
step noise from the workload's seed, so one replica is exactly the single-server simulation.

The run dict is the single server's (``samples``, ``trace``, ``metrics``) with the replicas'
traces merged (each record gains ``replica``; sequence ids become ``seq_id * N + replica`` so
they stay distinct) and a ``replicas`` entry: count, routing policy, load bound and requests
per replica.
"""

from __future__ import annotations

import heapq
import math

from quanta.analysis.server_trace import merge_replica_traces
from quanta.bench.workloads import Workload
from quanta.cluster.routing import ReplicaLoad, front_loads, make_router
from quanta.config import DEFAULT_BLOCK_SIZE, SchedulerConfig
from quanta.sim.executor import CostModelExecutor, VirtualClock
from quanta.sim.profile import Profile
from quanta.sim.run import _WORKLOADS, Simulation, _Req

#: workloads a replica simulation runs (the probe watches one engine)
UNSUPPORTED = ("probe",)


class ReplicaSimulation(Simulation):
    """A workload on ``replicas`` simulated servers behind a ``routing`` router."""

    def __init__(self, profile: Profile, sched: SchedulerConfig, w: Workload, *, replicas: int, routing: str,
                 max_waiting: int = 4, load_tokens: int | None = None, **kw) -> None:
        if w.kind in UNSUPPORTED:
            raise ValueError(f"workload {w.kind} watches one engine; it does not run on replicas")
        super().__init__(profile, sched, w, **kw)
        self.routing, self.max_waiting = routing, max_waiting
        self.router = make_router(routing, replicas, block_size=DEFAULT_BLOCK_SIZE, max_waiting=max_waiting,
                                  load_tokens=load_tokens)
        shared = {k: v for k, v in kw.items() if k in ("prefix_cache", "pool")}
        self.replicas = []
        for i in range(replicas):
            clock = VirtualClock()
            executor = CostModelExecutor(profile, clock, seed=self.noise_seed if i == 0 else f"{self.noise_seed}:{i}")
            self.replicas.append(Simulation(profile, sched, w, clock=clock, executor=executor, **shared))
        self._live_on: list[dict[int, _Req]] = [{} for _ in range(replicas)]
        self._routed = [0] * replicas
        self._steps: list[tuple[float, int, int, list]] = []  # (end, order, replica, outputs) of steps in flight
        self._busy = [False] * replicas

    def loads(self) -> list[ReplicaLoad]:
        """What the real front sees: each replica's requests in flight (:func:`front_loads`), not its scheduler's queues."""
        return front_loads([len(on) for on in self._live_on], self.sched.max_num_seqs)

    def _submit(self, r: _Req) -> None:
        r.sample.sent = r.sent_at
        ids = self._prompt_ids(r)
        i = self.router.choose(ids, self.loads())
        self.router.routed(i, ids)
        self._routed[i] += 1
        self.replicas[i].clock.advance_to(self.clock.t)
        self._add(r, ids, self.replicas[i].engine, self._live_on[i])

    def _start(self, i: int) -> None:
        """Replica ``i`` starts its next step now, if it has work and no step in flight."""
        rep = self.replicas[i]
        if self._busy[i] or not rep.engine.has_work():
            return
        rep.clock.advance_to(self.clock.t)
        outs = rep._engine_step()
        self._busy[i] = True
        heapq.heappush(self._steps, (rep.clock.t, next(self._order), i, outs))

    def run(self) -> dict:
        _WORKLOADS[self.w.kind](self)
        while self.clock.t <= self.max_duration:
            arrival = self._next_arrival()
            step_end = self._steps[0][0] if self._steps else math.inf
            if arrival == step_end == math.inf:
                break
            if step_end <= arrival:  # a step ends: its outputs first (they may send follow-up requests now)
                end, _, i, outs = heapq.heappop(self._steps)
                self.clock.advance_to(end)
                self._busy[i] = False
                self._deliver(outs, self._live_on[i])
            else:
                self.clock.advance_to(arrival)
            for r in self._handed_over():
                self._submit(r)
            for i in range(len(self.replicas)):
                self._start(i)
        live = {(i, k): r for i, on in enumerate(self._live_on) for k, r in on.items()}
        run = self._finish(self._merged_trace(), live)
        run["replicas"] = {"count": len(self.replicas), "routing": self.routing, "max_waiting": self.max_waiting,
                           "requests": list(self._routed)}
        return run

    def _count_pool(self, st) -> None:
        """The replicas' pools summed: preemptions and computed tokens; peaks are each replica's largest."""
        for rep in self.replicas:
            rep._count_pool(rep.pool_stats)
        reps = [rep.pool_stats for rep in self.replicas]
        st.preemptions = sum(r.preemptions for r in reps)
        st.computed_tokens = sum(r.computed_tokens for r in reps)
        st.recomputed_tokens = sum(r.recomputed_tokens for r in reps)
        st.peak_blocks = max(r.peak_blocks for r in reps)
        st.peak_blocks_with_cache = max(r.peak_blocks_with_cache for r in reps)

    def _merged_trace(self) -> list[dict]:
        return merge_replica_traces([rep.engine.trace.to_dicts() for rep in self.replicas])


def simulate_replicas(profile: Profile, sched: SchedulerConfig, w: Workload, *, replicas: int, routing: str,
                      max_waiting: int = 4, load_tokens: int | None = None, **kw) -> dict:
    """Run workload ``w`` on ``replicas`` simulated servers behind a ``routing`` router (see the module)."""
    return ReplicaSimulation(profile, sched, w, replicas=replicas, routing=routing, max_waiting=max_waiting,
                             load_tokens=load_tokens, **kw).run()


def replica_table(conditions: list[dict]) -> str:
    """Markdown: per condition of replica runs, the router's split and the figures scale-out moves
    (TTFT, prefix-hit share; medians over repeats, requests per replica of the first repeat)."""
    from quanta.analysis.stats import median_iqr

    def med(c: dict, key: str, scale: float = 1.0) -> float:
        return median_iqr([f.get(key, math.nan) for f in c["figures"]])[0] * scale

    lines = ["| condition | replicas | routing | requests per replica | TTFT p50 ms | TTFT p99 ms | prefix-hit share | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for c in conditions:
        rep = c["runs"][0].get("replicas")
        if rep is None:
            continue
        lines.append(f"| {c['name']} | {rep['count']} | {rep['routing']} | {', '.join(map(str, rep['requests']))} | "
                     f"{med(c, 'ttft_p50', 1e3):.0f} | {med(c, 'ttft_p99', 1e3):.0f} | {med(c, 'prefix_hit_share'):.1%} | "
                     f"{med(c, 'num_failed'):g} |")
    return "\n".join(lines)
