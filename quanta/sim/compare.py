"""Simulated vs measured: replay a ``quanta bench`` result on the cost model.

``quanta simulate --profile P --compare BENCH.json`` takes every measured
condition of a ``quanta bench run|sweep`` result and simulates it with the
same scheduler configuration (parsed from the condition's ``quanta serve``
flags by the serve parser itself), the same workload, and, for repeat ``r``,
the prompt lengths the server reported (``usage.prompt_tokens``) and the send
delays the client recorded (``sent - scheduled``) for the requests of measured
repeat ``r``, in request order, and each request's output length (the
``max_tokens`` it was sent with; for a run whose outputs ended at EOS, what
it produced), on the KV pool the server reported (``kv_cache_blocks``, block
size, prefix cache and ``max_model_len`` of its ``/v1/config``; a server
from before the block pool: the pool its serve flags give,
:mod:`quanta.sim.pool`); a cluster (``quanta serve --replicas N``, whose
``/v1/config`` has ``cluster``) on N simulated replicas behind its router
(:mod:`quanta.sim.replicas`), each with that pool. It then reports, per
condition, the measured median and spread (min-max over repeats) and the
simulated median of each figure and the relative error
``(simulated - measured) / measured``, and which figures fall outside the
measured spread (``outside``) and of those which are also more than
:data:`TOLERANCE` from the measured median (``misses``). With ``--replay-front``
each request reaches the simulated engine when the measured front handed it
over (the server trace's ``arrivals``), so a figure's error is the engine
model's alone; beside a run without it, the difference is the front model's.

Figures: client TTFT p50 and p99, server-trace ITL p50 and p99 (seconds),
throughput (output tok/s, first scheduled send to last response end) and the
trace's prompt rate (prompt tok/s over the union of steps that carry
prefill); the step counts (prefill calls, decode steps, mixed steps) are
reported beside them to show whether the simulated schedule is the measured one.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from datetime import UTC

from quanta.analysis.report import aggregate, repeat_figures
from quanta.analysis.server_trace import trace_entries
from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.sim.pool import PoolSpec, pool_from_applied, pool_from_flags
from quanta.sim.profile import Profile
from quanta.sim.run import Simulation

#: (key, column header, display scale) of the compared figures
FIGURES = [("ttft_p50", "TTFT p50 ms", 1e3), ("ttft_p99", "TTFT p99 ms", 1e3), ("itl_p50", "ITL p50 ms", 1e3),
           ("itl_p99", "ITL p99 ms", 1e3), ("throughput", "throughput tok/s", 1.0), ("prefill_rate", "prompt rate tok/s", 1.0)]
STEPS = ("prefill_calls", "decode_steps", "mixed_steps")
#: a simulated median outside the measured min-max is a miss only when it is this far from the measured median
TOLERANCE = 0.10


class CompareError(ValueError):
    """A bench result that cannot be replayed (not a bench document, no measured condition)."""


def sched_config(flags: list[str], applied: dict | None = None) -> SchedulerConfig:
    """The :class:`SchedulerConfig` ``quanta serve FLAGS`` would run; ``--mixed-prefill-quantum auto``
    takes the value the server reported applying (``applied``, from its ``/v1/config``).

    Raises:
        CompareError: flags ``quanta serve`` rejects, or ``auto`` without an applied value.
    """
    from quanta.flags import configs_from_args, parse_serve_flags

    try:
        args = parse_serve_flags(flags)
        sched = configs_from_args(args)[1]
    except ValueError as exc:
        raise CompareError(f"serve flags {' '.join(flags)!r}: {exc}") from exc
    if args.mixed_prefill_quantum == "auto":
        value = (applied or {}).get("mixed_prefill_quantum")
        if not isinstance(value, int):
            raise CompareError(f"serve flags {' '.join(flags)!r}: 'auto' and the server reported no applied mixed_prefill_quantum")
        sched = sched.with_knob("mixed_prefill_quantum", value)
    return sched


def trace_prompt_lengths(records: list[dict]) -> list[int]:
    """Prompt tokens of every sequence whose prefill the trace holds (its position after the step that
    emitted its first token: the record's ``positions`` where recorded, so a cached prefix counts), in
    order of first appearance."""
    first: dict[int, int] = {}
    length: dict[int, int] = {}
    for r, row in trace_entries(records):
        recorded = r.get("positions")
        for i, (sid, pos, n, is_decode, emitted) in enumerate(row):
            first.setdefault(sid, len(first))
            if emitted and not is_decode:
                length[sid] = (pos if recorded is None else recorded[i]) + n
    return [length[sid] for sid in sorted(first, key=first.get) if sid in length]


def prompt_lengths(run: dict) -> list[int]:
    """Prompt tokens per request of one measured repeat, in request-id order.

    From the request's usage; a request without usage (a stream the client cancelled never gets it)
    takes, in send order, the prompt lengths the server trace shows that no request with usage
    accounts for (equal lengths are interchangeable); 0 (the workload's word count) when none is left.
    """
    samples = sorted(run["samples"], key=lambda s: s["id"])
    spare = trace_prompt_lengths(run.get("trace") or [])
    for s in samples:
        if s.get("prompt_tokens") and s["prompt_tokens"] in spare:
            spare.remove(s["prompt_tokens"])
    unknown = sorted((s for s in samples if not s.get("prompt_tokens")), key=lambda s: (s.get("sent") is None, s.get("sent") or 0))
    fill = {s["id"]: spare[i] for i, s in enumerate(unknown) if i < len(spare)}
    return [int(s.get("prompt_tokens") or fill.get(s["id"], 0)) for s in samples]


def output_lengths(run: dict, exact: bool = True) -> list[int]:
    """Output lengths per request of one measured repeat, in request-id order (0 where unknown): the
    ``max_tokens`` each request was sent with (``exact``: ignore_eos, so that is its length), else what it
    produced before EOS (``completion_tokens``); the simulator replays them request by request."""
    key = "max_tokens" if exact else "completion_tokens"
    return [int(s.get(key) or 0) for s in sorted(run["samples"], key=lambda s: s["id"])]


def send_delays(run: dict) -> list[float]:
    """Seconds from scheduled to sent per request of one measured repeat, in request-id order (0 where unsent)."""
    return [max(0.0, s["sent"] - s["scheduled"]) if s.get("sent") is not None else 0.0
            for s in sorted(run["samples"], key=lambda s: s["id"])]


def handover_delays(run: dict) -> list[float | None]:
    """Seconds from scheduled to handed to the engine per request of one measured repeat, in request-id order
    (its requests paired with the server trace's arrivals, :func:`quanta.sim.front.paired`; None where a
    request never reached the engine).

    Raises:
        CompareError: the repeat cannot be paired (no clock origin or arrivals: a server on another host,
            one that recorded no trace, or counts that differ).
    """
    from quanta.sim.front import paired

    pairs = paired(run)
    if pairs is None:
        raise CompareError("--replay-front: a measured repeat's requests cannot be paired with its server trace's "
                           "arrivals (no clock origin, no trace, or counts that differ)")
    delays: list[float | None] = [None] * (1 + max((s["id"] for s in run["samples"]), default=-1))
    for s, a in pairs:
        delays[s["id"]] = a[1] - s["scheduled"]
    return delays


def applied_config(applied: dict | None) -> SchedulerConfig:
    """The :class:`SchedulerConfig` a quanta server reported running (``/v1/config``, as ``quanta bench run``
    records it).

    Raises:
        CompareError: no applied config (the server was not quanta) or one quanta cannot build.
    """
    from quanta.engine.policies import POLICIES

    if not applied or applied.get("scheduler") not in POLICIES:
        raise CompareError("a condition has neither serve flags nor the server's applied config "
                           "(a server other than quanta?): its scheduler is unknown")
    knobs = {k.name: applied[k.name] for k in POLICIES[applied["scheduler"]].knobs if k.name in applied}
    try:
        return SchedulerConfig(applied["scheduler"], int(applied["max_num_seqs"]), knobs)
    except (KeyError, TypeError, ValueError) as exc:
        raise CompareError(f"the server's applied config cannot be simulated: {exc}") from exc


def simulate_condition(profile: Profile, cond: dict, workload: Workload, max_duration: float,
                       draws: int = 1, replay_front: bool = False) -> list[dict]:
    """``draws`` simulated runs per measured repeat of ``cond`` (same seed offset and prompt lengths; a
    sessions workload with the lengths its file recorded, as the bench replayed them), each draw with its
    own step-noise seed (the first the workload's); the scheduler from the condition's serve flags
    (``bench sweep``) or else the server's applied config (``bench run``). ``replay_front``: each request
    reaches the engine when the measured front handed it over (:func:`handover_delays`), not through the
    profile's front model, so what is left of an error is the engine model's."""
    flags = cond.get("flags")
    sched = sched_config(flags, cond.get("applied")) if flags else applied_config(cond.get("applied"))
    pool = condition_pool(profile, sched.max_num_seqs, flags, cond.get("applied"))
    cluster = replica_settings(cond.get("applied"))
    runs = []
    for r, measured in enumerate(cond["runs"]):
        w = replace(workload, seed=workload.seed + r)
        kw = dict(max_duration=max_duration, pool=pool)
        if workload.kind != "sessions":  # a sessions file holds each request's lengths; its request ids are in send order
            kw |= dict(prompt_lengths=prompt_lengths(measured), send_delays=send_delays(measured),
                       output_lengths=output_lengths(measured, exact=workload.output_dist != "eos"))
        if replay_front:
            kw["handover_delays"] = handover_delays(measured)
        for k in range(draws):
            seed = None if k == 0 else f"{w.seed}/draw{k}"
            if cluster is None:
                runs.append(Simulation(profile, sched, w, noise_seed=seed, **kw).run())
            else:
                from quanta.sim.replicas import simulate_replicas

                runs.append(simulate_replicas(profile, sched, w, noise_seed=seed, **cluster, **kw))
    return runs


def replica_settings(applied: dict | None) -> dict | None:
    """The replica count and router settings of a measured cluster (``quanta serve --replicas``: its
    ``/v1/config`` has ``cluster``), as :func:`~quanta.sim.replicas.simulate_replicas` takes them; None for
    one server. A front that did not report ``max_waiting`` / ``load_tokens`` predates them: the load bound
    was 4 and prefix routing pure affinity (``load_tokens`` 0); a reported None is the mean-prompt price."""
    cluster = (applied or {}).get("cluster")
    if not cluster:
        return None
    try:
        return {"replicas": int(cluster["replicas"]), "routing": str(cluster["routing"]),
                "max_waiting": int(cluster.get("max_waiting", 4)), "load_tokens": cluster.get("load_tokens", 0)}
    except (KeyError, TypeError, ValueError) as exc:
        raise CompareError(f"the server's cluster settings cannot be simulated: {exc}") from exc


def condition_pool(profile: Profile, max_num_seqs: int, flags: list[str] | None, applied: dict | None) -> PoolSpec:
    """The KV pool a measured condition ran on: the one its server reported, else its serve flags' budget
    (the prefix cache as the flags say; no flags and no report: quanta serve's default, prefix cache on).

    Raises:
        CompareError: serve flags whose budget the simulator cannot size (``--kv-cache-memory`` with a
            profile that has no KV geometry).
    """
    reported = pool_from_applied(applied)
    if reported is not None:
        return reported
    if not flags:
        applied = applied or {}
        return PoolSpec(prefix_cache=bool(applied.get("prefix_cache", True)), max_model_len=applied.get("max_model_len"))
    from quanta.flags import configs_from_args, parse_serve_flags

    engine = configs_from_args(parse_serve_flags(flags))[0]
    try:
        return pool_from_flags(profile, max_num_seqs, block_size=engine.block_size, kv_cache_memory=engine.kv_cache_memory,
                               kv_cache_tokens=engine.kv_cache_tokens, kv_cache_dtype=engine.kv_cache_dtype,
                               max_model_len=engine.max_model_len or (applied or {}).get("max_model_len"),
                               prefix_cache=engine.prefix_cache)
    except ValueError as exc:
        raise CompareError(f"serve flags {' '.join(flags)!r}: {exc}") from exc


def rel_error(simulated: float, measured: float) -> float:
    """``(simulated - measured) / measured``; NaN when either is missing or measured is 0."""
    if measured is None or simulated is None or measured == 0 or math.isnan(measured) or math.isnan(simulated):
        return math.nan
    return (simulated - measured) / measured


def compare(profile: Profile, docs: list[tuple[str, dict]], max_duration: float = 3600.0, draws: int = 1,
            replay_front: bool = False) -> list[dict]:
    """Rows of simulated vs measured figures for every measured condition of ``docs``
    (``(source path, bench result document)`` pairs); ``draws`` simulated runs per measured repeat;
    ``replay_front``: the measured handovers replayed (:func:`simulate_condition`).

    Raises:
        CompareError: a document that is not a bench result or has no measured condition.
    """
    rows = []
    for path, doc in docs:
        check_measured(path, doc)
        try:
            rows += _doc_rows(profile, path, doc, max_duration, draws, replay_front)
        except CompareError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            raise CompareError(f"{path}: malformed quanta bench result ({type(exc).__name__}: {exc})") from exc
    return rows


def check_measured(path: str, doc) -> None:
    """Raise :class:`CompareError` unless ``doc`` looks like a measured ``quanta bench`` result."""
    if not isinstance(doc, dict) or not isinstance(doc.get("conditions"), list) or not isinstance(doc.get("workload"), dict):
        raise CompareError(f"{path}: not a quanta bench result (no conditions list / workload)")
    if doc.get("kind") in ("simulate", "sim-compare"):
        raise CompareError(f"{path}: a {doc['kind']!r} document is simulated, not measured")


def _doc_rows(profile: Profile, path: str, doc: dict, max_duration: float, draws: int, replay_front: bool) -> list[dict]:
    try:
        w = Workload.from_dict(doc["workload"])
    except TypeError as exc:
        raise CompareError(f"{path}: workload {doc['workload']!r} is not one quanta bench knows: {exc}") from exc
    measured_conds = [c for c in doc["conditions"] if c.get("valid", True) and c.get("runs")]
    if not measured_conds:
        raise CompareError(f"{path}: no measured condition to compare")
    rows = []
    for cond in measured_conds:
        try:
            runs = simulate_condition(profile, cond, w, max_duration, draws, replay_front)
        except CompareError as exc:
            raise CompareError(f"{path}: condition {cond['name']!r}: {exc}") from exc
        if any(s.get("error") == "deadline" for r in runs for s in r["samples"]):
            raise CompareError(f"{path}: condition {cond['name']!r}: the simulation ran past --max-duration "
                               f"{max_duration:g} s before every request finished; raise it")
        measured = cond.get("figures") or [repeat_figures(r["metrics"]) for r in cond["runs"]]
        simulated = [repeat_figures(r["metrics"]) for r in runs]
        rows.append(row(path, cond["name"], cond.get("flags"), w.describe(), measured, simulated))
        rows[-1]["draws"] = [[{k: f.get(k, math.nan) for k, _, _ in FIGURES} for f in simulated[i:i + draws]]
                             for i in range(0, len(simulated), draws)]
    return rows


def row(source: str, name: str, flags: list[str] | None, workload: str, measured: list[dict], simulated: list[dict]) -> dict:
    """One comparison row from per-repeat figures (:func:`repeat_figures`) of both sides (``workload``: its description):
    ``measured`` / ``simulated`` hold ``(median, p25, p75)`` per figure, ``rel_error`` the error of the medians,
    ``spread`` the measured ``(min, max)``, ``outside`` the figures whose simulated median is outside it and
    ``misses`` those of them also more than :data:`TOLERANCE` from the measured median; ``repeats`` each
    measured repeat's figures, in repeat order (the ratios' spread, :func:`ratio_rows`)."""
    keys = [k for k, _, _ in FIGURES] + list(STEPS)
    missing = (math.nan, math.nan, math.nan)  # a figure one side lacks (a run without any server trace)
    meas, sim = ({k: a.get(k, missing) for k in keys} for a in (aggregate(measured), aggregate(simulated)))
    err = {k: rel_error(sim[k][0], meas[k][0]) for k, _, _ in FIGURES}
    spread = {k: measured_spread(measured, k) for k, _, _ in FIGURES}
    outside = [k for k, _, _ in FIGURES if not math.isnan(err[k]) and not spread[k][0] <= sim[k][0] <= spread[k][1]]
    return {"source": source, "condition": name, "flags": flags, "workload": workload,
            "measured": meas, "simulated": sim, "rel_error": err, "spread": spread, "outside": outside,
            "misses": [k for k in outside if abs(err[k]) > TOLERANCE],
            "repeats": {k: [_number(f.get(k)) for f in measured] for k, _, _ in FIGURES}}


def _number(v) -> float:
    return float(v) if isinstance(v, (int, float)) else math.nan


def measured_spread(figures: list[dict], key: str) -> tuple[float, float]:
    """``(min, max)`` of ``key`` over the measured repeats (NaN, NaN when none has it)."""
    vals = [f[key] for f in figures if isinstance(f.get(key), (int, float)) and not math.isnan(f[key])]
    return (min(vals), max(vals)) if vals else (math.nan, math.nan)


def summary(rows: list[dict]) -> dict:
    """Median absolute relative error over all figures and per figure (NaNs left out)."""
    def med(vals):
        vals = [abs(v) for v in vals if not math.isnan(v)]
        return statistics.median(vals) if vals else math.nan

    return {"all": med([r["rel_error"][k] for r in rows for k, _, _ in FIGURES]),
            **{k: med([r["rel_error"][k] for r in rows]) for k, _, _ in FIGURES},
            "misses": sum(len(r["misses"]) for r in rows),
            "figures": sum(1 for r in rows for k, _, _ in FIGURES if not math.isnan(r["rel_error"][k])),
            "chance": chance(rows)}


def chance(rows: list[dict]) -> dict | None:
    """What an exact simulator would miss by chance with these repeats: each simulated draw ``j`` (one per
    measured repeat, the rows' ``draws``) taken as the measured repeats and the other draws as the simulation,
    the misses counted as for the real ones (:func:`row`; the ratios apart, :func:`ratio_rows`); None with
    fewer than 2 draws. A figure's simulated median falls outside the min-max of n repeats of its own
    distribution with probability 2^(1-n) (25% with 3 repeats, 6% with 5), and a widely spread figure is
    then often more than :data:`TOLERANCE` off too. The draws vary less than a shared host's repeats (no
    drift between them), so this is, if anything, below the real comparison's chance rate.

    Returns ``{"draws", "misses": [figures missed with each draw taken as measured], "mean", "none": the
    share of draws with no figure missed, "per_figure": mean misses of each figure, "ratio_misses": [ratios
    missed with each draw]}``."""
    draws = min((len(d) for r in rows for d in r.get("draws") or [[]]), default=0)
    if draws < 2:
        return None
    sets, ratio_sets = [], []
    for j in range(draws):
        pseudo = [row(r["source"], r["condition"], r["flags"], r["workload"], [d[j] for d in r["draws"]],
                      [f for d in r["draws"] for k, f in enumerate(d) if k != j]) for r in rows]
        sets.append([k for r in pseudo for k in r["misses"]])
        ratio_sets.append(sum(len(r["misses"]) for r in ratio_rows(pseudo)))
    return {"draws": draws, "misses": [len(s) for s in sets], "mean": statistics.mean(len(s) for s in sets),
            "none": sum(not s for s in sets) / draws,
            "per_figure": {k: sum(s.count(k) for s in sets) / draws for k, _, _ in FIGURES}, "ratio_misses": ratio_sets}


def ratio_rows(rows: list[dict]) -> list[dict]:
    """Per measured file with several conditions, each later condition against the file's first: the
    measured and simulated ratios of every figure (e.g. the probe's TTFT at quantum 2048 over 128), the
    ratio's relative error, its measured spread (``(min, max)`` of the ratio repeat by repeat: an
    interleaved sweep runs repeat r of every condition back to back) and, as for figures, ``outside`` and
    ``misses``."""
    out = []
    for source in dict.fromkeys(r["source"] for r in rows):
        first, *others = [r for r in rows if r["source"] == source]
        for r in others:
            ratio = {k: tuple(r[side][k][0] / first[side][k][0] if first[side][k][0] else math.nan
                              for side in ("simulated", "measured")) for k, _, _ in FIGURES}
            err = {k: rel_error(*ratio[k]) for k in ratio}
            spread = {k: _ratio_spread(r, first, k) for k in ratio}
            outside = [k for k in ratio if not math.isnan(err[k]) and not spread[k][0] <= ratio[k][0] <= spread[k][1]]
            out.append({"source": source, "condition": r["condition"], "over": first["condition"], "ratio": ratio,
                        "rel_error": err, "spread": spread, "outside": outside,
                        "misses": [k for k in outside if abs(err[k]) > TOLERANCE]})
    return out


def _ratio_spread(r: dict, first: dict, key: str) -> tuple[float, float]:
    """``(min, max)`` over the repeats of ``r``'s figure over ``first``'s of the same repeat (NaN, NaN: none)."""
    pairs = zip((r.get("repeats") or {}).get(key, []), (first.get("repeats") or {}).get(key, []))
    vals = [a / b for a, b in pairs if not (math.isnan(a) or math.isnan(b)) and b]
    return (min(vals), max(vals)) if vals else (math.nan, math.nan)


def document(profile_path: str, rows: list[dict], command: str, also: tuple[str, list[dict]] | None = None,
             replay_front: bool = False) -> dict:
    """The comparison result (written as ``PREFIX.json``); ``replay_front``: the rows replayed the measured front."""
    from datetime import datetime

    from quanta.bench.output import code_version, machine

    doc = {"kind": "sim-compare", "created": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": machine(), "code": code_version(), "command": command, "profile": profile_path,
           "replay_front": replay_front, "rows": rows, "summary": summary(rows), "ratios": ratio_rows(rows)}
    if also:
        doc["also_profile"], doc["also_rows"], doc["also_summary"] = also[0], also[1], summary(also[1])
    return doc
