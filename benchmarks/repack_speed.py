"""Speed of converting a GGUF tensor's raw blocks into a C form (``quanta/model/native/repack.py``).

For each source type, an 8192 x 2048 tensor of valid blocks (random quants, fp16 scales of a
realistic size) is converted to its natural form (``repack.natural_kind``) and, for the types that
also have one, to the other form, on 1 and 2 threads of the C pool. Each cell is the best of
``--passes`` conversions, as MB/s of source bytes (the file's read rate a loader would need to
keep up) and ms, measured two ways:

- new result: ``repack.to_form`` with every result kept, as a loader keeps its forms, so each
  call writes fresh pages and pays their first-touch page faults (most of an fp16 result's time);
- warm result: the C conversion alone, again into the same already-touched result.

Prints the machine and CPU flags first. Usage:
``python benchmarks/repack_speed.py [--passes 5] [--n 8192] [--k 2048]``.
"""

from __future__ import annotations

import quanta  # noqa: F401  first, as the other benchmarks (quanta/__init__.py)

# isort: split
import argparse
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quanta.bench.output import machine
from quanta.launch import cpu_summary
from quanta.model import native
from quanta.model.native import repack

#: (source type, form), natural forms first
CASES = [("Q4_0", "q4_1"), ("Q4_1", "q4_1"), ("Q4_K", "q4_1"), ("Q8_0", "q8_0"), ("Q5_0", "q8_0"), ("Q5_1", "q8_0"),
         ("Q5_K", "q8_0"), ("Q6_K", "q8_0"), ("F16", "fp16"), ("BF16", "fp16"), ("Q4_0", "q8_0"), ("Q4_1", "q8_0"),
         ("Q4_K", "q8_0")]
#: byte offsets of each type's fp16 scale fields within its block
SCALE_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
            "Q6_K": (208,)}


def tensor(ggml_type: str, n: int, k: int) -> np.ndarray:
    """Raw bytes of a valid [n, k] tensor: random quants, fp16 scales around 1e-3 (values near 1e-2 for F16 / BF16)."""
    rng = np.random.default_rng(0)
    if ggml_type in ("F16", "BF16"):
        w = rng.standard_normal(n * k, dtype=np.float32) * 0.02
        return w.astype(np.float16).view(np.uint8) if ggml_type == "F16" else (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    blocks = rng.integers(0, 256, (n * k // values, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    for at in SCALE_AT[ggml_type]:
        blocks[:, at:at + 2] = scales
    return blocks.reshape(-1)


def best_new(raw: np.ndarray, ggml_type: str, n: int, k: int, kind: str, passes: int) -> float:
    """Best seconds of ``to_form``, each result kept (as a loader keeps its forms): fresh pages every time."""
    kept, best = [], float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        kept.append(repack.to_form(raw, ggml_type, n, k, kind))
        best = min(best, time.perf_counter() - start)
    return best


def best_warm(raw: np.ndarray, ggml_type: str, n: int, k: int, kind: str, passes: int) -> float:
    """Best seconds of the C conversion alone, again and again into the same (touched) result."""
    data, scales = repack.to_form(raw, ggml_type, n, k, kind)
    convert, type_id = native.load().gguf_repack, int(GGMLQuantizationType[ggml_type])
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        convert(type_id, repack._KIND_IDS[kind], n, k, raw.ctypes.data, None, data.data_ptr(), scales.data_ptr())
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    info, lib = machine(), native.load()
    print(f"machine: {info['cpu']}, {info['logical_cores']} logical cores, flags: {cpu_summary()}; "
          f"{args.n} x {args.k} tensor, best of {args.passes} conversions\n")
    print("| source | form | MB | 1 thread: new result | warm result | 2 threads: new result | warm result |")
    print("|---|---|---|---|---|---|---|")
    before = lib.pool_threads()
    try:
        for ggml_type, kind in CASES:
            raw = tensor(ggml_type, args.n, args.k)
            cells = []
            for threads in (1, 2):
                lib.pool_set_threads(threads)
                for measure in (best_new, best_warm):
                    s = measure(raw, ggml_type, args.n, args.k, kind, args.passes)
                    cells.append(f"{raw.size / s / 1e6:.0f} ({s * 1e3:.1f})")
            print(f"| {ggml_type} | {kind} | {raw.size / 1e6:.1f} | " + " | ".join(cells) + " |")
    finally:
        lib.pool_set_threads(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
