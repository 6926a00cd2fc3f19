"""Phi-3 GGUFs (``phi3``): the fused ``attn_qkv`` / gate-and-up ``ffn_up`` tensors through both
loaders, LongRoPE's factor choice by context, and the refusal of an unknown architecture. Agreement
with llama.cpp's outputs is ``tests/test_agreement_llama_cpp.py``'s ``tiny-phi3-Q8_0`` case."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from quanta.config import EngineConfig, SchedulerConfig
from quanta.launch import build_engine, load_model
from quanta.model.config import SUPPORTED_ARCHITECTURES
from quanta.model.loader import load_checkpoint, load_config
from quanta.model.native import forms
from quanta.model.rope import RotaryEmbedding, inverse_frequencies
from quanta.tools.make_model import write_direct
from quanta.tools.model_shapes import SHAPES

ROPE = SHAPES["tiny-phi3"]["rope_scaling"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer of make-model's tiny-phi3 in F16 (LongRoPE: original context 1024 of 4096, sliding window 32)."""
    path = tmp_path_factory.mktemp("phi3") / "tiny-phi3.gguf"
    return write_direct("tiny-phi3", path, "F16", 0, 1, progress=lambda _: None)


def test_config_reads_longrope_and_ignores_the_sliding_window(tiny: Path) -> None:
    cfg = load_config(tiny)
    assert cfg.architecture == "phi3" and cfg.head_dim == 32 and cfg.intermediate_size == 384
    rope = cfg.rope_scaling
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 1024
    np.testing.assert_array_equal(rope["long_factor"], np.float32(ROPE["long_factor"]))
    np.testing.assert_array_equal(rope["short_factor"], np.float32(ROPE["short_factor"]))
    assert rope["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(1024)), rel=1e-6)
    assert getattr(cfg, "sliding_window", 0) == 0  # llama.cpp disables Phi-3's sliding window: full attention


def test_longrope_takes_the_long_factors_only_above_the_original_context(tiny: Path) -> None:
    cfg = load_config(tiny)
    plain = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    for context, factors in ((1024, ROPE["short_factor"]), (1025, ROPE["long_factor"]), (None, ROPE["long_factor"])):
        want = (plain / torch.tensor(np.float32(factors), dtype=torch.float64)).float()
        torch.testing.assert_close(inverse_frequencies(cfg, context), want, rtol=0, atol=0)
    assert RotaryEmbedding(cfg).attention_factor == pytest.approx(1.0954451, rel=1e-6)


def test_the_dequantizing_loader_splits_the_fused_tensors(tiny: Path) -> None:
    _, state = load_checkpoint(tiny)
    tensors = {t.name: t for t in gguf.GGUFReader(tiny).tensors}
    qkv = torch.from_numpy(np.array(tensors["blk.0.attn_qkv.weight"].data, dtype=np.float32))
    up = torch.from_numpy(np.array(tensors["blk.0.ffn_up.weight"].data, dtype=np.float32))
    layer = "model.layers.0."
    assert torch.equal(torch.cat([state[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv"]), qkv)
    assert state[f"{layer}self_attn.q_proj.weight"].shape == (128, 128)
    assert state[f"{layer}self_attn.k_proj.weight"].shape == (64, 128)
    assert torch.equal(state[f"{layer}mlp.gate_proj.weight"], up[:384])  # the gate rows first, as llama.cpp's swiglu
    assert torch.equal(state[f"{layer}mlp.up_proj.weight"], up[384:])


@pytest.mark.skipif(not forms.available(), reason="quanta's C kernels do not build here")
def test_block_model_computes_as_the_dequantized_one(tiny: Path) -> None:
    tokens = torch.arange(300, 360)
    logits = []
    for quantization, prompt_weights in (("none", "reference"), ("auto", "blocks")):
        loaded = load_model(str(tiny), torch.float32, quantization, False, prompt_weights)
        logits.append(_prompt_logits(loaded, tokens))
    assert "from-blocks" in loaded.kernels
    # the same F16 weights; the kernels' rounding differs (~4e-3 measured), a misplaced row by whole nats
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=2e-2)


def _prompt_logits(loaded, tokens: torch.Tensor) -> torch.Tensor:
    from quanta.tools import agreement

    return agreement.position_logprobs(loaded, tokens.tolist(), 1)


def test_max_model_len_at_the_original_context_takes_the_short_factors(tiny: Path) -> None:
    loaded = load_model(str(tiny), torch.float32, "none", False, "reference")
    torch.testing.assert_close(loaded.model.rope.inv_freq, inverse_frequencies(loaded.config, 4096), rtol=0, atol=0)
    build_engine(loaded, EngineConfig(max_model_len=1024), SchedulerConfig("batched", 1, {}))
    torch.testing.assert_close(loaded.model.rope.inv_freq, inverse_frequencies(loaded.config, 1024), rtol=0, atol=0)
    assert not torch.equal(inverse_frequencies(loaded.config, 1024), inverse_frequencies(loaded.config, 4096))


def test_an_unsupported_architecture_is_refused_in_one_line_naming_the_supported(tmp_path: Path) -> None:
    path = tmp_path / "phi2.gguf"  # Phi-2: another layout (LayerNorm, parallel attention and MLP)
    writer = gguf.GGUFWriter(path, "phi2")
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_ti_data_to_file, writer.close):
        write()
    with pytest.raises(ValueError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message and "unsupported GGUF architecture 'phi2'" in message
    assert "phi3" in message.split("supported: ")[1] and "llama" in message
    assert "phi3" in SUPPORTED_ARCHITECTURES
