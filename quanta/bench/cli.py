"""``quanta bench run|sweep|report|trace``.

Bad input (a non-positive size, an unknown workload, a malformed grid, a
flag given twice) is a one-line message and exit code 2, before any request
is sent or server started. A server that cannot be measured at all is a
message and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quanta.bench import external
from quanta.bench.workloads import KINDS, Workload
from quanta.engine.policies import KNOBS
from quanta.flags import (
    base_url,
    command_line,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    register_once,
)


def add_workload_group(p: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The workload flags shared by ``quanta bench`` and ``quanta simulate``; returns the group."""
    g = p.add_argument_group(title)
    g.add_argument("--workload", choices=KINDS, default="burst", help="arrival pattern (default burst)")
    g.add_argument("--num-requests", type=positive_int, default=64, help="requests of burst/poisson/gamma/concurrency (default 64)")
    g.add_argument("--prompt-words", type=positive_int, default=32, help="prompt size (default 32)")
    g.add_argument("--max-tokens", type=positive_int, default=64, help="output tokens per request (default 64)")
    g.add_argument("--rate", type=positive_float, default=4.0, help="poisson/gamma: requests per second (default 4)")
    g.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma: shape; 1 = poisson, <1 burstier (default 1)")
    g.add_argument("--concurrency", type=positive_int, default=8, help="concurrency: requests in flight (default 8)")
    g.add_argument("--sessions", type=positive_int, default=4, help="probe/replay: sessions (default 4)")
    g.add_argument("--session-tokens", type=positive_int, default=256, help="probe: max tokens of each decoding session (default 256)")
    g.add_argument("--probe-words", type=positive_int, default=1024, help="probe: cold prompt size (default 1024)")
    g.add_argument("--probe-delay", type=nonneg_float, default=1.0, help="probe: wait before and after the probe (default 1)")
    g.add_argument("--turns", type=positive_int, default=3, help="replay: turns per session (default 3)")
    g.add_argument("--tool-words", type=positive_int, default=128, help="replay: tool output appended per turn (default 128)")
    g.add_argument("--stagger", type=nonneg_float, default=15.0, help="replay: start offset between sessions (default 15)")
    g.add_argument("--sessions-file", metavar="FILE",
                   help="sessions: agent sessions recorded by quanta record (JSONL), replayed identically")
    g.add_argument("--seed", type=int, default=0, help="prompt/arrival/length RNG seed (simulate: repeat r uses seed + r) (default 0)")
    g.add_argument("--prompt-dist", default="fixed", metavar="DIST",
                   help="prompt sizes around --prompt-words: fixed, uniform:R (as vllm --random-range-ratio), "
                        "lognormal:SIGMA, file:PATH (default fixed)")
    g.add_argument("--output-dist", default="fixed", metavar="DIST",
                   help="output lengths around --max-tokens: fixed, uniform:R, lognormal:SIGMA, file:PATH, "
                        "eos (natural EOS length, --max-tokens caps it) (default fixed)")
    t = p.add_argument_group("trace workload (--workload trace: a Mooncake JSONL request trace)")
    t.add_argument("--trace", metavar="FILE", help="trace file: timestamp (ms), input_length, output_length, hash_ids per line")
    t.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="multiply the trace's arrival gaps (2: half the rate) (default 1)")
    t.add_argument("--length-scale", type=positive_float, default=1.0,
                   help="multiply prompt, output and 512-token block lengths (0.05: 7k-token prompts become 350) (default 1)")
    t.add_argument("--start", dest="trace_start", type=nonneg_int, default=0, help="first trace line replayed, 0-based (default 0)")
    t.add_argument("--limit", dest="trace_limit", type=positive_int, help="requests replayed (default: to the end of the trace)")
    return g


