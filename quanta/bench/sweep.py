"""Sweeps: a grid of ``quanta serve`` flags, one fresh server per condition.

A grid spec is a string of serve flags in which a comma-separated value is a
list to sweep: ``--scheduler continuous --admit-k 1,2,4`` is three
conditions. Several specs are a union (``static`` plus a ``continuous`` grid
plus a ``chunked`` grid was seed 002's). For each condition the sweep starts
a fresh server, checks that the applied values (``/v1/config`` and the
startup line) equal the requested ones (else the condition is marked
invalid and not measured), runs the workload ``repeats`` times and stops the
server. Any other server (llama-server, vLLM, ...) is swept through a command
template instead (:mod:`quanta.bench.external`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import shlex
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from quanta.analysis.report import aggregate, repeat_figures
from quanta.bench import server as qserver
from quanta.bench.client import Target
from quanta.bench.runner import ServerError, ServerProbe, discover_model, measure
from quanta.bench.workloads import Workload

#: flags that are part of a condition's name when given in its grid spec.
_SHORT = {"--scheduler": None, "--admit-k": "K", "--chunk": "C", "--mixed-prefill-quantum": "mpq",
          "--prefill-quantum": "pq", "--prefill-cap": "cap", "--max-num-batched-tokens": "B", "--max-num-seqs": "slots"}


class GridError(ValueError):
    """A grid spec that cannot be parsed (bad syntax, repeated flag)."""


@dataclass
class Condition:
    """One point of the grid: its name and full serve flags."""

    name: str
    flags: list[str]
    invalid_reason: str | None = None
    extra: dict = field(default_factory=dict)


def _pairs(spec: str) -> list[tuple[str, str | None]]:
    """``"--admit-k 1,2 --no-prefix-cache"`` -> ``[("--admit-k", "1,2"), ("--no-prefix-cache", None)]``:
    a flag followed by another flag (or by nothing) is a switch, with value None."""
    try:
        toks = shlex.split(spec)
    except ValueError as exc:
        raise GridError(f"grid {spec!r}: {exc}") from exc
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(toks):
        flag = toks[i]
        if not flag.startswith("--"):
            raise GridError(f"grid {spec!r}: expected a --flag, got {flag!r}")
        value = toks[i + 1] if i + 1 < len(toks) and not toks[i + 1].startswith("--") else None
        pairs.append((flag, value))
        i += 1 if value is None else 2
    seen = set()
    for flag, value in pairs:
        if flag in seen:
            raise GridError(f"grid {spec!r}: {flag} was given more than once")
        if value is not None and (not value or any(not v for v in value.split(","))):
            raise GridError(f"grid {spec!r}: {flag} has an empty value")
        seen.add(flag)
    return pairs


def _flat(pairs: list[tuple[str, str | None]]) -> list[str]:
    return [x for f, v in pairs for x in ((f,) if v is None else (f, v))]


def condition_name(pairs: list[tuple[str, str | None]]) -> str:
    """``[("--scheduler", "continuous"), ("--admit-k", "4")]`` -> ``"continuous K=4"``; a switch reads as its name."""
    parts = []
    for flag, value in pairs:
        short = _SHORT.get(flag, flag[2:])
        parts.append(flag[2:] if value is None else value if short is None else f"{short}={value}")
    return " ".join(parts) or "default"


def expand(specs: list[str], common: str = "") -> list[Condition]:
    """Every condition of the union of ``specs``, each with ``common`` flags appended.

    Raises:
        GridError: bad syntax, a repeated flag within a spec or between a
            spec and ``common``, or two conditions with the same flags.
    """
    common_pairs = _pairs(common) if common.strip() else []
    if any(v is not None and "," in v for _, v in common_pairs):
        raise GridError(f"--server-flags {common!r}: lists belong in --grid")
    out: list[Condition] = []
    for spec in specs:
        pairs = _pairs(spec)
        clash = {f for f, _ in pairs} & {f for f, _ in common_pairs}
        if clash:
            raise GridError(f"{', '.join(sorted(clash))} is in both --grid {spec!r} and --server-flags")
        for values in itertools.product(*([None] if v is None else v.split(",") for _, v in pairs)):
            chosen = [(f, v) for (f, _), v in zip(pairs, values)]
            flags = _flat(chosen + common_pairs)
            out.append(Condition(condition_name(chosen), flags))
    names = [c.name for c in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GridError(f"the grid lists these conditions twice: {', '.join(dup)}")
    return out


def validate(cond: Condition) -> None:
    """Check the flags as ``quanta serve`` would, before any server starts.

    Raises:
        GridError: a flag ``quanta serve`` does not know or a malformed value.
    Sets ``cond.invalid_reason`` for a configuration quanta rejects (e.g.
    ``--admit-k`` above ``--max-num-seqs``).
    """
    from quanta.flags import configs_from_args, parse_serve_flags

    try:
        args = parse_serve_flags(cond.flags)
    except ValueError as exc:
        raise GridError(f"condition {cond.name!r}: {exc}") from exc
    messages: list[str] = []
    try:
        configs_from_args(args)
    except ValueError as exc:
        messages.append(str(exc))
    cond.invalid_reason = "; ".join(messages) or None


@dataclass
class Settings:
    """How each condition is measured (seconds; see ``bench sweep --help``)."""

    repeats: int = 3
    warmup: int = 2
    scrape_every: float | None = None
    max_duration: float = 600.0
    request_timeout: float = 300.0
    progress: bool = True
    endpoint: str = "completions"
    ignore_eos: bool = True
    server: object = None  # QuantaLauncher (default) or external.ExternalServer: start(cond, log_dir), verify(cond, srv)


class QuantaLauncher:
    """Fresh ``quanta serve`` per condition, verified by ``/v1/config`` and the startup line."""

    def start(self, cond: Condition, log_dir: Path) -> qserver.ServerProcess:
        return qserver.start(cond.flags, log_dir)

    def verify(self, cond: Condition, srv: qserver.ServerProcess) -> tuple[dict, str | None]:
        """``(result fields, reason)``: the applied config and startup line; the reason when they differ."""
        sp = ServerProbe(srv.base_url)
        applied, startup = sp.config(), srv.startup_values()
        sp.close()
        requested = qserver.requested_values(cond.flags)
        reason = (qserver.verify(requested, applied) if applied is not None else None) or qserver.verify(requested, startup)
        return {"applied": applied, "startup_line": startup}, reason


def _new_result(cond: Condition) -> dict:
    return {"name": cond.name, "flags": cond.flags, "valid": False, "invalid_reason": cond.invalid_reason,
            "applied": None, "startup_line": None, "runs": [], "figures": []}


def bring_up(cond: Condition, w: Workload, st: Settings, log_dir: Path, result: dict):
    """Start and verify ``cond``'s server and send the warmup; returns
    ``(server, target)``, or ``(None, None)`` with ``result["invalid_reason"]`` set."""
    if cond.invalid_reason:
        return None, None
    launcher = st.server or QuantaLauncher()
    try:
        srv = launcher.start(cond, log_dir)
    except RuntimeError as exc:
        result["invalid_reason"] = f"server did not start: {str(exc).splitlines()[0]}"
        return None, None
    try:
        fields, reason = launcher.verify(cond, srv)
        result.update(fields)
        if reason:
            result["invalid_reason"] = reason
            srv.stop()
            return None, None
        try:
            target = Target(srv.base_url, discover_model(srv.base_url), st.endpoint, st.ignore_eos)
        except ServerError as exc:
            result["invalid_reason"] = str(exc)
            srv.stop()
            return None, None
        if st.warmup:
            measure(target, Workload(kind="burst", num_requests=st.warmup, prompt_words=w.prompt_words, max_tokens=8),
                    max_duration=st.max_duration, request_timeout=st.request_timeout, progress=False)
    except BaseException:
        srv.stop()
        raise
    return srv, target


def one_repeat(result: dict, target: Target, w: Workload, st: Settings, r: int, say=print) -> None:
    """Measure repeat ``r`` of one condition and append its run and figures to ``result``."""
    run = measure(target, w, max_duration=st.max_duration, request_timeout=st.request_timeout,
                  scrape_every=st.scrape_every, progress=st.progress, desc=f"{result['name']} [{r + 1}/{st.repeats}]")
    run["round"] = r
    result["runs"].append(run)
    f = repeat_figures(run["metrics"])
    result["figures"].append(f)
    c = run["metrics"]["client"]
    say(f"  {result['name']} repeat {r + 1}/{st.repeats}: {c['num_ok']} ok, {c['num_failed']} failed, "
        f"{f['throughput']:.1f} tok/s, ITL p99 {f['itl_p99'] * 1e3:.1f} ms ({f['itl_source']})")


def run_sweep(conds: list[Condition], w: Workload, st: Settings, *, interleave: bool = False,
              log_dir: Path | None = None, say=print) -> list[dict]:
    """Measure every condition; returns their result dicts (in grid order).

    Sequential (default): one server at a time, all its repeats, stop.
    ``interleave``: every server is started first and kept up, then round
    ``r`` measures every condition once before round ``r + 1``, so a slow
    drift of the machine (other work) spreads over all conditions instead of
    biasing the ones measured last; more memory (one model per condition).
    """
    tmp = None
    if log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="quanta-sweep-")
        log_dir = Path(tmp.name)
    results = [_new_result(c) for c in conds]
    up: list[tuple[dict, object, Target]] = []
    try:
        for i, (cond, res) in enumerate(zip(conds, results)):
            say(f"[{i + 1}/{len(conds)}] {cond.name}: {' '.join(cond.flags)}")
            if not interleave:
                measure_condition(cond, res, w, st, log_dir, say)
                continue
            srv, target = bring_up(cond, w, st, log_dir, res)
            if srv is None:
                say(f"  invalid: {res['invalid_reason']}")
                continue
            up.append((res, srv, target))
        for r in range(st.repeats if interleave else 0):
            say(f"round {r + 1}/{st.repeats}")
            for res, _, target in up:
                one_repeat(res, target, w, st, r, say)
        for res, _, _ in up:
            res["valid"] = True
    finally:
        for _, srv, _ in up:
            srv.stop()
        if tmp:
            tmp.cleanup()
    return summarized(results)


def summarized(results: list[dict]) -> list[dict]:
    """``results`` with each valid condition's ``summary`` (median and IQR over its repeats) set."""
    for res in results:
        res["summary"] = aggregate(res["figures"]) if res["valid"] else None
    return results


