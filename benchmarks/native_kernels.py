"""Kernel-level timings of quanta's C code, outside Python: block_matmul and attention_decode.

Compiles two small C drivers (``benchmarks/native/matmul.c``, ``attention.c``) against
``quanta/model/native``'s sources with the library's own flags, for ``-march=native`` and
``-march=haswell`` (the AVX2 code an AVX2-only CPU runs), and runs each ``--repeats`` times:

- q4_1 with 8-bit activations (the projections) and q8_0 with 15-bit ones (the LM head) over
  the embedded model's 30 layers of projection shapes, at 1 / 2 / 4 / 8 rows (ms per pass);
- attention_decode for the embedded model's head layout over 30 layers, each layer its own paged
  cache (so a pass reads the caches from memory, as a decode step does): 8 rows at 64 / 300 /
  1,000 cached positions and 1 row at 8,192, float32, bf16 and q8_0 caches (ms per pass);
- ``--prompt``: block_matmul at prompt sizes instead (``benchmarks/native/prompt.c``): Llama-3.2-1B's
  projection shapes at 64 and 1,024 rows, 8-bit activations, on 1 and 2 threads, in multiply-adds a
  second, beside the ceiling of the instructions its inner step issues (``peak``: the 8 ``maddubs``,
  7 adds and one ``madd`` of 256 multiply-adds, from registers, on every thread; with AVX-512 VNNI
  also the 512-bit tile's row step, 8 ``dpbusd`` of 512 multiply-adds, alone and with the block's
  float epilogue).

Each driver prints the best of 10-20 passes (the attention driver also a hash of its output, so
two builds can be checked to agree bit for bit); the table gives the median (min-max) of those
over the repeats, with the machine and CPU flags. Usage:
``python benchmarks/native_kernels.py [--repeats 5] [--threads 1] [--prompt]``. To compare two versions,
run it on each checkout in turn (not in CI: it is a benchmark).
"""

from __future__ import annotations

import quanta  # noqa: F401  first, as the other benchmarks (quanta/__init__.py)

# isort: split
import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from quanta.bench.output import machine
from quanta.launch import cpu_summary
from quanta.model import native
from quanta.model.cpu import cpu_flags

HERE = Path(__file__).parent / "native"
MATMUL = [("q4_1, 8-bit activations", ["4", "0"]), ("q8_0, 15-bit activations", ["8", "1"])]
ATTENTION = ((8, 64), (8, 300), (8, 1000), (1, 8192))  # (rows, cached positions)
CACHES = (("float32", 0), ("bf16", 1), ("q8_0", 3))
#: Llama-3.2-1B's projections as a Q4_K_M file's forms hold them: (name, kind, n, k)
PROMPT_SHAPES = (("qkv", "8", 3072, 2048), ("o", "4", 2048, 2048), ("gate_up", "4", 16384, 2048), ("down", "4", 2048, 8192))
PROMPT_ROWS = (64, 1024)


def build(driver: str, march: str, out: Path) -> Path:
    """The driver linked with the library's sources for ``-march=march``."""
    exe = out / f"{driver}-{march}"
    sources = [str(s) for s in native.SOURCES]
    cmd = [native._compiler(), *native.FLAGS, f"-march={march}", f"-I{native.SOURCES[0].parent}", *sources,
           str(HERE / f"{driver}.c"), "-o", str(exe), *native.LIBS]
    subprocess.run(cmd, check=True)
    return exe


def times(cmd: list[str], repeats: int, unit: str = "ms") -> list[list[float]]:
    """Per repeat, the figures the driver prints (one per line: the first number followed by ``unit``)."""
    figure = re.compile(rf"([0-9.]+) {re.escape(unit)}")
    runs = []
    for _ in range(repeats):
        text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append([float(figure.search(line).group(1)) for line in text.splitlines()])
    return runs


def prompt_table(exe: Path, repeats: int) -> None:
    """block_matmul's multiply-adds a second at prompt sizes, and the ceiling of its inner step."""
    print("| projection (Llama-3.2-1B) | form | rows | 1 thread, GMAC/s | 2 threads, GMAC/s |")
    print("|---|---|---|---|---|")
    for name, kind, n, k in PROMPT_SHAPES:
        for rows in PROMPT_ROWS:
            cells = [cell([r[0] for r in times([str(exe), str(t), kind, str(rows), str(n), str(k)], repeats, "GMAC/s")])
                     for t in (1, 2)]
            print(f"| {name} {n} x {k} | {'q4_1' if kind == '4' else 'q8_0'} | {rows:,} | " + " | ".join(cells) + " |")
    peaks = [cell([r[0] for r in times([str(exe), str(t), "peak"], repeats, "GMAC/s")]) for t in (1, 2)]
    print("| ceiling: the inner step's instructions alone (maddubs x 8, add x 7, madd) | - | - | " + " | ".join(peaks) + " |")
    if "avx512_vnni" in cpu_flags():  # the 512-bit tile's row step, without and with its float epilogue
        for mode, what in (("vnni", "dpbusd x 8 (512-bit)"), ("vnni-scaled", "dpbusd x 8, then add, convert, mul, 2 FMA")):
            cells = [cell([r[0] for r in times([str(exe), str(t), mode], repeats, "GMAC/s")]) for t in (1, 2)]
            print(f"| ceiling: the 512-bit row step alone ({what}) | - | - | " + " | ".join(cells) + " |")


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, choices=(1, 2), help="the C pool's threads (pool.c)")
    ap.add_argument("--prompt", action="store_true", help="block_matmul at prompt sizes and its instruction ceiling instead")
    args = ap.parse_args()
    info = machine()
    if args.prompt:
        print(f"machine: {info['cpu']}, {info['logical_cores']} logical cores, flags: {cpu_summary()}; "
              f"-march=native; median (min-max) of {args.repeats} runs, each the best of 5 passes\n")
        with tempfile.TemporaryDirectory() as tmp:
            prompt_table(build("prompt", "native", Path(tmp)), args.repeats)
        return 0
    print(f"machine: {info['cpu']}, {info['logical_cores']} logical cores, flags: {cpu_summary()}; "
          f"C pool threads {args.threads}; median (min-max) of {args.repeats} runs, each the best of 15-20 passes, ms\n")
    with tempfile.TemporaryDirectory() as tmp:
        print("| kernel | -march | 1 row | 2 rows | 4 rows | 8 rows |")
        print("|---|---|---|---|---|---|")
        for march in ("native", "haswell"):
            exe = build("matmul", march, Path(tmp))
            for name, kind in MATMUL:
                runs = times([str(exe), str(args.threads), *kind], args.repeats)
                print(f"| {name}, 30 layers | {march} | " + " | ".join(cell([r[i] for r in runs]) for i in range(4)) + " |")
        print("\n| attention_decode, 30 layers | -march | " +
              " | ".join(f"{r} row{'s' if r > 1 else ''} x {c:,} positions" for r, c in ATTENTION) + " |")
        print("|---|---|" + "---|" * len(ATTENTION))
        for march in ("native", "haswell"):
            exe = build("attention", march, Path(tmp))
            for name, kind in CACHES:
                cells = [cell([r[0] for r in times([str(exe), str(args.threads), str(c), str(kind), str(rows), "10"],
                                                   args.repeats)]) for rows, c in ATTENTION]
                print(f"| {name} cache | {march} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
