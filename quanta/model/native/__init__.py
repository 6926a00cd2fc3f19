"""Build and load quanta's C kernels (``decode.c``, ``qmatmul.c``, ``dequant.c``, ``f16matmul.c``,
``repack.c``, and ``pool.c``, the fork-join whose two threads claim their work chunk by chunk) for this CPU.

The sources are compiled once per (source, compiler, CPU flags) with
``-O3 -march=native -ffast-math`` (:func:`march`) into a shared library cached under
``$QUANTA_CACHE_DIR`` (default ``~/.cache/quanta``)``/native/``, then loaded
with :mod:`ctypes` (whose calls release the GIL). Compiling takes under a
second with gcc; where no C compiler works, :func:`load` says why and the
model keeps its PyTorch decode path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from quanta.model.cpu import cpu_flags

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("decode.c", "qmatmul.c", "dequant.c", "f16matmul.c", "repack.c", "pool.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("bf16.h", "pool.h"))
#: qmatmul.c's kind of each block form (repack.c's TO_* too; 16: fp16 there)
KINDS = {"q4_1": 4, "q6_k": 6, "q8_0": 8}
FLAGS = ("-O3", "-ffast-math", "-fopenmp-simd", "-fPIC")
LIBS = ("-lmvec", "-lm", "-lpthread")

_P, _I, _F, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
_SIGNATURES = {
    "residual_rms_norm": (_I, _I, _P, _P, _P, _F, _P, _I, _P),
    "attention_decode": (_I, _P, _I, _I, _I, _I, _P, _P, _F, _P, _P, _P, _P, _P, _L, _L, _P, _P, _I, _L, _P, _P),
    "attention_rows": (_I, _P, _I, _I, _I, _I, _P, _P, _P, _L, _L, _P, _P, _I, _L, _P, _P),
    "kv_store_rows": (_L, _I, _P, _I, _P),
    "attention_scratch": (_I, _I, _I, _I, _L),
    "block_sums_scratch": (_I, _I),
    "pool_set_threads": (_I,),
    "pool_threads": (),
    "silu_mul": (_I, _I, _P, _I, _P, _P),
    "block_matmul": (_I, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P),
    "block_matmul_experts": (_I, _I, _I, _P, _P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P),
    "block_dense": (_I, _I, _I, _P, _P, _P, _I),
    "f16_matmul": (_I, _I, _I, _P, _I, _P, _P, _P),
    "f32_matmul": (_I, _I, _I, _P, _I, _P, _P, _P),
    "gguf_repack": (_I, _I, _L, _L, _P, _P, _P, _P),
}

_RESULTS = {"attention_scratch": _L, "block_sums_scratch": _L, "pool_threads": _I, "gguf_repack": _I, "block_matmul": _I,
            "block_matmul_experts": _I}


class NativeUnavailable(RuntimeError):
    """The C library could not be built or loaded here (the message says why)."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$QUANTA_CACHE_DIR/native`` or ``~/.cache/quanta/native``."""
    root = os.environ.get("QUANTA_CACHE_DIR") or Path.home() / ".cache" / "quanta"
    return Path(root) / "native"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeUnavailable("no C compiler (cc or gcc) on PATH")
    return cc


def march() -> str:
    """The ``-march`` target: ``$QUANTA_NATIVE_MARCH`` or ``native`` (e.g. ``haswell`` runs the
    AVX2 kernels on an AVX-512 machine, for benchmarks and tests)."""
    return os.environ.get("QUANTA_NATIVE_MARCH") or "native"


def _key(cc: str, target: str) -> str:
    """Hash of the sources and header, flags, target, compiler version and CPU flags (``-march=native`` depends on them)."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"C compiler {cc} does not run: {e}") from e
    text = "\n".join([*(s.read_text() for s in SOURCES + HEADERS), " ".join(FLAGS + LIBS), target, version, " ".join(sorted(cpu_flags()))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build(target: str | None = None) -> Path:
    """Path of the library built for ``-march=target`` (default :func:`march`), compiling it
    first if this machine has no cached copy.

    Raises:
        NativeUnavailable: no compiler, the compile failed (with its stderr), or the
            cache directory cannot be written.
    """
    try:
        return _build(target)
    except OSError as e:  # an unwritable cache directory, a full disk
        raise NativeUnavailable(f"cannot build in {cache_dir()}: {e}") from e


def _build(target: str | None) -> Path:
    cc, arch = _compiler(), target or march()
    lib = cache_dir() / f"quanta-{arch}-{_key(cc, arch)}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        objects = [str(Path(tmp) / f"{src.stem}.o") for src in SOURCES]
        # Compile with -ffast-math but link without it: linking with it adds crtfastmath.o, which
        # sets flush-to-zero for the whole process when the library loads (torch's numerics too).
        steps = [[cc, *FLAGS, f"-march={arch}", "-c", str(src), "-o", obj] for src, obj in zip(SOURCES, objects)]
        steps.append([cc, "-shared", *objects, "-o", str(out), *LIBS])
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise NativeUnavailable(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, lib)  # atomic: concurrent builders each publish a whole file
    return lib


@cache
def load() -> ctypes.CDLL:
    """The library for this machine (:func:`build`), loaded once per process.

    Raises:
        NativeUnavailable: see :func:`build`, or the library would not load.
    """
    return open_library(build())


def open_library(path: Path) -> ctypes.CDLL:
    """A built library, loaded with its function signatures set.

    Raises:
        NativeUnavailable: it would not load.
    """
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"cannot load {path}: {e}") from e
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _RESULTS.get(name)
    return lib
