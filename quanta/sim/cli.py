"""``quanta simulate`` and ``quanta profile-engine``.

``simulate`` runs a ``quanta bench`` workload on quanta's own scheduler and
Engine with a :class:`~quanta.sim.executor.CostModelExecutor` and prints the
table of ``quanta bench``; ``--sweep SPEC`` (repeatable, the grid syntax of
``quanta bench sweep --grid``) simulates every condition of a grid and, with
``--out``, writes the same report files (JSON, markdown, plots).

``profile-engine`` writes a cost profile: timed in-process on the real
executor (:mod:`quanta.sim.measure`) or, with ``--from-bench``, fitted to the
server traces of ``quanta bench`` results (:mod:`quanta.sim.fit`). This module
is the command line (flags, their checks with exit 2, what is printed and
written); the timing and the fit are in those modules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from quanta.flags import (
    KV_DTYPE_ALIASES,
    SCHEDULER_FLAGS,
    add_dtype_flag,
    add_kv_cache_flags,
    add_scheduler_flags,
    command_line,
    dtype_name,
    positive_float,
    positive_int,
    register_once,
    scheduler_config,
    writable_prefix,
)

COMMANDS = ("simulate", "profile-engine")


def _workload_flags(p: argparse.ArgumentParser) -> None:
    from quanta.bench.cli import add_workload_group

    g = add_workload_group(p, "workload (as quanta bench; sizes in words, see --tokens-per-word)")
    g.add_argument("--tokens-per-word", type=positive_float, default=1.0, help="prompt tokens per word (default 1)")
    g.add_argument("--repeats", type=positive_int, default=1, help="simulated runs per condition (default 1)")
    g.add_argument("--max-duration", type=positive_float, default=3600.0, help="simulated seconds at most (default 3600)")
    g.add_argument("--out", help="output prefix: PREFIX.json, PREFIX.md, PREFIX-*.png")
    g.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    g.add_argument("--no-raw", dest="raw", action="store_false",
                   help="PREFIX.json without per-token chunks and step traces (figures and per-request lengths kept; "
                        "the simulation is deterministic, rerun the command for the rest)")
    g.add_argument("--title", help="report title")
    g.add_argument("--note", default="", help="a sentence for the report (e.g. how the workload was scaled)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="no prefix sharing across sequences (quanta serve --no-prefix-cache); default on, as quanta serve")
    kv = p.add_argument_group("KV block pool (as quanta serve; default: a pool that never runs short)")
    kv.add_argument("--max-model-len", type=positive_int, metavar="N",
                    help="tokens per sequence, prompt plus output; longer requests fail as the server's 400 "
                         "(default: the pool's size)")
    add_kv_cache_flags(kv, "no cap; --kv-cache-memory needs the profile's KV geometry")


def _replica_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (several simulated servers behind one router, as quanta.cluster routes)")
    g.add_argument("--replicas", metavar="N[,N...]",
                   help="simulate N servers behind a router; a comma list runs each count as a condition (default: one "
                        "server, no router)")
    g.add_argument("--routing", default="prefix", metavar="POLICY[,POLICY...]",
                   help="with --replicas: prefix, least-loaded or round-robin; a comma list runs each (default prefix)")
    g.add_argument("--max-waiting", type=int, default=4,
                   help="with --replicas and prefix routing: past this many waiting requests on the preferred replica, "
                        "route to the least-loaded one (default 4)")
    g.add_argument("--load-tokens", type=int, default=None,
                   help="with --replicas and prefix routing: the prompt tokens one request in flight on a replica is worth "
                        "against computing a prompt's uncached part (quanta serve --routing-load-tokens; default: the mean length of "
                        "the prompts routed so far)")


def add_commands(sub, register_once) -> None:
    """Register ``simulate`` and ``profile-engine`` on the root CLI's subparsers."""
    sim = sub.add_parser("simulate", help="run a bench workload on the scheduler with a cost profile (virtual clock)")
    register_once(sim)
    sim.add_argument("--profile", required=True, help="cost profile JSON (profiles/*.json or quanta profile-engine --out)")
    add_scheduler_flags(sim, "quanta advise's choice for the profile's cost curve and MoE shape")
    sim.add_argument("--sweep", action="append", metavar="SPEC",
                     help="grid of scheduler flags with comma lists (as bench sweep --grid); repeatable")
    sim.add_argument("--baseline", help="sweep: condition name throughput is normalized to")
    sim.add_argument("--compare", action="append", metavar="BENCH_JSON",
                     help="simulate every measured condition of this quanta bench result (its flags, workload and "
                          "prompt lengths) and report simulated vs measured figures; repeatable")
    sim.add_argument("--draws", type=int, default=1, metavar="K",
                     help="--compare: simulated runs per measured repeat, each with its own step-noise draw; the "
                          "simulated figure is the median over all of them (default 1)")
    sim.add_argument("--also-profile", metavar="PROFILE",
                     help="--compare: a second profile (e.g. one measured another way) to report the same comparison with")
    sim.add_argument("--replay-front", action="store_true",
                     help="--compare: each request reaches the engine when the measured front handed it over (the "
                          "server trace's arrivals), not through the profile's front model: the error left is the engine model's")
    _workload_flags(sim)
    _replica_flags(sim)
    prof = sub.add_parser("profile-engine", help="measure the real engine's cost profile on this machine")
    register_once(prof)
    prof.add_argument("--out", required=True, help="profile JSON to write")
    prof.add_argument("--model", help="GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)")
    add_dtype_flag(prof, "compute dtype (default: as quanta serve)")
    prof.add_argument("--chunks", default="32,128,512", help="prefill chunk sizes, comma list (default 32,128,512)")
    prof.add_argument("--positions", default="0,512", help="context positions of the prefill chunks (default 0,512)")
    prof.add_argument("--batches", default="1,2,4,8", help="decode batch sizes (default 1,2,4,8)")
    prof.add_argument("--decode-contexts", default="64,512",
                      help="contexts of the decoding sequences, comma list: the batch sweep runs at the first, "
                           "the largest batch at the others gives the context cost (default 64,512)")
    prof.add_argument("--repeats", type=int, default=3, help="timed repeats per point (default 3)")
    prof.add_argument("--from-bench", action="append", metavar="BENCH_JSON",
                      help="fit the profile to the server-trace steps of this quanta bench result instead of timing "
                           "the executor in-process (no model is loaded); repeatable")
    prof.add_argument("--check-bench", action="append", metavar="BENCH_JSON",
                      help="with --from-bench: also report the fitted model's residuals on the server-trace steps of "
                           "this quanta bench result (runs not fitted); repeatable")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    if args.command == "profile-engine":
        return _profile_engine(args, parser)
    return _simulate(args, parser, argv)


