"""KV cache element dtypes (``--kv-cache-dtype``): the C kernels and the PyTorch
paths read and write fp16 and bf16 caches under an fp32 model within each
dtype's documented tolerance of an fp32 cache; ``auto`` and the budget."""

from __future__ import annotations

import pytest
import torch

from quanta.config import EngineConfig
from quanta.flags import configs_from_args, parse_serve_flags
from quanta.launch import kv_cache_blocks, load_model, resolve_kv_dtype
from quanta.model.attention import AttentionBatch, bytes_per_block
from slot_cache import SlotCache

#: the largest logit difference from an fp32 cache over 9 decode steps at ~300 positions (fp32 model,
#: embedded SmolLM2; measured 0.009 for fp16 and 0.074 for bf16, which also flips a greedy token there)
TOLERANCE = {torch.float16: 0.02, torch.bfloat16: 0.15}
#: between the C and PyTorch decode paths over the same cache dtype: their K/V differ in the last fp32 bits
#: before rounding, which a bf16 rounding can turn into a whole bf16 ulp (measured 8e-3; fp16 about 1e-3)
PATHS = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32, "none")


def _decode_logits(loaded, dtype: torch.dtype, native: bool) -> torch.Tensor:
    """Logits of 9 decode steps after a 290-token prompt, the cache in ``dtype``, on the C or PyTorch decode path."""
    model, cfg = loaded.model, loaded.model.config
    ids = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(0))
    kv = SlotCache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 512, cfg.head_dim, dtype)
    decoder = model.native
    model.native = decoder if native else None
    try:
        model(ids[:290], AttentionBatch([kv.seq(1, 0, 290)], kv))
        rows = [model.compute_logits(model(ids[p:p + 1], AttentionBatch([kv.seq(1, p, 1)], kv, decode=True)))
                for p in range(290, 299)]
    finally:
        model.native = decoder
    return torch.cat(rows).float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_caches_stay_within_their_tolerance_of_fp32(loaded, dtype):
    assert loaded.model.native is not None  # the C decode path is under test too
    reference = _decode_logits(loaded, torch.float32, native=True)
    c_path, torch_path = (_decode_logits(loaded, dtype, native) for native in (True, False))
    assert (c_path - reference).abs().max() < TOLERANCE[dtype]
    assert (c_path - torch_path).abs().max() < PATHS[dtype]  # both paths read and write the same elements
    assert (c_path - reference).abs().max() > 0  # the cache really held half-precision values


def test_auto_is_bf16_for_a_bf16_model_and_fp16_for_an_fp32_one():
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32) == torch.float16
    assert resolve_kv_dtype("float32", torch.bfloat16) == torch.float32
    engine, _ = configs_from_args(parse_serve_flags(["--kv-cache-dtype", "fp16"]))
    assert engine.kv_cache_dtype == "float16"
    assert configs_from_args(parse_serve_flags([]))[0].kv_cache_dtype == "auto"


def test_a_half_cache_holds_twice_the_tokens_of_fp32_in_the_same_memory(loaded):
    cfg = loaded.config
    memory = 100 * bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, 32, cfg.head_dim, torch.float32)
    blocks = {name: kv_cache_blocks(loaded, EngineConfig(kv_cache_memory=memory, kv_cache_dtype=name), 512, 4)
              for name in ("float32", "float16", "bfloat16")}
    assert blocks == {"float32": 100, "float16": 200, "bfloat16": 200}
