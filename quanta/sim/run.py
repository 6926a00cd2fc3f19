"""Workloads of ``quanta bench`` on the simulated engine.

The Engine and the scheduler are quanta's own (``SchedulerConfig.build()``);
only the executor is a :class:`CostModelExecutor` and the clock a
:class:`VirtualClock`. Each request becomes a :class:`RequestSample` as the
bench client would record it (every token one streamed chunk, arriving at the
end of the step that emitted it, plus the profile's front ``response_s`` when it
has a front model; the client adds no queueing of its own), and the engine's
trace is kept as dicts, so
:func:`quanta.bench.runner.compute_metrics` and every ``quanta.analysis``
function apply unchanged.

Requests: the planned kinds (burst, poisson, gamma, concurrency, trace) run
:func:`quanta.bench.workloads.plan`, the same requests the bench client sends
(send times, prompt sizes and output lengths drawn from the workload's
distributions, a trace's shared blocks); replay and a recorded sessions file
run the steps of :func:`quanta.bench.workloads.session_steps`, as the bench
client does (each prompt its parent's simulated context cut to the shared
segments plus new segments of their sizes, so the prefix cache sees the
reuse; exact output lengths); the probe runs the commands of
:func:`quanta.bench.probe.steps`, as the bench client does. Prompt lengths: ``prompt_size * tokens_per_word``
tokens (rounded, >= 1; a trace's sizes are tokens already) of random ids from
the workload's seed (a trace's blocks: equal hash ids give equal ids), or,
with ``prompt_lengths``, the i-th request's entry of that list (request ids in
scheduling order, as the bench client numbers them; entries <= 0 and requests
past the end fall back to the plan). Output lengths: the planned ``max_tokens``
exactly (the simulated tokens are never EOS, like ``--ignore-eos``), or, with
``output_lengths``, the i-th request's entry (e.g. a measured run's completion
tokens; entries <= 0 fall back). With ``send_delays``, request i is sent
that many seconds after its scheduled time (e.g. the bench client's
measured ``sent - scheduled``: a burst's requests arrive spread over some
milliseconds, not at one instant). It reaches the engine when sent, or with a
front model (:mod:`quanta.sim.front`) later, when it has crossed the model's
two stages: the loop's in send order, then the first free tokenizing thread's; or,
with ``handover_delays``, that many seconds after its scheduled time (not before it
is sent; entries None and requests past the end take the front model): a measured
front replayed, as ``quanta simulate --compare --replay-front`` does. KV blocks: ``pool`` (:mod:`quanta.sim.pool`),
the budget and prefix sharing ``quanta serve`` would have, so admission waits
for blocks and a short pool preempts and recomputes as in the engine; without
it, a pool that never runs short, with prefix sharing when ``prefix_cache``.
A request longer than the pool's ``max_model_len`` fails as the server's 400.
The run dict's ``kv_pool`` says what the pool did (:class:`~quanta.sim.pool.PoolStats`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from quanta.analysis.requests import RequestSample
from quanta.bench import mooncake, probe, prompts, sessions
from quanta.bench.workloads import PLANNED, SESSION_SHAPED, RequestSpec, Workload, plan, session_steps
from quanta.config import SchedulerConfig
from quanta.engine.engine import Engine
from quanta.engine.sampling import SamplingParams
from quanta.sim.executor import CostModelExecutor, VirtualClock
from quanta.sim.pool import PoolSpec, PoolStats
from quanta.sim.profile import Profile

#: prompt token ids are drawn below this (fits the embedded SmolLM2 vocabulary for validation runs)
VOCAB = 32_000


@dataclass
class _Req:
    sample: RequestSample
    prompt_len: int
    max_tokens: int
    on_done: Callable[[_Req], None] | None = None
    seq_id: int | None = None
    trace_request: mooncake.TraceRequest | None = None
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    #: when the client sends it, and when the front hands it to the engine (the profile's front delay later)
    sent_at: float = 0.0
    submitted_at: float = 0.0


class Simulation:
    """One workload run on a fresh engine; :meth:`run` returns the bench-style run dict."""

    def __init__(self, profile: Profile, sched: SchedulerConfig, w: Workload, *, tokens_per_word: float = 1.0,
                 max_duration: float = 3600.0, output_lengths: list[int] | None = None,
                 executor=None, clock=None, prefix_cache: bool = False,
                 prompt_lengths: list[int] | None = None, send_delays: list[float] | None = None,
                 pool: PoolSpec | None = None, noise_seed: int | str | None = None,
                 handover_delays: list[float | None] | None = None) -> None:
        self.profile, self.sched, self.w = profile, sched, w
        self.noise_seed = w.seed if noise_seed is None else noise_seed
        self.tpw, self.max_duration = tokens_per_word, max_duration
        self.output_lengths = output_lengths or []
        self.prompt_lengths = prompt_lengths or []
        self.send_delays = send_delays or []
        self.handover_delays = handover_delays or []
        self.rng = random.Random(w.seed)
        self.clock = clock or VirtualClock()
        self.executor = executor or CostModelExecutor(profile, self.clock, seed=self.noise_seed)
        scheduler = sched.build()
        self.pool = pool or PoolSpec(prefix_cache=prefix_cache)
        blocks = self.pool.build(sched.max_num_seqs)
        scheduler.use_blocks(blocks, self.pool.prefix_cache)
        self.pool_stats = PoolStats(blocks.num_blocks, blocks.block_size, self.pool.num_blocks is not None,
                                    self.pool.prefix_cache, self.pool.model_len)
        self.engine = Engine(scheduler, self.executor, self.pool.model_len, clock=self.clock)
        self.samples: list[RequestSample] = []
        self._pending: list[tuple[float, int, _Req]] = []  # (sent, order, request): not sent yet
        self._front: list[tuple[float, int, _Req]] = []  # (submitted, order, request): sent, crossing the front
        front = profile.front
        self._front_stages = front.stages(random.Random(f"{self.noise_seed}/front")) if front else None
        self._order = itertools.count()
        self._live: dict[int, _Req] = {}
        self._hooks: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ helpers
    def tokens(self, size: int, request_id: int | None = None, in_tokens: bool = False) -> int:
        """Prompt tokens of request ``request_id`` given its size in words (or tokens, ``in_tokens``)."""
        if request_id is not None and request_id < len(self.prompt_lengths) and self.prompt_lengths[request_id] > 0:
            return self.prompt_lengths[request_id]
        return size if in_tokens else max(1, round(size * self.tpw))

    def schedule(self, t: float, size: int, max_tokens: int, tag: str = "", on_done=None,
                 trace_request: mooncake.TraceRequest | None = None, prompt_ids: list[int] | None = None,
                 send_at: float | None = None) -> _Req:
        """Request a prompt of ``size`` words (a trace request's: tokens) at ``t`` with ``max_tokens`` outputs.

        ``prompt_ids``: the prompt's token ids exactly (``size`` is then only recorded as the sample's
        ``prompt_size``). ``send_at``: it reaches the engine then (>= ``t``) instead of at ``t`` plus its
        send delay (its latency still counts from ``t``).
        """
        i = len(self.samples)
        if i < len(self.output_lengths) and self.output_lengths[i] > 0:
            max_tokens = self.output_lengths[i]
        s = RequestSample(id=i, scheduled=t, tag=tag, max_tokens=max_tokens, ignore_eos=True, prompt_size=size)
        self.samples.append(s)
        n = len(prompt_ids) if prompt_ids is not None else self.tokens(size, i, trace_request is not None)
        delay = self.send_delays[i] if i < len(self.send_delays) else 0.0
        sent = send_at if send_at is not None else t + max(delay, 0.0)
        r = _Req(s, n, max_tokens, on_done, trace_request=trace_request, prompt_ids=prompt_ids, sent_at=sent)
        heapq.heappush(self._pending, (sent, next(self._order), r))
        return r

    def _cross_front(self) -> None:
        """Requests sent by now enter the front in the order they were sent and cross its two stages
        (quanta.sim.front): the loop's, :meth:`FrontModel.loop_delay` after the send (its noise drawn with this
        run's noise seed) and not before one sent earlier; then the first free tokenizing thread's,
        :meth:`FrontModel.tokenize_s`, after which the request is handed to the engine. A request with a
        replayed handover (``handover_delays``) skips the stages and is handed over then."""
        stages = self._front_stages
        while self._pending and self._pending[0][0] <= self.clock.t:
            r = heapq.heappop(self._pending)[2]
            i = r.sample.id
            replayed = self.handover_delays[i] if i < len(self.handover_delays) else None
            if replayed is not None:
                r.submitted_at = max(r.sent_at, r.sample.scheduled + replayed)
            else:
                r.submitted_at = stages.cross(r.sent_at, r.prompt_len) if stages else r.sent_at
            heapq.heappush(self._front, (r.submitted_at, next(self._order), r))

    def _handed_over(self) -> list[_Req]:
        """The requests the front hands to the engine by now (after :meth:`_cross_front`), in order."""
        self._cross_front()
        out = []
        while self._front and self._front[0][0] <= self.clock.t:
            out.append(heapq.heappop(self._front)[2])
        return out

    def _next_arrival(self) -> float:
        """When the next request is sent or handed to the engine (inf: none is left)."""
        return min(self._pending[0][0] if self._pending else math.inf, self._front[0][0] if self._front else math.inf)

    def schedule_spec(self, spec: RequestSpec, t: float, on_done=None) -> _Req:
        """Request a planned request at ``t`` (its planned time, or now in a closed loop)."""
        return self.schedule(t, spec.prompt_size, spec.max_tokens, spec.tag, on_done, spec.trace_request)

    def _submit(self, r: _Req) -> None:
        r.sample.sent = r.sent_at
        self._add(r, self._prompt_ids(r), self.engine, self._live)

    def _prompt_ids(self, r: _Req) -> list[int]:
        tr = r.trace_request
        if r.prompt_ids is not None:
            return r.prompt_ids
        if tr is not None and r.prompt_len == tr.prompt_tokens:
            return mooncake.prompt_ids(tr, self.w.block_tokens(), self.w.seed, VOCAB)
        return [self.rng.randrange(1, VOCAB) for _ in range(r.prompt_len)]

    def _add(self, r: _Req, ids: list[int], engine: Engine, live: dict[int, _Req]) -> None:
        """Submit ``r`` with prompt ``ids`` to ``engine``; ``live`` maps its sequence id to it. A prompt
        longer than the engine's max_model_len fails at once, as the server's 400."""
        try:
            seq = engine.add_request(ids, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True),
                                     submitted=r.submitted_at)
        except ValueError as exc:
            r.sample.error, r.sample.error_detail, r.sample.done = "http_400", str(exc), self.clock.t
            if r.on_done:
                r.on_done(r)
            return
        r.seq_id = seq.seq_id
        r.sample.prompt_tokens = r.prompt_len
        r.sample.completion_tokens = 0
        live[seq.seq_id] = r

    def cancel(self, r: _Req, reason: str = "client_cancel") -> None:
        """The client stops reading ``r`` now (the engine aborts it). Like the bench client's, the
        stream then never gets its usage chunk: token counts unknown (None), so not in throughput."""
        if r.seq_id is not None and r.seq_id in self._live:
            self.engine.abort(r.seq_id)
            self._live.pop(r.seq_id)
            r.sample.done, r.sample.finish_reason = self.clock.t, reason
            r.sample.prompt_tokens = r.sample.completion_tokens = None

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        _WORKLOADS[self.w.kind](self)
        while True:
            for r in self._handed_over():
                self._submit(r)
            for hook in list(self._hooks):
                hook()
            if self.clock.t > self.max_duration:
                break
            if self.engine.has_work():
                self._deliver(self._engine_step(), self._live)
            elif self._pending or self._front:
                self.clock.advance_to(self._next_arrival())
            elif not self._hooks:
                break
        return self._finish(self.engine.trace.to_dicts(), self._live)

    def _engine_step(self) -> list:
        """One step of this simulation's engine, its pool observed.

        Raises:
            RuntimeError: the engine has work but schedules nothing (no step could ever come).
        """
        steps = self.engine.trace.next_step
        outputs = self.engine.step()
        if self.engine.trace.next_step == steps:
            raise RuntimeError("the simulated engine has waiting requests but schedules no step")
        self._observe_pool()
        return outputs

    def _deliver(self, outs, live: dict[int, _Req]) -> None:
        """Record a step's outputs on the requests of ``live`` (by sequence id), each token reaching the client
        the front's response delay after the step; end the finished ones."""
        lag = self.profile.front.response_s if self.profile.front else 0.0
        for out in outs:
            r = live.get(out.seq_id)
            if r is None:
                continue
            for tok in out.token_ids:
                r.sample.chunks.append([out.time + lag, 1.0])
                r.output_ids.append(tok)
            r.sample.completion_tokens = out.num_output_tokens
            r.sample.cached_tokens = out.num_cached_tokens
            if out.finished:
                r.sample.done, r.sample.finish_reason = out.time + lag, out.finish_reason
                live.pop(out.seq_id)
                if r.on_done:
                    r.on_done(r)

    def _finish(self, trace: list[dict], live: dict[int, _Req]) -> dict:
        """The run dict, once the loop stopped: requests still ``live`` or pending fail with "deadline"."""
        for r in list(live.values()) + [p[2] for p in self._pending + self._front]:
            if r.sample.done is None:
                r.sample.error, r.sample.error_detail, r.sample.done = "deadline", "simulated past max_duration", self.clock.t
        while self.clock.t > self.max_duration and len(self.samples) < self.w.total_requests():
            s = RequestSample(id=len(self.samples), scheduled=self.clock.t)  # never scheduled: one failed request, as bench counts it
            s.error, s.error_detail, s.done = "deadline", "not scheduled before max_duration", self.clock.t
            self.samples.append(s)
        from quanta.bench.runner import compute_metrics

        return {"samples": [s.to_dict() for s in self.samples], "trace": trace, "clock_origin": 0.0,
                "metrics": compute_metrics(self.samples, trace, [], self.w.kind), "simulated": True,
                "sim_calls": len(trace), "sim_seconds": self.clock.t, "kv_pool": self._pool_report()}

    def _observe_pool(self) -> None:
        blocks = self.engine.scheduler.blocks
        self.pool_stats.observe(blocks.pool, blocks.num_cached)

    def _pool_report(self) -> dict:
        st, done = self.pool_stats, [s for s in self.samples if s.error is None and s.prompt_tokens]
        self._count_pool(st)
        st.prompt_tokens = sum(s.prompt_tokens for s in done)
        st.cached_tokens = sum(s.cached_tokens or 0 for s in done)
        st.prefix_hit_share = st.cached_tokens / st.prompt_tokens if st.prompt_tokens else None
        return st.to_dict()

    def _count_pool(self, st: PoolStats) -> None:
        """This engine's preemptions and computed tokens into ``st``."""
        st.preemptions = self.engine.scheduler.num_preemptions
        st.computed_tokens = getattr(self.executor, "computed_tokens", 0)
        st.recomputed_tokens = getattr(self.executor, "recomputed_tokens", 0)