def _ints(text: str, flag: str, parser) -> list[int]:
    """The sorted distinct integers of a comma list (``--positions`` may hold 0); else exit 2."""
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        parser.error(f"{flag} must be a comma list of positive integers, got {text!r}")
    if not xs or xs[0] < 0 or (flag != "--positions" and xs[0] < 1):
        parser.error(f"{flag} must be a comma list of positive integers, got {text!r}")
    return xs


def _profile_engine(args, parser) -> int:
    """``quanta profile-engine``: time the executor in-process (:mod:`quanta.sim.measure`) or fit ``--from-bench``."""
    writable_prefix(args.out, parser)
    if args.from_bench:
        return _from_bench(args, parser)
    if args.check_bench:
        parser.error("--check-bench needs --from-bench")
    from quanta.launch import load_model, resolve_dtype
    from quanta.sim.measure import measure

    chunks = _ints(args.chunks, "--chunks", parser)
    positions = _ints(args.positions, "--positions", parser)
    batches = _ints(args.batches, "--batches", parser)
    contexts = _ints(args.decode_contexts, "--decode-contexts", parser)
    if args.repeats < 1:
        parser.error("--repeats must be a positive integer")
    loaded = load_model(args.model, resolve_dtype(dtype_name(args.dtype)), getattr(args, "quantization", "auto"))
    prof = measure(loaded, chunks, positions, batches, contexts, args.repeats)
    prof.validate()
    prof.save(args.out)
    print(f"wrote {args.out}")
    return 0


