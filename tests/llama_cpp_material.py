"""llama.cpp's own test material, from the ``llama-cpp-python`` sdist that the peer benchmarks build from.

The sdist (``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36``,
~75 MB) is downloaded once into :func:`quanta.tools.make_model.peer_cache`
and extracted there; tests read ``vendor/llama.cpp`` from it (vocabulary
files with their ``.inp``/``.out`` cases, ``models/templates/*.jinja``,
``tests/test-chat.cpp``). When the package registry cannot be reached, the
tests that need it are skipped with the reason printed.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from quanta.tools.make_model import LLAMA_CPP_PYTHON, llama_cpp_source, peer_cache

_failure: str | None = None


def _fetch() -> Path:
    """Download and extract the sdist (under a file lock: test workers may race); its llama.cpp tree."""
    source = llama_cpp_source()
    if (source / "models").is_dir():
        return source
    cache = peer_cache()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".material.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (source / "models").is_dir():
            return source
        sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not sdist.exists():
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)],
                check=True, capture_output=True, text=True, timeout=600,
            )
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    return source


def llama_cpp_tree() -> Path:
    """llama.cpp's source tree from the sdist; skips the calling test if it cannot be had."""
    global _failure
    if _failure is None:
        try:
            return _fetch()
        except (subprocess.SubprocessError, OSError, tarfile.TarError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            _failure = f"llama.cpp test material unavailable (pip download llama-cpp-python=={LLAMA_CPP_PYTHON}): {detail.strip()[-300:]}"
            print(_failure, file=sys.stderr)
    pytest.skip(_failure)


def vocab_cases() -> list[Path]:
    """Every ``models/ggml-vocab-*.gguf`` that comes with ``.inp``/``.out`` cases (empty if unavailable)."""
    try:
        models = _fetch() / "models"
    except (subprocess.SubprocessError, OSError, tarfile.TarError):
        return []
    return sorted(p for p in models.glob("ggml-vocab-*.gguf") if p.with_name(p.name + ".inp").exists())


def chat_templates() -> list[Path]:
    """Every ``models/templates/*.jinja`` (empty if unavailable)."""
    try:
        templates = _fetch() / "models" / "templates"
    except (subprocess.SubprocessError, OSError, tarfile.TarError):
        return []
    return sorted(templates.glob("*.jinja"))
