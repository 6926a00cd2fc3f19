"""``python -m quanta.machine``: the CPU this runs on and the paths quanta takes on it, one a line.

CI prints it before the tests, so that a run says which kind of machine it
was on: the vector features that choose kernels, the cores, the default
dtype (bf16 only with native bf16), torch's kernel capability and FBGEMM,
and the ``-march`` quanta's C kernels are built for (and whether they load).
"""

from __future__ import annotations

import os

import torch

from quanta.launch import ISA_FLAGS, cpu_flags, isa_flags, resolve_dtype
from quanta.model import native
from quanta.model.cores import usable_cores


def c_kernels() -> str:
    """Whether quanta's C kernels build and load here, and why not."""
    try:
        native.load()
    except native.NativeUnavailable as exc:
        return f"not loaded: {str(exc).splitlines()[0]}"
    return "loaded"


def report() -> list[str]:
    """The lines :func:`main` prints."""
    flags, engines = cpu_flags(), torch.backends.quantized.supported_engines
    return [
        f"cpu flags: {' '.join(isa_flags(flags)) or 'none of them'} (of {' '.join(ISA_FLAGS)} amx*)",
        f"cpus: nproc {len(os.sched_getaffinity(0))}, usable {usable_cores()} (cgroup quota included)",
        f"default dtype: {str(resolve_dtype(None)).removeprefix('torch.')} (bfloat16 with avx512_bf16 or amx_bf16)",
        f"torch {torch.__version__}: cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"fbgemm {'yes' if 'fbgemm' in engines else 'no'}",
        f"C kernels: -march={native.march()}, {c_kernels()}",
    ]


def main() -> None:
    print("\n".join(report()))


if __name__ == "__main__":
    main()