def _workload_flags(p: argparse.ArgumentParser) -> None:
    add_workload_group(p, "workload (sizes in words ~ tokens; times in seconds)")
    m = p.add_argument_group("measurement")
    m.add_argument("--repeats", type=positive_int, default=3, help="runs per condition; figures are median (IQR) (default 3)")
    m.add_argument("--warmup", type=nonneg_int, default=2, help="unmeasured requests before the repeats (default 2)")
    m.add_argument("--scrape", type=positive_float, help="scrape /metrics every S seconds (seed 000 used 15)")
    m.add_argument("--max-duration", type=positive_float, default=600.0,
                   help="bound of one run; later requests fail as deadline (default 600)")
    m.add_argument("--request-timeout", type=positive_float, default=300.0, help="bound of one request (default 300)")
    m.add_argument("--endpoint", choices=("completions", "chat"), default="completions", help="OpenAI endpoint (default completions)")
    m.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="do not send ignore_eos (outputs may end early)")
    m.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    m.add_argument("--out", help="output prefix: PREFIX.json (raw samples), PREFIX.md, PREFIX-*.png")
    m.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    m.add_argument("--title", help="report title")
    m.add_argument("--note", default="", help="a sentence for the report (e.g. how the run was scaled)")


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """Register ``bench`` and its subcommands on the root CLI's subparsers."""
    bench = sub.add_parser("bench", help="measure an OpenAI-compatible server; sweep quanta's flags")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    run = bsub.add_parser("run", help="load-test one running server (quanta, llama-server, vLLM, ...)")
    register_once(run)
    run.add_argument("--base-url", type=base_url, required=True, help="server root, e.g. http://127.0.0.1:8000")
    run.add_argument("--model", help="model id (default: the first of GET /v1/models)")
    run.add_argument("--name", help="condition name in the report (default: the base URL)")
    _workload_flags(run)
    sw = bsub.add_parser("sweep", help="start a fresh quanta server per grid condition and measure each")
    register_once(sw)
    sw.add_argument("--grid", action="append", metavar="SPEC",
                    help="serve flags with comma lists, e.g. '--scheduler continuous --admit-k 1,2,4'; repeat for a union of grids")
    sw.add_argument("--scheduler", dest="grid_scheduler", metavar="LIST", help="comma list of schedulers (instead of --grid)")
    sw.add_argument("--max-num-seqs", dest="grid_max_num_seqs", metavar="LIST", help="comma list (instead of --grid)")
    for knob in KNOBS.values():
        sw.add_argument(knob.flag, dest="grid_" + knob.name, metavar="LIST", help="comma list (instead of --grid)")
    sw.add_argument("--server-flags", default="", metavar="FLAGS", help="serve flags shared by every condition, e.g. '--max-num-seqs 16'")
    sw.add_argument("--baseline", help="condition name that throughput is normalized to (default: the first)")
    sw.add_argument("--dry-run", action="store_true", help="list the conditions and exit")
    external.add_flags(sw)
    sw.add_argument("--interleave", action="store_true", help="keep every condition's server up and measure in rounds "
                    "(round r runs every condition once), so machine drift spreads over all conditions; "
                    "throughput ratios are then paired per round")
    sw.add_argument("--ray", action="store_true", help="run the conditions in parallel as Ray tasks, one server per task, "
                    "each pinned to its own cores (a local Ray unless --ray-address)")
    sw.add_argument("--ray-address", metavar="ADDR", help="with --ray: an existing Ray cluster (e.g. ray://HEAD:10001 or auto)")
    sw.add_argument("--ray-cores", type=positive_int, default=1, help="with --ray: logical CPUs per condition (default 1)")
    _workload_flags(sw)
    rep = bsub.add_parser("report", help="recompute figures and write the report from result JSON files")
    register_once(rep)
    rep.add_argument("results", nargs="+", help="PREFIX.json files of bench run/sweep (conditions are merged)")
    rep.add_argument("--out", help="output prefix: write PREFIX.json, .md and the plots (default: print the report)")
    rep.add_argument("--baseline", help="condition name for throughput ratios")
    rep.add_argument("--title", help="report title")
    rep.add_argument("--no-plots", dest="plots", action="store_false")
    tr = bsub.add_parser("trace", help="server-side figures of a quanta trace (JSONL file or server URL)")
    tr.add_argument("source", help="trace file (JSONL, or JSON {records: [...]}) or http://HOST:PORT of a quanta server")
    tr.add_argument("--since", type=nonneg_int, default=0, help="first step (URL source only)")
    tr.add_argument("--json", action="store_true", help="print the figures as JSON (times in seconds) instead of tables")
    for p in (run, sw, rep, tr):
        p.set_defaults(bench_parser=p)
    return bench