# ---------------------------------------------------------------------- workloads


def _planned(sim: Simulation) -> None:
    """The planned kinds: every request at its planned time, or ``concurrency`` lanes in a closed loop."""
    w = sim.w
    specs = iter(plan(w))
    if w.kind != "concurrency":
        for spec in specs:
            sim.schedule_spec(spec, spec.scheduled)
        return

    def next_one(_r=None) -> None:
        spec = next(specs, None)
        if spec is not None:
            sim.schedule_spec(spec, sim.clock.t, on_done=next_one)

    for _ in range(min(w.concurrency, w.num_requests)):
        next_one()


def _probe(sim: Simulation) -> None:
    """The commands of :func:`quanta.bench.probe.steps`, on the virtual clock: a ``Sleep`` moves the
    workload's own time on (a ``Send`` after it is scheduled then, exactly); ``Until`` and ``Cancel`` wait
    for the clock to reach that time (moving it there when the engine is idle) and then act."""
    gen = probe.steps(sim.w)
    reqs: dict[int, _Req] = {}
    state = {"cmd": next(gen), "t": 0.0}

    def advance(answer=None) -> None:
        try:
            state["cmd"] = gen.send(answer)
        except StopIteration:
            state["cmd"] = None
            sim._hooks.remove(hook)

    def hook() -> None:
        while (cmd := state["cmd"]) is not None:
            if isinstance(cmd, probe.Send):
                r = sim.schedule(state["t"], cmd.words + prompts.nonce_tokens(cmd.nonce_chars), cmd.max_tokens, cmd.tag)
                reqs[r.sample.id] = r
                advance(r.sample)
            elif isinstance(cmd, probe.Sleep):
                state["t"] += cmd.seconds
                advance()
            elif sim.clock.t < state["t"]:
                if not sim.engine.has_work() and not sim._next_arrival() < state["t"]:
                    sim.clock.advance_to(state["t"])
                    continue
                return
            elif isinstance(cmd, probe.Until):
                if not cmd.holds():
                    return
                state["t"] = sim.clock.t
                advance()
            else:
                for s in cmd.samples:
                    sim.cancel(reqs[s.id])
                advance()

    sim._hooks.append(hook)
    hook()


