"""What batch-invariant kernels cost: in-process prefill and decode of two checkouts, alternated.

Runs the embedded model (``--quantization auto``, the machine's default dtype unless
``--dtype``) in a fresh process per measurement, alternating this checkout and
``--baseline DIR`` (another checkout of quanta, e.g. ``git worktree add /tmp/base <commit>``),
so both see the same machine load. Figures: prefill tok/s of a 2,000- and a 6,000-token
prompt (nothing decoding; the default batched policy's 2,048-token chunks), decode tok/s of
1 and 8 concurrent streams (64 tokens each, after their prefill). Prints medians with the
min-max range over ``--rounds`` and the ratio of medians, and the machine's CPU flags.

Usage: ``python benchmarks/invariance_cost.py --baseline /tmp/base [--rounds 3] [--dtype fp32]``
(``QUANTA_NATIVE_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` in the
environment forces the AVX2 kernels on an AVX-512 machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

MEASURE = r"""
import json, sys, time
import quanta
import torch
from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.sampling import SamplingParams
from quanta.launch import build_engine, load_model, resolve_dtype

dtype = resolve_dtype(sys.argv[1] or None)
loaded = load_model(None, dtype, "auto")
vocab = loaded.config.vocab_size
prompt = lambda n, seed: [(seed * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(n)]
out = {"kernels": loaded.kernels}

def run(prompts, new):
    engine = build_engine(loaded, EngineConfig(max_model_len=8192), SchedulerConfig("batched", 8, {}))
    seqs = [engine.add_request(p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)) for p in prompts]
    t_prefill = t_decode = 0.0
    while engine.has_work():
        decoding = all(not s.is_prefilling for s in seqs)
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            t_decode += time.perf_counter() - t0
        else:
            t_prefill += time.perf_counter() - t0
    return t_prefill, t_decode

for n in (2000, 6000):
    t, _ = run([prompt(n, 1)], 1)
    out[f"prefill {n} tok/s"] = n / t
for streams in (1, 8):
    _, t = run([prompt(100, s) for s in range(streams)], 65)
    out[f"decode {streams} streams tok/s"] = streams * 64 / t
print(json.dumps(out))
"""


def measure(checkout: Path, dtype: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, "-c", MEASURE, dtype], env=env, cwd=checkout, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    args = ap.parse_args()
    dtype = {"bf16": "bfloat16", "fp32": "float32", None: ""}[args.dtype]
    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    for _ in range(args.rounds):
        runs["baseline"].append(measure(args.baseline, dtype))
        runs["this"].append(measure(HERE, dtype))
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f in ("avx2", "fma") or f.startswith("avx512")})
    print(f"cpu flags: {' '.join(flags)}; forced: {os.environ.get('ATEN_CPU_CAPABILITY', 'no')}; rounds: {args.rounds}")
    for name in ("baseline", "this"):
        print(f"{name} kernels: {runs[name][0]['kernels']}")
    print("| figure | baseline median (min-max) | this median (min-max) | this / baseline |")
    print("|---|---|---|---|")
    for key in (k for k in runs["this"][0] if k != "kernels"):
        med = {}
        cells = []
        for name in ("baseline", "this"):
            values = [r[key] for r in runs[name]]
            med[name] = statistics.median(values)
            cells.append(f"{med[name]:.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"| {key} | {cells[0]} | {cells[1]} | {med['this'] / med['baseline']:.2f} |")


if __name__ == "__main__":
    main()
