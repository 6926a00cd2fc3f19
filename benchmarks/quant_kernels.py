"""Decode-step cost of each weight form on the embedded model, by rows per step.

For every (projections, LM head) form — the reference weights, int8, int4,
fp16, and the GGUF block forms q4_1 / q8_0 of quanta's C kernels —
times one forward of ``rows`` decode tokens (one per sequence, 64 cached
positions each) plus their logits, with the quantized kernel forced at every
row count. The crossover rows, where the reference GEMM becomes faster, are
what :data:`quanta.model.quant._MAX_ROWS` records. Also prints the
single-stream bandwidth bound: weight bytes a decode step reads / measured
memory read bandwidth.

Usage: ``python benchmarks/quant_kernels.py [--dtype bf16|fp32] [--repeats 15] [--forms q4_1/q8_0,none/none]
[--native-decode on|off]``. To see the AVX2 kernels on an AVX-512 machine, run it with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 QUANTA_NATIVE_MARCH=haswell``.
"""

from __future__ import annotations

import quanta  # noqa: F401  first: it sets libgomp's spin count before torch loads libgomp (quanta/__init__.py)

# isort: split
import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from quanta.bench.output import machine
from quanta.config import DEFAULT_BLOCK_SIZE
from quanta.launch import cpu_summary, load_model, resolve_dtype
from quanta.model.attention import AttentionBatch, KVCache, SeqSlice, blocks_for
from quanta.model.native import march as native_march

ROWS = (1, 2, 4, 8, 16, 32)
FORMS = (("none", "none"), ("int8", "int8"), ("int4", "int8"), ("int4", "int4"), ("fp16", "fp16"), ("int4", "fp16"),
         ("q4_1", "none"), ("q4_1", "q8_0"), ("q4_1", "fp16"))
CONTEXT = 64


def memory_bandwidth() -> float:
    """Read bandwidth in GB/s: median of 5 sums over a 512 MiB float32 tensor."""
    big = torch.ones(128 * 1024 * 1024)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t0)
    return big.numel() * 4 / statistics.median(times) / 1e9


def step_ms(model, kv: KVCache, rows: int, repeats: int) -> float:
    """Median ms of one decode forward of ``rows`` sequences plus their logits, on the threads
    the engine's executor would give them (``NativeDecoder.claim_threads`` and ``head_threads``)."""
    ids = torch.randint(100, 40000, (rows,))
    times = []
    before = torch.get_num_threads()
    native = model.native
    try:
        for _ in range(repeats + 2):
            per = blocks_for(CONTEXT + 1, kv.block_size)
            batch = AttentionBatch([SeqSlice(range(i * per, (i + 1) * per), CONTEXT, 1) for i in range(rows)], kv, decode=True)
            t0 = time.perf_counter()
            if native is not None:
                torch.set_num_threads(native.claim_threads(rows, True, before))
            hidden = model(ids, batch)
            if native is not None:
                torch.set_num_threads(native.head_threads(rows, before))
            model.compute_logits(hidden)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times[2:]) * 1e3


def weight_bytes(model, forms: tuple[str, str]) -> int:
    """Bytes of weights one single-row decode step reads under ``forms``."""
    # int4 / q4_1 / q8_0: the values plus their scales (int4: bf16 scale and zero per 32; GGUF blocks: fp16)
    per_param = {"none": model.embed_tokens.weight.element_size(), "fp16": 2, "int8": 1, "int4": 0.625,
                 "q4_1": 0.625, "q8_0": 34 / 32}
    head = model.embed_tokens.weight.numel()
    total = sum(p.numel() for n, p in model.named_parameters() if "layers." in n and p.dim() == 2)
    return int(total * per_param[forms[0]] + head * per_param[forms[1]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file for the raw numbers")
    ap.add_argument("--native-decode", choices=("on", "off"), default="on", help="the C glue between matmuls (default: on)")
    ap.add_argument("--forms", default=None, help="comma list of projections/lm_head pairs to measure, e.g. q4_1/q8_0,none/none")
    args = ap.parse_args()
    dtype = resolve_dtype({"bf16": "bfloat16", "fp32": "float32", None: None}[args.dtype])
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = memory_bandwidth()
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "default")
    results = {}
    chosen = [tuple(f.split("/")) for f in args.forms.split(",")] if args.forms else FORMS
    for forms in chosen:
        loaded = load_model(None, dtype, "none", native_decode=args.native_decode == "on")
        model = loaded.model
        model.quantize_weights(*(None if f == "none" else f for f in forms))
        kv = KVCache(model.config.num_hidden_layers, max(ROWS) * blocks_for(CONTEXT + 1, DEFAULT_BLOCK_SIZE),
                     model.config.num_key_value_heads, DEFAULT_BLOCK_SIZE, model.config.head_dim, dtype)
        results["/".join(forms)] = {"ms": {r: step_ms(model, kv, r, args.repeats) for r in ROWS},
                                    "weight_bytes": weight_bytes(model, forms)}
        print(f"  measured {forms}", file=sys.stderr)
    info = {**machine(), "cpu_flags": cpu_summary(), "aten_cpu_capability": isa, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "native_decode": args.native_decode, "native_march": native_march(),
            "native_threads": model.native.threads if model.native else None}
    print(f"\nmachine: {info['cpu']} ({info['cpu_flags']}; ATen dispatch {isa}), {info['threads']} threads; "
          f"dtype {str(dtype).removeprefix('torch.')}; native decode {args.native_decode} (-march={native_march()}, "
          f"{info['native_threads']} C-kernel threads); "
          f"memory read {bandwidth:.1f} GB/s; "
          f"median of {args.repeats} steps, ms per decode step (forward + logits)\n")
    print("| projections/lm_head | weights read (MB) | bandwidth bound at 1 row (ms) | " + " | ".join(f"{r} rows" for r in ROWS) + " |")
    print("|---|---|---|" + "---|" * len(ROWS))
    for name, r in results.items():
        mb = r["weight_bytes"] / 1e6
        print(f"| {name} | {mb:.0f} | {mb / bandwidth:.1f} | " + " | ".join(f"{r['ms'][n]:.1f}" for n in ROWS) + " |")
    if args.out:
        args.out.write_text(json.dumps({"date": datetime.now(UTC).isoformat(), "machine": info,
                                        "bandwidth_gb_s": bandwidth, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