def _segment_ids(seed: int, rid: int, part, n: int) -> list[int]:
    """``n`` token ids of one prompt segment, seeded by the run's seed, the request and the segment."""
    rng = random.Random(f"{seed}:{rid}:{part}")
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _session_shaped(sim: Simulation) -> None:
    """Replay and recorded sessions: the steps of :func:`quanta.bench.workloads.session_steps`, executed as
    the bench client executes them. Each request is sent when its step says (after its parent's send or
    end in this simulation); its prompt is its parent's simulated parts (prompt segments, then the ids it
    emitted once it finished) cut to the shared segments, plus seeded random ids per new segment (a
    stand-in of ``shared_tokens`` ids where the parent is not replayed), so the prefix cache sees the
    reuse the bench's prompts have; its output is exactly ``completion_tokens``. Segment sizes: a recorded
    file's are tokens, the replay kind's words (``tokens_per_word``)."""
    seed = sim.w.seed
    size = (lambda n: n) if sim.w.kind == "sessions" else (lambda n: sim.tokens(n) if n else 0)
    parts: dict[int, list[list[int]]] = {}
    at: dict[str, dict[int, float]] = {"sent": {}, "done": {}}
    waiting: dict[tuple[str, int], list[sessions.ReplayStep]] = {}

    def release(event: str, rid: int, t: float) -> None:
        at[event][rid] = t
        for child in waiting.pop((event, rid), []):
            send(child, t)

    def send(step: sessions.ReplayStep, parent_at: float | None) -> None:
        r = step.request
        scheduled, send_at = step.times(parent_at)
        prefix = step.prefix(parts.get(step.parent.id) if step.parent is not None else None)
        if prefix is None:
            prefix = [_segment_ids(seed, r.id, "shared", size(r.shared_tokens))]
        parts[r.id] = prefix + [_segment_ids(seed, r.id, j, size(seg.tokens)) for j, seg in enumerate(r.segments)]
        ids = [t for part in parts[r.id] for t in part] or _segment_ids(seed, r.id, "empty", 1)

        def done(q: _Req) -> None:
            parts[r.id] = parts[r.id] + [list(q.output_ids)]
            release("done", r.id, q.sample.done)

        sim.schedule(scheduled, r.prompt_tokens or len(ids), r.completion_tokens, step.tag, on_done=done,
                     prompt_ids=ids, send_at=send_at)
        release("sent", r.id, send_at)

    for step in session_steps(sim.w):
        if step.after is None:
            send(step, None)
        elif step.parent.id in at[step.after]:
            send(step, at[step.after][step.parent.id])
        else:
            waiting.setdefault((step.after, step.parent.id), []).append(step)


_WORKLOADS = {**{k: _planned for k in PLANNED}, "probe": _probe, **{k: _session_shaped for k in SESSION_SHAPED}}


def simulate(profile: Profile, sched: SchedulerConfig, w: Workload, **kw) -> dict:
    """Run workload ``w`` on the simulated engine; the run dict of ``quanta bench``
    (``samples``, ``trace``, ``metrics``) plus ``sim_calls`` and ``sim_seconds``."""
    return Simulation(profile, sched, w, **kw).run()


def condition(name: str, runs: list[dict], flags: list[str] | None = None) -> dict:
    """A bench condition dict (``name``, ``runs``, ``figures``, ``summary``) of simulated runs."""
    from quanta.analysis.report import aggregate, repeat_figures

    figures = [repeat_figures(r["metrics"]) for r in runs]
    return {"name": name, "flags": flags, "valid": True, "runs": runs, "figures": figures, "summary": aggregate(figures)}
