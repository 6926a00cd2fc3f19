"""Decode attention reading the KV cache in place vs through a contiguous copy.

Times whole decode steps (forward + logits) of the embedded model with
``rows`` sequences at ``context`` cached positions each, alternating the two
ways :func:`quanta.model.attention._attend_decode` can read the cache slice
``[rows, KV heads, context, head_dim]``: in place (``bmm`` with a batch stride
of ``max_len * head_dim``) or copied contiguous first. Prints medians and the
median of the per-step paired ratio (copy / in place; > 1: in place is
faster) with its min-max, and the machine. Its results decide
:data:`quanta.model.attention.IN_PLACE_DECODE_BMM`.

Usage: ``python benchmarks/decode_attention.py [--dtype bf16|fp32] [--threads 1] [--steps 10]``.
To see the AVX2 kernels on an AVX-512 machine, run it with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``.
"""

from __future__ import annotations

import quanta  # noqa: F401  first: it sets libgomp's spin count before torch loads libgomp (quanta/__init__.py)

# isort: split
import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime

import torch

import quanta.model.attention as attention
from quanta.bench.output import machine
from quanta.launch import cpu_summary, load_model, resolve_dtype
from quanta.model.attention import AttentionBatch, KVCache, SeqSlice

ROWS = (1, 8, 32)
CONTEXTS = (256, 1024)


def paired_steps(model, kv: KVCache, rows: int, context: int, steps: int) -> dict[bool, list[float]]:
    """Seconds per decode step for in_place False/True, alternated step by step (2 warm-up rounds dropped)."""
    ids = torch.randint(100, 40000, (rows,))
    times: dict[bool, list[float]] = {False: [], True: []}
    saved = dict(attention.IN_PLACE_DECODE_BMM)
    try:
        for i in range(steps + 2):
            for in_place in (False, True):
                attention.IN_PLACE_DECODE_BMM[kv.k[0].dtype] = in_place
                batch = AttentionBatch([SeqSlice(j, context, 1) for j in range(rows)], kv, decode=True)
                t0 = time.perf_counter()
                model.compute_logits(model(ids, batch))
                if i >= 2:
                    times[in_place].append(time.perf_counter() - t0)
    finally:
        attention.IN_PLACE_DECODE_BMM.update(saved)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="model dtype (default: as quanta serve picks)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: quanta serve's decode threads on 2 cores)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per way and shape")
    args = ap.parse_args()
    dtype = resolve_dtype({"bf16": "bfloat16", "fp32": "float32", None: None}[args.dtype])
    torch.set_num_threads(args.threads)
    model = load_model(None, dtype, "auto").model
    cfg = model.config
    kv = KVCache(cfg.num_hidden_layers, max(ROWS), cfg.num_key_value_heads, max(CONTEXTS) + 2, cfg.head_dim, dtype)
    info = machine()
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "default")
    print(f"machine: {info['cpu']}, {info['logical_cores']} logical cores ({cpu_summary()}; ATen dispatch {isa}); "
          f"torch {torch.__version__}; "
          f"{args.threads} thread(s); dtype {str(dtype).removeprefix('torch.')}; kernels {model.describe_kernels()}; "
          f"{datetime.now(UTC).isoformat(timespec='seconds')}; median of {args.steps} paired steps\n")
    print("| rows | context | copy ms | in place ms | copy / in place (min-max) |")
    print("|---|---|---|---|---|")
    for context in CONTEXTS:
        for rows in ROWS:
            t = paired_steps(model, kv, rows, context, args.steps)
            ratios = sorted(c / p for c, p in zip(t[False], t[True]))
            print(f"| {rows} | {context} | {statistics.median(t[False]) * 1e3:.1f} | {statistics.median(t[True]) * 1e3:.1f} | "
                  f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
