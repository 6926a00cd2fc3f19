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
:data:`TOLERANCE` from the measured median (``misses``).

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
                       draws: int = 1) -> list[dict]:
    """``draws`` simulated runs per measured repeat of ``cond`` (same seed offset and prompt lengths; a
    sessions workload with the lengths its file recorded, as the bench replayed them), each draw with its
    own step-noise seed (the first the workload's); the scheduler from the condition's serve flags
    (``bench sweep``) or else the server's applied config (``bench run``)."""
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


def compare(profile: Profile, docs: list[tuple[str, dict]], max_duration: float = 3600.0, draws: int = 1) -> list[dict]:
    """Rows of simulated vs measured figures for every measured condition of ``docs``
    (``(source path, bench result document)`` pairs); ``draws`` simulated runs per measured repeat.

    Raises:
        CompareError: a document that is not a bench result or has no measured condition.
    """
    rows = []
    for path, doc in docs:
        check_measured(path, doc)
        try:
            rows += _doc_rows(profile, path, doc, max_duration, draws)
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


def _doc_rows(profile: Profile, path: str, doc: dict, max_duration: float, draws: int) -> list[dict]:
    try:
        w = Workload.from_dict(doc["workload"])
    except TypeError as exc:
        raise CompareError(f"{path}: workload {doc['workload']!r} is not one quanta bench knows: {exc}") from exc
    measured_conds = [c for c in doc["conditions"] if c.get("valid", True) and c.get("runs")]
    if not measured_conds:
        raise CompareError(f"{path}: no measured condition to compare")
    rows = []
    for cond in measured_conds:
        runs = simulate_condition(profile, cond, w, max_duration, draws)
        if any(s.get("error") == "deadline" for r in runs for s in r["samples"]):
            raise CompareError(f"{path}: condition {cond['name']!r}: the simulation ran past --max-duration "
                               f"{max_duration:g} s before every request finished; raise it")
        measured = cond.get("figures") or [repeat_figures(r["metrics"]) for r in cond["runs"]]
        rows.append(row(path, cond["name"], cond.get("flags"), w, measured, [repeat_figures(r["metrics"]) for r in runs]))
    return rows


