"""This machine's CPU features, read from /proc/cpuinfo: what picks the dtype, the kernels and the
C library's build (``-march=native`` depends on them).

It sits on the model floor, which imports nothing above it; the launcher and the machine report
read it from here.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

#: /proc/cpuinfo flags that choose kernels (every ``amx_*`` flag is shown too)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The first CPU's feature flags from ``cpuinfo`` (empty where unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (bf16 matmuls ~2x fp32 there)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def isa_flags(flags: set[str]) -> list[str]:
    """Those of :data:`ISA_FLAGS` and the ``amx_*`` flags that ``flags`` holds."""
    return [f for f in ISA_FLAGS if f in flags] + sorted(f for f in flags if f.startswith("amx"))


def cpu_summary() -> str:
    """The vector features that choose kernels (:func:`isa_flags`), e.g. ``avx2 fma f16c avx512f avx512_bf16``."""
    return " ".join(isa_flags(cpu_flags())) or "no avx2"
