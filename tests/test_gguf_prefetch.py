"""A dense GGUF's forms converted ahead of the load (quanta.model.gguf_prefetch): the same bytes the
loader makes, every planned form taken, anything else left to the loader, and no torch imported."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from quanta import cli
from quanta.config import EngineConfig
from quanta.model import gguf_prefetch
from quanta.model.gguf_blocks import load_block_model
from quanta.model.linear import PackedLinear
from quanta.model.loader import load_config
from quanta.model.native import forms, repack
from test_gguf_blocks import MIXES, write_tiny

pytestmark = pytest.mark.skipif(not forms.available(), reason="quanta's C kernels do not build here")


def _forms(model) -> list[tuple[np.ndarray, np.ndarray]]:
    linears = [m.form for m in model.modules() if isinstance(m, PackedLinear)]
    return [(f.data.numpy(), f.scales.numpy()) for f in [*linears, model.embed_tokens.form]]


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_prefetched_forms_are_the_loaders_own(tmp_path, mix):
    path = tmp_path / f"{mix}.gguf"
    write_tiny(path, *MIXES[mix])
    plain = load_block_model(path, load_config(path), torch.float32)
    prefetch = gguf_prefetch.start(path)
    ahead = load_block_model(path, load_config(path), torch.float32)
    assert prefetch.error is None and prefetch.planned > 0
    assert prefetch.taken == prefetch.planned  # the plan is the loader's: nothing converted twice
    assert gguf_prefetch.claim(path) is None  # the load claimed it
    want, got = _forms(plain), _forms(ahead)
    assert len(want) == len(got)
    for (wd, ws), (gd, gs) in zip(want, got, strict=True):
        assert wd.dtype == gd.dtype and np.array_equal(wd, gd) and np.array_equal(ws, gs)


def test_a_form_asked_otherwise_is_left_to_the_loader(tmp_path):
    path = tmp_path / "llama.gguf"
    write_tiny(path, *MIXES["llama-q8_0"])
    prefetch = gguf_prefetch.start(path)
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]
    assert prefetch.take(names, "q4_1", [None, None, None]) is None  # another kind
    assert prefetch.take(names, "q8_0", [None, None, None]) is None  # without llama's q/k row maps
    assert prefetch.take(["blk.0.attn_q.weight"], "q8_0", [None]) is None  # not a planned stack
    prefetch.close()
    assert prefetch.taken == 0 and gguf_prefetch.claim(path) is not None


def test_a_truncated_file_is_reported_by_the_load(tmp_path):
    path = tmp_path / "cut.gguf"
    write_tiny(path, *MIXES["llama-q8_0"])
    cfg = load_config(path)
    path.write_bytes(path.read_bytes()[:-4096])
    gguf_prefetch.start(path)
    with pytest.raises(ValueError, match="cut.gguf"):
        load_block_model(path, cfg, torch.float32)


def test_fresh_pages_are_populated_only_once_claimed(tmp_path, monkeypatch):
    """Beside the imports a form's pages are faulted in by its writes: a populating ``mmap`` holds the
    memory map lock that every library torch loads waits for. Once the loader claims it, they are
    made resident in one call."""
    path = tmp_path / "llama.gguf"
    write_tiny(path, *MIXES["llama-q8_0"])
    asked, go = [], threading.Event()
    empty_arrays = repack.empty_arrays

    def recorded(kind, n, k, populate=True):
        asked.append(populate)
        assert go.wait(30)
        return empty_arrays(kind, n, k, populate)

    monkeypatch.setattr(repack, "empty_arrays", recorded)
    go.set()
    alone = gguf_prefetch.start(path)
    _wait_asked(alone, asked)
    alone.close()
    assert alone.planned > 1 and asked == [False] * alone.planned
    asked.clear()
    go.clear()
    prefetch = gguf_prefetch.start(path)
    _until(lambda: asked)  # the first form is being converted, unclaimed
    assert asked and gguf_prefetch.claim(path) is prefetch
    go.set()
    _wait_asked(prefetch, asked)
    prefetch.close()
    assert prefetch.error is None and asked == [False] + [True] * (prefetch.planned - 1)


def _wait_asked(prefetch: gguf_prefetch.Prefetch, asked: list) -> None:
    """Until every planned form's arrays were asked for (close() stops after the form being converted)."""
    _until(lambda: prefetch.planned and len(asked) >= prefetch.planned)


def _until(done, seconds: float = 30.0) -> None:
    """Poll ``done()`` every millisecond until it is true or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_the_prefetch_imports_no_torch(tmp_path):
    """It runs while torch is being imported: importing torch itself would serialize the two."""
    path = tmp_path / "llama.gguf"
    write_tiny(path, *MIXES["llama-q8_0"])
    code = ("import sys; from quanta.model import gguf_prefetch as p; f = p.start(sys.argv[1]); f.close(); "
            "assert f.error is None and f.planned > 0, f.error; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("flags", "started"), [({}, True), ({"replicas": 2}, False), ({"quantization": "q8_0"}, False),
                                                ({"prompt_weights": "reference"}, False)])
def test_the_command_line_starts_it_where_the_load_reads_blocks(tmp_path, flags, started):
    path = tmp_path / "llama.gguf"
    write_tiny(path, *MIXES["llama-q8_0"])
    engine_cfg = EngineConfig(model=str(path), quantization=flags.get("quantization", "auto"),
                              prompt_weights=flags.get("prompt_weights", "auto"))
    cli._prefetch_weights(argparse.Namespace(replicas=flags.get("replicas")), engine_cfg)
    claimed = gguf_prefetch.claim(path)
    assert (claimed is not None) == started
    if claimed is not None:
        claimed.close()
