"""``python -m quanta.machine``: the report CI prints before the tests."""

from __future__ import annotations

import subprocess
import sys

from quanta.launch import isa_flags
from quanta.model import native


def test_isa_flags_are_the_kernel_choosing_ones_and_every_amx_flag():
    flags = {"sse2", "avx512f", "fma", "avx2", "amx_tile", "amx_bf16", "avx512_bf16"}
    assert isa_flags(flags) == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]


def test_the_report_names_the_machine_and_the_paths_taken():
    out = subprocess.run([sys.executable, "-m", "quanta.machine"], capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["cpu", "cpus:", "default", "torch", "C"], out
    assert "cpu capability" in lines[3] and "fbgemm" in lines[3], out
    assert lines[4].startswith(f"C kernels: -march={native.march()}, "), out