def _from_bench(args, parser) -> int:
    """``profile-engine --from-bench``: fit a profile to the bench results' server traces (:mod:`quanta.sim.from_bench`)."""
    from quanta.sim.from_bench import from_bench

    return from_bench(args, parser)


def _sched_config(args, parser, profile):
    try:
        sched = scheduler_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.mixed_prefill_quantum == "auto":
        from quanta.sim.auto import resolve_auto

        sched, advice = resolve_auto(profile, sched)
        print(f"mixed_prefill_quantum=auto -> {advice.quantum}: {advice.reason}", file=sys.stderr)
    return sched


def _sweep_configs(args, parser, profile) -> list[tuple[str, list[str], object]]:
    from quanta.bench.sweep import GridError, expand

    try:
        conds = expand(args.sweep)
    except GridError as exc:
        parser.error(str(exc))
    out = []
    allowed = set(SCHEDULER_FLAGS)
    for c in conds:
        foreign = [f for f in c.flags if f.startswith("--") and f not in allowed]
        if foreign:
            parser.error(f"--sweep takes scheduler flags only (--scheduler, --max-num-seqs and the knobs), "
                         f"not {', '.join(foreign)}")
        sub = build_sub_parser()
        try:
            ns = sub.parse_args(["--profile", args.profile, *c.flags])
        except SystemExit:
            parser.error(f"--sweep condition {c.name}: flags {' '.join(c.flags)!r} are not simulate flags")
        out.append((c.name, c.flags, _sched_config(ns, parser, profile)))
    return out


def build_sub_parser() -> argparse.ArgumentParser:
    """A standalone ``simulate`` parser (to read the flags of a sweep condition)."""
    root = argparse.ArgumentParser(prog="quanta", exit_on_error=False)
    sub = root.add_subparsers(dest="command")
    add_commands(sub, register_once)
    return sub.choices["simulate"]


