"""``quanta profile-engine --from-bench``: fit a profile to ``quanta bench`` results' server traces.

The fit itself is :mod:`quanta.sim.fit`; this module reads the bench
results, names the profile's sources, prints the fit's residuals per step
kind and, with ``--check-bench``, the residuals on runs the fit did not see.
The thread counts the server reported in its ``/v1/config`` (every ``*_threads``
key: ``decode_threads``, ``prefill_threads``) are kept with the step model.
The server front's latency (:mod:`quanta.sim.front`) is fitted from the same
runs where they recorded it (a client clock origin and the trace's arrivals).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from quanta.sim.fit import MIN_WAKE_STEPS, WAKE_IDLE_S, FitError, check, fit
from quanta.sim.front import fit_front, front_check
from quanta.sim.profile import ProfileError


def bench_traces(path: str) -> tuple[list[list[dict]], dict, dict, list[dict]]:
    """The server traces of every measured run of a bench result (behind a cluster front, each replica's
    own trace), its first applied config and machine, and the runs.

    Raises:
        ValueError: not a readable, measured quanta bench result.
    """
    from quanta.sim.compare import CompareError, check_measured

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        check_measured(path, doc)
        conds = [c for c in doc["conditions"] if c.get("valid", True)]
        runs = [r for c in conds for r in c.get("runs") or []]
        traces = [t for r in runs for t in [r.get("trace"), *(r.get("replica_traces") or [])] if t]
        applied = next((c.get("applied") for c in conds if c.get("applied")), None) or {}
    except CompareError as exc:
        raise ValueError(str(exc)) from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a readable quanta bench result ({type(exc).__name__}: {exc})") from exc
    return traces, applied, doc.get("machine", {}), runs


def _read(paths: list[str], flag: str, parser) -> tuple[list[list[dict]], dict, dict, list[dict]]:
    if len(set(paths)) != len(paths):
        parser.error(f"{flag}: the same file is given twice")
    traces, applied, machine, runs = [], {}, {}, []
    for path in paths:
        try:
            t, a, m, r = bench_traces(path)
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")
        traces += t
        runs += r
        applied, machine = applied or a, machine or m
    if not traces:
        parser.error(f"{flag}: the results hold no server trace (was the server quanta?)")
    return traces, applied, machine, runs


def _print_residuals(title: str, residuals: dict) -> None:
    print(title)
    for kind, r in residuals.items():
        print(f"  {kind:8s} {r['steps']:6d} steps: |predicted / measured - 1| median {r['median']:.1%}, p90 {r['p90']:.1%}")


def from_bench(args, parser) -> int:
    """Fit ``args.from_bench``'s traces, write ``args.out``; check on ``args.check_bench`` (exit 2 on bad input)."""
    checked = args.check_bench or []
    if overlap := set(checked) & set(args.from_bench):
        parser.error(f"--check-bench: {sorted(overlap)[0]} is also fitted (--from-bench); check on other runs")
    traces, applied, machine, runs = _read(args.from_bench, "--from-bench", parser)
    others, _, _, other_runs = _read(checked, "--check-bench", parser) if checked else ([], {}, {}, [])
    meta = {"name": Path(args.out).stem,
            "source": ("fitted by quanta profile-engine --from-bench to the server-trace steps (/v1/trace) of "
                       + ", ".join(args.from_bench) + " (quanta.sim.fit: step model by non-negative least squares, residual quantiles)"),
            "machine": machine, "model": applied.get("model", "unknown"), "dtype": applied.get("dtype", "unknown")}
    try:
        prof = fit(traces, meta, threads={k: v for k, v in applied.items() if k.endswith("_threads")})
        prof.validate()
        if others:
            prof.step_model.fit["check"] = {"sources": list(checked), "residuals": check(prof.step_model, others)}
        prof.front = fit_front(runs)
        if prof.front is not None and other_runs:
            prof.front.fit["check"] = front_check(prof.front, other_runs)
    except (FitError, ProfileError) as exc:
        parser.error(f"--from-bench: {exc}")
    except (KeyError, TypeError, AttributeError) as exc:
        parser.error(f"--from-bench: malformed trace record ({type(exc).__name__}: {exc})")
    prof.save(args.out)
    f = prof.meta["fit"]
    print(f"fitted {f['steps']} steps ({f['decode_steps']} decode, {f['prefill_steps']} prefill, {f['mixed_steps']} fused) "
          f"of {len(traces)} runs; wrote {args.out}")
    _print_residuals("residuals on the fitted steps:", prof.step_model.fit["residuals"])
    if others:
        _print_residuals(f"residuals on the {len(others)} runs of --check-bench (not fitted):", prof.step_model.fit["check"]["residuals"])
    print(_noise_line(prof))
    print(_wake_line(prof.wake))
    print(_front_line(prof.front))
    return 0


def _noise_line(prof) -> str:
    """The fitted step noise's p50 / p90 / p99 (measured / predicted step time): steady decode steps, the others."""
    def q(fs: list[float]) -> str:
        return "/".join(f"{fs[i]:.2f}" for i in (50, 90, 99))

    parts = ([f"steady decode steps {q(prof.steady_noise)}"] if prof.steady_noise else []) + [
        f"{'others' if prof.steady_noise else 'steps'} up to {'any' if math.isinf(b) else f'{b:g} s'} {q(fs)}"
        for b, fs in prof.step_noise_bins or []]
    return "step noise (measured / predicted time, p50/p90/p99): " + "; ".join(parts)


def _wake_line(wake) -> str:
    if wake is None:
        return (f"wake: none (fewer than {MIN_WAKE_STEPS} steps after {WAKE_IDLE_S:g} s or more of idle engine, "
                "or fewer others)")
    return (f"wake: a step after {wake.idle_s:g} s or more of idle engine (or a run's first) takes "
            f"{wake.factor:.2f}x its prediction ({wake.steps} steps)")


def _front_line(front) -> str:
    if front is None:
        return "front: not fitted (no run recorded a client clock origin and the trace's arrivals on one host)"
    f = front.fit
    line = (f"front: {front.request_s * 1e3:.2f} ms + {front.prompt_token_s * 1e6:.2f} us per prompt token "
            f"+ {front.loop_s * 1e3:.2f} ms per request ahead in its burst to the engine, "
            f"{front.response_s * 1e3:.2f} ms back a token ({f['requests']} requests, {f['chunks']} chunks; "
            f"|error| median {f['residual_median_s'] * 1e3:.2f} ms, p90 {f['residual_p90_s'] * 1e3:.2f} ms")
    if f.get("check", {}).get("requests"):
        line += f"; on --check-bench median {f['check']['residual_median_s'] * 1e3:.2f} ms, p90 {f['check']['residual_p90_s'] * 1e3:.2f} ms"
    return line + ")"