def row(source: str, name: str, flags: list[str] | None, w: Workload, measured: list[dict], simulated: list[dict]) -> dict:
    """One comparison row from per-repeat figures (:func:`repeat_figures`) of both sides:
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
    return {"source": source, "condition": name, "flags": flags, "workload": w.describe(),
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
            "figures": sum(1 for r in rows for k, _, _ in FIGURES if not math.isnan(r["rel_error"][k]))}


def _cell(row: dict, key: str, scale: float) -> str:
    m = row["measured"][key][0]
    s = row["simulated"][key][0]
    if math.isnan(m):
        return f"{s * scale:.1f} / -"
    lo, hi = row["spread"][key]
    mark = " **miss**" if key in row["misses"] else " out" if key in row["outside"] else ""
    return f"{s * scale:.1f} / {m * scale:.1f} ({lo * scale:.1f}-{hi * scale:.1f}) {row['rel_error'][key]:+.0%}{mark}"


def _steps(row: dict, which: str) -> str:
    return "/".join("-" if math.isnan(row[which][k][0]) else f"{row[which][k][0]:g}" for k in STEPS)


def markdown_table(rows: list[dict]) -> str:
    """One line per condition: simulated / measured median (measured min-max) and the relative error of each
    figure, ``out`` when the simulated median is outside the measured spread, ``**miss**`` when it is also
    more than :data:`TOLERANCE` from the measured median."""
    head = "| condition | " + " | ".join(f"{h}: sim / meas (min-max) err" for _, h, _ in FIGURES) + " | steps p/d/m sim vs meas |"
    lines = [head, "|---|" + "---|" * (len(FIGURES) + 1)]
    for r in rows:
        cells = [_cell(r, k, s) for k, _, s in FIGURES]
        lines.append(f"| {r['condition']} | " + " | ".join(cells) + f" | {_steps(r, 'simulated')} vs {_steps(r, 'measured')} |")
    return "\n".join(lines)


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


def ratio_table(ratios: list[dict]) -> str:
    """Markdown: simulated / measured ratio (the measured ratio's min-max over repeats) and its error, per
    figure, for :func:`ratio_rows`, marked as figures are (:func:`markdown_table`)."""
    head = "| conditions | " + " | ".join(f"{h}: sim / meas ratio (min-max) err" for _, h, _ in FIGURES) + " |"
    lines = [head, "|---|" + "---|" * len(FIGURES)]
    for r in ratios:
        cells = ["-" if math.isnan(r["rel_error"][k]) else _ratio_cell(r, k) for k, _, _ in FIGURES]
        lines.append(f"| {r['condition']} over {r['over']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio_cell(r: dict, key: str) -> str:
    lo, hi = r.get("spread", {}).get(key, (math.nan, math.nan))
    spread = "" if math.isnan(lo) else f" ({lo:.2f}-{hi:.2f})"
    mark = " **miss**" if key in r.get("misses", []) else " out" if key in r.get("outside", []) else ""
    return f"{r['ratio'][key][0]:.2f} / {r['ratio'][key][1]:.2f}{spread} {r['rel_error'][key]:+.0%}{mark}"


def summary_lines(summ: dict) -> str:
    per = ", ".join(f"{h} {summ[k]:.0%}" for k, h, _ in FIGURES)
    misses = (f" {summ['misses']} of {summ['figures']} figures are outside the measured min-max and more than "
              f"{TOLERANCE:.0%} from the measured median." if "misses" in summ else "")
    return f"Median absolute relative error: **{summ['all']:.0%}** over all figures; per figure: {per}.{misses}"


def _profile_line(label: str, path: str, p: Profile) -> str:
    dec = ", ".join(f"B={b:g} {t * 1e3:.1f} ms" for b, t in p.decode_points)
    pre = ", ".join(f"{n:g}: {t * 1e3:.2f}" for n, t in p.prefill_points)
    return (f"- {label} `{path}` ({p.meta.get('created', 'undated')}): overhead {p.overhead_s * 1e3:.1f} ms/call; decode "
            f"step net of overhead {dec}; prefill ms/token by chunk {pre}; context {p.prefill_ctx * 1e9:.1f} ns/token/pos "
            f"(prefill), {p.decode_ctx * 1e9:.1f} ns/pos (decode)" + _step_model_text(p))


def _step_model_text(p: Profile) -> str:
    m = p.step_model
    if m is None:
        return ""
    return (f"; step model: interference {m.interference_s_per_row * 1e3:.2f} ms per decode row beside prompt rows, "
            f"prefix hit {m.prefix_hit_s_per_token * 1e9:.1f} ns/token, threads {m.threads or 'unknown'}")


def document(profile_path: str, rows: list[dict], command: str, also: tuple[str, list[dict]] | None = None) -> dict:
    """The comparison result (written as ``PREFIX.json``)."""
    from datetime import datetime

    from quanta.bench.output import code_version, machine

    doc = {"kind": "sim-compare", "created": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": machine(), "code": code_version(), "command": command, "profile": profile_path,
           "rows": rows, "summary": summary(rows), "ratios": ratio_rows(rows)}
    if also:
        doc["also_profile"], doc["also_rows"], doc["also_summary"] = also[0], also[1], summary(also[1])
    return doc


def markdown(doc: dict, profiles: dict[str, Profile], title: str) -> str:
    """The report: how it was made, the table, the error summary (and the same with the second profile)."""
    from quanta.bench.output import machine_text

    sources = sorted({r["source"] for r in doc["rows"]})
    out = [f"# {title}", "", f"- date: {doc['created']}",
           f"- machine: {machine_text(doc['machine'])}, Python {doc['machine']['python']}",
           f"- command: `{doc['command']}`", f"- code: quanta {doc['code']}",
           "- measured: " + ", ".join(f"`{s}`" for s in sources) + " (quanta bench over HTTP; each row's workload is "
           "that file's; TTFT from the client, the other figures from the server trace; medians over repeats, "
           "each cell with the measured min-max)",
           _profile_line("profile", doc["profile"], profiles[doc["profile"]])]
    if "also_profile" in doc:
        out.append(_profile_line("second profile", doc["also_profile"], profiles[doc["also_profile"]]))
    out += ["", "Each cell: simulated / measured median (measured min-max over repeats) relative error; `out`: the "
            "simulated median is outside the measured min-max, `**miss**`: and more than "
            f"{TOLERANCE:.0%} from the measured median. Steps: prefill calls / decode "
            "steps / mixed steps (median over repeats), simulated vs measured.", "", markdown_table(doc["rows"]), "",
            summary_lines(doc["summary"])]
    if doc.get("ratios"):
        out += ["", "Between the conditions of one measured file (each over the file's first condition): the ratio of "
                "each figure, simulated / measured, and the simulated ratio's relative error:", "", ratio_table(doc["ratios"])]
    if "also_profile" in doc:
        out += ["", f"With the second profile (`{doc['also_profile']}`):", "",
                markdown_table(doc["also_rows"]), "", summary_lines(doc["also_summary"])]
    return "\n".join(out) + "\n"
