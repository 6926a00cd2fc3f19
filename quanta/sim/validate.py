"""Simulated vs measured on this machine: ``python -m quanta.sim.validate --out PREFIX``.

1. Measure a cost profile of the real engine (:func:`quanta.sim.measure.measure`).
2. For each condition (a scaled seed 002 grid: static, continuous K, chunked C; and a probe),
   run the same workload twice through the same :class:`~quanta.sim.run.Simulation` loop:
   once with the real :class:`ModelExecutor` on the wall clock, once with the cost model on
   the virtual clock. Same scheduler classes, same request stream, same analysis.
3. Report p50/p99 ITL (server trace), throughput and prefill rate, with relative errors.

The real side is in-process (no HTTP), so the comparison isolates the cost model; the
HTTP/client overhead of ``quanta bench`` is not in it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.sim.run import Simulation


class WallClock:
    """Seconds since construction on ``time.monotonic``; ``advance_to`` sleeps."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    @property
    def t(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        if t > self.t:
            time.sleep(t - self.t)


FIGS = [("itl_p50", "ITL p50 ms", 1e3), ("itl_p99", "ITL p99 ms", 1e3), ("throughput", "throughput tok/s", 1.0),
        ("prefill_rate", "prefill rate tok/s", 1.0)]


def figures(run: dict) -> dict:
    t, c = run["metrics"]["trace"], run["metrics"]["client"]
    return {"itl_p50": t["itl"]["p50"], "itl_p99": t["itl"]["p99"], "throughput": c["throughput"],
            "prefill_rate": t["prefill_rate"], "steps": t["steps"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quanta.sim.validate")
    ap.add_argument("--out", required=True)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    import torch

    from quanta.engine.executor import ModelExecutor
    from quanta.launch import load_model
    from quanta.sim.measure import measure

    loaded = load_model(None, torch.float32)
    profile = measure(loaded, [8, 16, 32, 64], [0, 64], [1, 2, 4], 40, a.repeats, say=lambda m: print(m, flush=True))
    Path(a.out + "_profile.json").parent.mkdir(parents=True, exist_ok=True)
    profile.save(a.out + "_profile.json")
    burst = Workload(kind="burst", num_requests=a.requests, prompt_words=a.prompt, max_tokens=a.max_tokens)
    probe = Workload(kind="probe", sessions=2, prompt_words=16, session_tokens=64, probe_words=96, max_tokens=2, probe_delay=0.5)
    conds = [("static", SchedulerConfig("static", a.slots), burst),
             ("continuous K=1", SchedulerConfig("continuous", a.slots, {"admit_k": 1}), burst),
             (f"continuous K={a.slots}", SchedulerConfig("continuous", a.slots, {"admit_k": a.slots}), burst),
             ("chunked C=16", SchedulerConfig("chunked", a.slots, {"chunk": 16, "admit_k": 1}), burst),
             ("probe batched mpq=32", SchedulerConfig("batched", 3, {"prefill_quantum": 64, "mixed_prefill_quantum": 32}), probe)]
    rows = []
    for name, cfg, w in conds:
        meas = []
        for _ in range(a.repeats):
            clock = WallClock()
            ex = ModelExecutor(loaded.model, cfg.max_num_seqs, 512)
            meas.append(figures(Simulation(profile, cfg, w, executor=ex, clock=clock, max_duration=600).run()))
        sim = figures(Simulation(profile, cfg, w).run())
        med = {k: statistics.median(m[k] for m in meas) for k, _, _ in FIGS}
        err = {k: (sim[k] - med[k]) / med[k] if med[k] else float("nan") for k, _, _ in FIGS}
        rows.append({"condition": name, "config": cfg.describe(), "workload": w.describe(), "measured": med,
                     "measured_repeats": meas, "simulated": sim, "rel_error": err})
        print(name, {k: f"{sim[k]:.4g} vs {med[k]:.4g} ({err[k]:+.0%})" for k, _, _ in FIGS}, flush=True)
    errs = sorted(abs(r["rel_error"][k]) for r in rows for k, _, _ in FIGS)
    doc = {"profile": profile.to_dict(), "rows": rows, "median_abs_rel_error": statistics.median(errs)}
    Path(a.out + ".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    lines = ["| condition | " + " | ".join(f"{h} sim / meas (err)" for _, h, _ in FIGS) + " |", "|---|" + "---|" * len(FIGS)]
    for r in rows:
        cells = [f"{r['simulated'][k] * s:.1f} / {r['measured'][k] * s:.1f} ({r['rel_error'][k]:+.0%})" for k, _, s in FIGS]
        lines.append(f"| {r['condition']} | " + " | ".join(cells) + " |")
    lines.append(f"\nMedian absolute relative error over all figures: {doc['median_abs_rel_error']:.0%}")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