def measure_condition(cond: Condition, res: dict, w: Workload, st: Settings, log_dir: Path, say=print) -> None:
    """Start ``cond``'s server, measure every repeat into ``res`` (its :func:`_new_result` dict), stop it."""
    srv, target = bring_up(cond, w, st, log_dir, res)
    if srv is None:
        say(f"  invalid: {res['invalid_reason']}")
        return
    try:
        for r in range(st.repeats):
            one_repeat(res, target, w, st, r, say)
    finally:
        srv.stop()
    res["valid"] = True


@contextlib.contextmanager
def sigterm_unwinds():
    """While active, SIGTERM raises ``SystemExit(143)`` so that every ``finally``
    runs and every started server is stopped; the previous handler is
    restored on exit (main thread only, as for any ``signal.signal``)."""
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def specs_from_args(args: argparse.Namespace) -> list[str]:
    """``--grid`` specs, or one spec built from the direct knob flags of ``bench sweep``.

    Raises:
        GridError: both forms were given (one would be silently ignored).
    """
    from quanta.flags import SCHEDULER_FLAGS

    parts = []
    for flag in SCHEDULER_FLAGS:
        value = getattr(args, "grid_" + flag[2:].replace("-", "_"), None)
        if value is not None:
            parts.append(f"{flag} {shlex.quote(value)}")
    if args.grid and parts:
        raise GridError(f"give either --grid or knob lists ({', '.join(p.split()[0] for p in parts)}), not both")
    if args.grid:
        return list(args.grid)
    return [" ".join(parts)] if parts else []