def workload_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Workload:
    """The workload of the shared workload flags, checked (:meth:`Workload.check`): exit 2 on bad input."""
    names = Workload.__dataclass_fields__
    kw = {k: getattr(args, k) for k in names if k not in ("kind",) and hasattr(args, k)}
    w = Workload(kind=args.workload, **kw)
    try:
        w.check()
    except ValueError as exc:
        parser.error(str(exc))
    return w


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Dispatch ``quanta bench ...``; returns the exit code (2 for bad input via ``parser.error``)."""
    cmd = args.bench_command
    parser = getattr(args, "bench_parser", parser)
    if cmd == "trace":
        return _trace(args, parser)
    if cmd == "report":
        return _report(args, parser)
    if cmd == "sweep":
        return _sweep(args, parser, argv)
    return _run(args, parser, argv)


def _finish(doc: dict, args, title: str) -> None:
    from quanta.bench import output

    print(output.headline(doc))
    if getattr(args, "out", None):
        for path in output.write_outputs(doc, Path(args.out), title, args.plots):
            _say(f"wrote {path}")


def _run(args, parser, argv) -> int:
    from quanta.analysis.report import aggregate, repeat_figures
    from quanta.bench import output
    from quanta.bench.client import Target
    from quanta.bench.runner import ServerError, ServerProbe, discover_model, measure

    w = workload_from_args(args, parser)
    try:
        model = args.model or discover_model(args.base_url)
    except ServerError as exc:
        _say(f"quanta bench: error: {exc}")
        return 1
    target = Target(args.base_url, model, args.endpoint, args.ignore_eos)
    name = args.name or args.base_url
    if args.warmup:
        measure(target, Workload(kind="burst", num_requests=args.warmup, prompt_words=w.prompt_words, max_tokens=8),
                max_duration=args.max_duration, request_timeout=args.request_timeout, progress=False)
    sp = ServerProbe(args.base_url)
    applied = sp.config()  # quanta's /v1/config (None elsewhere): what the server ran, for reports and simulate --compare
    sp.close()
    cond = {"name": name, "flags": None, "applied": applied, "valid": True, "runs": [], "figures": []}
    for r in range(args.repeats):
        run = measure(target, w, max_duration=args.max_duration, request_timeout=args.request_timeout,
                      scrape_every=args.scrape, progress=args.progress, desc=f"{name} [{r + 1}/{args.repeats}]")
        cond["runs"].append(run)
        cond["figures"].append(repeat_figures(run["metrics"]))
        c = run["metrics"]["client"]
        _say(f"repeat {r + 1}/{args.repeats}: {c['num_ok']} ok, {c['num_failed']} failed {c['errors'] or ''}".rstrip())
    cond["summary"] = aggregate(cond["figures"])
    doc = output.document("run", command_line(argv), w, args.repeats, [cond], None, args.note)
    _finish(doc, args, args.title or f"quanta bench run: {name}")
    if all(r["metrics"]["client"]["num_ok"] == 0 for r in cond["runs"]):
        first = next((s for r in cond["runs"] for s in r["samples"] if s["error"]), None)
        from quanta.bench.runner import key_hint

        hint = f"; {key_hint(first['error'])}" if first and key_hint(first["error"]) else ""
        _say(f"quanta bench: error: every request failed ({first['error']}: {first['error_detail']}){hint}" if first else
             "quanta bench: error: no request was sent")
        return 1
    return 0


def _sweep(args, parser, argv) -> int:
    from quanta.bench import output
    from quanta.bench.sweep import GridError, Settings, expand, run_sweep, sigterm_unwinds, specs_from_args, validate

    try:
        specs = specs_from_args(args)
    except GridError as exc:
        parser.error(str(exc))
    if not specs:
        parser.error("bench sweep needs --grid SPEC (repeatable) or knob lists such as --scheduler continuous --admit-k 1,2,4")
    try:
        conds = expand(specs, args.server_flags)
        server = external.from_args(args, conds)
        for c in conds if server is None else ():
            validate(c)
    except (GridError, external.TemplateError) as exc:
        parser.error(str(exc))
    names = [c.name for c in conds]
    if args.baseline and args.baseline not in names:
        parser.error(f"--baseline {args.baseline!r} is not a condition of the grid ({', '.join(names)})")
    if not args.out and not args.dry_run:
        parser.error("bench sweep needs --out PREFIX for its results")
    for c in conds:
        _say(f"{c.name}: " + (external.listing(server, c) if server else f"quanta serve {' '.join(c.flags)}")
             + (f"  [invalid: {c.invalid_reason}]" if c.invalid_reason else ""))
    if server:
        _say(server.describe())
    _check_ray_flags(args, parser, server)
    if args.dry_run:
        return 0
    w = workload_from_args(args, parser)
    st = Settings(args.repeats, args.warmup, args.scrape, args.max_duration, args.request_timeout, args.progress,
                  args.endpoint, args.ignore_eos, server)
    with sigterm_unwinds():  # every started server is stopped; the caller's handler is back afterwards
        if args.ray:
            from quanta.bench.ray_sweep import RayStartError, run_sweep_ray

            try:
                results = run_sweep_ray(conds, w, st, cores=args.ray_cores, address=args.ray_address, say=_say)
            except RayStartError as exc:
                _say(f"quanta bench: error: {exc}")
                return 1
        else:
            results = run_sweep(conds, w, st, interleave=args.interleave, say=_say)
    ray_note = (f"conditions ran in parallel as Ray tasks, each pinned to {args.ray_cores} logical CPU(s)"
                if args.ray else "")
    note = "; ".join(x for x in (args.note, server.describe() if server else "", ray_note) if x)
    doc = output.document("sweep", command_line(argv), w, args.repeats, results, args.baseline or names[0], note)
    doc["interleaved"] = args.interleave
    _finish(doc, args, args.title or "quanta bench sweep")
    return 0 if any(r["valid"] for r in results) else 1


def _check_ray_flags(args, parser, server) -> None:
    """``--ray-address`` and ``--ray-cores`` need ``--ray``; ``--ray`` runs quanta servers, not interleaved."""
    if not args.ray:
        if args.ray_address or args.ray_cores != 1:
            parser.error("--ray-address and --ray-cores need --ray")
        return
    if args.interleave:
        parser.error("--ray runs the conditions in parallel; it does not take --interleave")
    if server is not None:
        parser.error("--ray starts quanta serve per condition; it does not take --server-cmd")


def _report(args, parser) -> int:
    from quanta.bench import output

    docs = []
    for path in args.results:
        try:
            docs.append((Path(path), json.loads(Path(path).read_text(encoding="utf-8"))))
        except (OSError, ValueError) as exc:
            parser.error(f"cannot read {path}: {exc}")
    if any("conditions" not in d for _, d in docs):
        parser.error("not a bench result file (no 'conditions'); pass PREFIX.json of bench run/sweep")
    doc = docs[0][1]
    if len(docs) > 1:
        seen = set()
        doc["conditions"] = []
        for path, d in docs:
            for c in d["conditions"]:
                if c["name"] in seen:
                    c["name"] = f"{path.stem}: {c['name']}"
                seen.add(c["name"])
                doc["conditions"].append(c)
        doc["command"] = " + ".join(d["command"] for _, d in docs)
    if args.baseline:
        if args.baseline not in [c["name"] for c in doc["conditions"]]:
            parser.error(f"--baseline {args.baseline!r} is not a condition of these results")
        doc["baseline"] = args.baseline
    output.recompute(doc)
    if not args.out:  # the report to the terminal; files only where asked for
        print(output.markdown(doc, {}, args.title or "quanta bench report"))
        return 0
    _finish(doc, args, args.title or "quanta bench report")
    return 0


def _trace(args, parser) -> int:
    from quanta.analysis.report import trace_text
    from quanta.analysis.server_trace import load_trace_file, trace_metrics
    from quanta.bench.runner import ServerProbe

    if args.source.startswith(("http://", "https://")):
        sp = ServerProbe(base_url(args.source))
        records = sp.trace(args.since)
        sp.close()
        if records is None:
            _say(f"quanta bench: error: {args.source} has no quanta /v1/trace endpoint (or is unreachable)")
            return 1
    else:
        try:
            records = load_trace_file(args.source)
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"cannot read trace {args.source}: {exc}")
    if not records:
        _say("quanta bench: error: the trace has no step records")
        return 1
    figures = trace_metrics(records)
    print(json.dumps(figures, indent=2, default=lambda x: None) if args.json else trace_text(figures))
    return 0