def _simulate(args, parser, argv) -> int:
    from quanta.bench import output
    from quanta.bench.cli import workload_from_args
    from quanta.bench.workloads import Workload
    from quanta.sim.profile import Profile, ProfileError
    from quanta.sim.run import condition, simulate

    try:
        profile = Profile.load(args.profile)
    except ProfileError as exc:
        parser.error(f"--profile: {exc}")
    if args.compare:
        return _compare(args, parser, argv, profile)
    for flag, given in (("--also-profile", args.also_profile), ("--draws", args.draws != 1), ("--replay-front", args.replay_front)):
        if given:
            parser.error(f"{flag} needs --compare")
    w = workload_from_args(args, parser)
    if w.output_dist == "eos":
        parser.error("--output-dist eos: simulated tokens never end at EOS; give the measured lengths "
                     "as --output-dist file:PATH instead")
    if args.sweep:
        grid = _sweep_configs(args, parser, profile)
    else:
        sched = _sched_config(args, parser, profile)
        grid = [(sched.name, None, sched)]
    names = [name for name, _, _ in grid]
    if args.baseline and args.baseline not in names:
        parser.error(f"--baseline {args.baseline!r} is not a condition of the grid ({', '.join(names)})")
    if args.out:
        writable_prefix(args.out, parser)
    settings = _replica_settings(args, parser, w)
    conds, autos = [], []
    for name, flags, sched in grid:
        if "auto" in (flags or []) or args.mixed_prefill_quantum == "auto":
            autos.append(f"{name}: mixed_prefill_quantum=auto ran as {sched.knobs['mixed_prefill_quantum']}")
        pool = _pool(args, parser, profile, sched.max_num_seqs)
        for replicas, routing in settings:
            runs = []
            for r in range(args.repeats):
                wr = Workload(**{**w.to_dict(), "seed": w.seed + r})
                kw = dict(tokens_per_word=args.tokens_per_word, max_duration=args.max_duration, pool=pool)
                if replicas is None:
                    runs.append(simulate(profile, sched, wr, **kw))
                else:
                    from quanta.sim.replicas import simulate_replicas

                    runs.append(simulate_replicas(profile, sched, wr, replicas=replicas, routing=routing,
                                                  max_waiting=args.max_waiting, load_tokens=args.load_tokens, **kw))
            label = name if replicas is None else f"{name}, {replicas} x {routing}"
            conds.append(condition(label, runs, flags))
    baseline = args.baseline or (conds[0]["name"] if args.sweep else None)
    note = f"simulated with cost profile {args.profile} ({profile.meta.get('name', '')}): {profile.meta.get('source', '')}"
    note += "".join(f" {a}." for a in autos)
    note = f"{args.note} {note}" if args.note else note
    doc = output.document("simulate", command_line(argv), w, args.repeats,
                          conds, baseline, note)
    doc["profile"] = {"path": args.profile, "name": profile.meta.get("name"), "machine": profile.meta.get("machine"),
                      "model": profile.meta.get("model"), "source": profile.meta.get("source")}
    doc["prefix_cache"] = args.prefix_cache
    if args.replicas:
        doc["replicas"] = {"counts": sorted({n for n, _ in settings}), "routing": sorted({r for _, r in settings}),
                           "max_waiting": args.max_waiting, "load_tokens": args.load_tokens}
    print(output.headline(doc))
    table = None
    if args.replicas:
        from quanta.sim.replicas import replica_table

        table = replica_table(conds)
        print("\n" + table)
    if args.out:
        for path in output.write_outputs(doc, Path(args.out), args.title or "quanta simulate", args.plots):
            print(f"wrote {path}", file=sys.stderr)
        if table:
            md = Path(args.out).with_name(Path(args.out).name + ".md")
            md.write_text(md.read_text(encoding="utf-8") + "\n## Replicas\n\n" + table + "\n", encoding="utf-8")
        if not args.raw:
            output.write_json(_without_raw(doc), Path(args.out).with_name(Path(args.out).name + ".json"))
    return 0


def _pool(args, parser, profile, max_num_seqs: int):
    """The simulated KV pool of the budget flags (:func:`quanta.sim.pool.pool_from_flags`); else exit 2."""
    from quanta.sim.pool import pool_from_flags
    from quanta.sim.profile import ProfileError

    if args.block_size < 8 or args.block_size % 8:
        parser.error(f"--block-size must be a positive multiple of 8, got {args.block_size}")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        parser.error(f"--kv-cache-tokens must be a positive integer, got {args.kv_cache_tokens}")
    try:
        pool = pool_from_flags(profile, max_num_seqs, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                               kv_cache_tokens=args.kv_cache_tokens, kv_cache_dtype=KV_DTYPE_ALIASES[args.kv_cache_dtype],
                               max_model_len=args.max_model_len, prefix_cache=args.prefix_cache)
    except (ValueError, ProfileError) as exc:
        parser.error(str(exc))
    if args.max_model_len and pool.num_blocks is not None:  # quanta advise's check of the budget
        from quanta.moe.advisor import advise_pool, format_pool_advice

        advice = advise_pool(max_num_seqs, args.max_model_len, pool.block_size, pool.num_blocks * pool.block_size)
        if not advice.fits:
            print(format_pool_advice(advice, max_num_seqs), file=sys.stderr)
    return pool


def _replica_settings(args, parser, w) -> list[tuple[int | None, str | None]]:
    """The (replicas, routing) pairs to simulate: ``[(None, None)]`` (one server, no router) without
    ``--replicas``; else every count with every policy. Bad lists exit 2."""
    if args.replicas is None:
        if args.routing != "prefix" or args.max_waiting != 4 or args.load_tokens is not None:
            parser.error("--routing, --max-waiting and --load-tokens need --replicas")
        return [(None, None)]
    from quanta.cluster.routing import POLICIES
    from quanta.sim.replicas import UNSUPPORTED

    counts = _ints(args.replicas, "--replicas", parser)
    policies = [x.strip() for x in args.routing.split(",") if x.strip()]
    bad = [x for x in policies if x not in POLICIES]
    if bad or not policies:
        parser.error(f"--routing must be a comma list of {', '.join(POLICIES)}, got {args.routing!r}")
    if args.max_waiting < 0:
        parser.error(f"--max-waiting must be a non-negative integer, got {args.max_waiting}")
    if args.load_tokens is not None and args.load_tokens < 0:
        parser.error(f"--load-tokens must be a non-negative integer, got {args.load_tokens}")
    if w.kind in UNSUPPORTED:
        parser.error(f"--replicas: the {w.kind} workload watches one engine; it does not run on replicas")
    return [(n, r) for r in dict.fromkeys(policies) for n in counts]


def _without_raw(doc: dict) -> dict:
    """``doc`` with every run's step trace and every sample's token chunks dropped (``raw: false``)."""
    runs = [{**r, "trace": None, "samples": [{**s, "chunks": []} for s in r["samples"]]}
            for c in doc["conditions"] for r in c["runs"]]
    it = iter(runs)
    conds = [{**c, "runs": [next(it) for _ in c["runs"]]} for c in doc["conditions"]]
    return {**doc, "conditions": conds, "raw": False}


def _ignored_by_compare(argv: list[str]) -> list[str]:
    """Flags on the command line that ``--compare`` would ignore (each condition brings its own)."""
    used = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    keep = {"--help", "--profile", "--compare", "--also-profile", "--draws", "--replay-front", "--out", "--title",
            "--max-duration", "--no-plots"}
    return sorted(used - keep)


def _compare(args, parser, argv, profile) -> int:
    import json

    from quanta.sim import compare, compare_report
    from quanta.sim.profile import Profile, ProfileError

    if args.sweep:
        parser.error("--compare replays the measured conditions; it does not take --sweep")
    ignored = _ignored_by_compare(argv if argv is not None else sys.argv[1:])
    if ignored:
        parser.error(f"--compare takes each condition's scheduler and workload from the bench result; "
                     f"drop {', '.join(ignored)}")
    if len(set(args.compare)) != len(args.compare):
        parser.error("--compare: the same file is given twice")
    if not 1 <= args.draws <= 100:
        parser.error(f"--draws must be 1-100, got {args.draws}")
    out = writable_prefix(args.out, parser) if args.out else None
    docs = []
    for path in args.compare:
        try:
            docs.append((path, json.loads(Path(path).read_text(encoding="utf-8"))))
        except (OSError, ValueError) as exc:
            parser.error(f"--compare: cannot read {path}: {exc}")
    profiles = {args.profile: profile}
    try:
        rows = compare.compare(profile, docs, args.max_duration, args.draws, args.replay_front)
        also = None
        if args.also_profile:
            profiles[args.also_profile] = Profile.load(args.also_profile)
            also = (args.also_profile, compare.compare(profiles[args.also_profile], docs, args.max_duration, args.draws,
                                                       args.replay_front))
    except ProfileError as exc:
        parser.error(f"--also-profile: {exc}")
    except compare.CompareError as exc:
        parser.error(f"--compare: {exc}")
    command = command_line(argv)
    doc = compare.document(args.profile, rows, command, also, args.replay_front)
    print(compare_report.markdown_table(rows))
    print(compare_report.summary_lines(doc["summary"]))
    if also:
        print(f"\nWith {args.also_profile}:\n" + compare_report.markdown_table(also[1]))
        print(compare_report.summary_lines(doc["also_summary"]))
    if out:
        from quanta.bench.output import write_json

        md = out.with_name(out.name + ".md")
        try:
            write_json(doc, out.with_name(out.name + ".json"))
            md.write_text(compare_report.markdown(doc, profiles, args.title or "quanta simulate vs measured"), encoding="utf-8")
        except OSError as exc:
            parser.error(f"--out: cannot write {exc.filename}: {exc.strerror or exc}")
        print(f"wrote {out.with_name(out.name + '.json')}, {md}", file=sys.stderr)
    return 0
