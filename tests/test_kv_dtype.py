"""KV cache element dtypes (``--kv-cache-dtype``): the C kernels and the PyTorch
paths read and write fp16, bf16 and q8_0 caches under an fp32 model within each
dtype's documented tolerance of an fp32 cache; ``auto`` and the budget."""

from __future__ import annotations

import pytest
import torch

from quanta.config import EngineConfig
from quanta.flags import configs_from_args, parse_serve_flags
from quanta.launch import kv_cache_blocks, load_model, resolve_kv_dtype
from quanta.model import native
from quanta.model.attention import AttentionBatch, _stored, bytes_per_block, dequantize_q8, kv_format, quantize_q8
from slot_cache import SlotCache

#: the largest logit difference from an fp32 cache over 9 decode steps at ~300 positions (fp32 model,
#: embedded SmolLM2; measured 0.009 for fp16, 0.074 for bf16 and 0.20 for q8_0; bf16 and q8_0 flip
#: one of the 9 greedy tokens there)
TOLERANCE = {"float16": 0.02, "bfloat16": 0.15, "q8_0": 0.4}
#: between the C and PyTorch decode paths over the same cache dtype: their K/V differ in the last fp32 bits
#: before rounding, which a bf16 rounding or a q8_0 step can turn into a whole unit of the format
#: (measured 8e-3 bf16, about 1e-3 fp16; q8_0 6e-3 on AVX-512, 2.5e-2 with the AVX2 kernels)
PATHS = {"float16": 3e-3, "bfloat16": 2e-2, "q8_0": 5e-2}


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32, "none")


def _decode_logits(loaded, dtype: torch.dtype | str, native: bool) -> torch.Tensor:
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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "q8_0"])
def test_smaller_caches_stay_within_their_tolerance_of_fp32(loaded, dtype):
    assert loaded.model.native is not None  # the C decode path is under test too
    reference = _decode_logits(loaded, torch.float32, native=True)
    c_path, torch_path = (_decode_logits(loaded, dtype, native) for native in (True, False))
    assert (c_path - reference).abs().max() < TOLERANCE[dtype]
    assert (c_path - torch_path).abs().max() < PATHS[dtype]  # both paths read and write the same elements
    assert (c_path - reference).abs().max() > 0  # the cache really held the smaller values


def test_auto_is_bf16_for_a_bf16_model_and_fp16_for_an_fp32_one():
    assert resolve_kv_dtype("auto", torch.bfloat16) == kv_format(torch.bfloat16)
    assert resolve_kv_dtype("auto", torch.float32) == kv_format(torch.float16)
    assert resolve_kv_dtype("float32", torch.bfloat16) == kv_format(torch.float32)
    assert resolve_kv_dtype("q8_0", torch.float32).storage == torch.uint8
    engine, _ = configs_from_args(parse_serve_flags(["--kv-cache-dtype", "fp16"]))
    assert engine.kv_cache_dtype == "float16"
    assert configs_from_args(parse_serve_flags([]))[0].kv_cache_dtype == "auto"


def test_a_half_cache_holds_twice_the_tokens_of_fp32_in_the_same_memory(loaded):
    cfg = loaded.config
    memory = 100 * bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, 32, cfg.head_dim, torch.float32)
    blocks = {name: kv_cache_blocks(loaded, EngineConfig(kv_cache_memory=memory, kv_cache_dtype=name), 512, 4)
              for name in ("float32", "float16", "bfloat16", "q8_0")}
    assert blocks == {"float32": 100, "float16": 200, "bfloat16": 200, "q8_0": 376}  # 128 / 34 * 100 blocks


def _q8_rows() -> torch.Tensor:
    """Rows of 64 values: random scales, a group of zeros, a group under fp16's smallest scale, ties at .5."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(40, 64, generator=gen) * torch.logspace(-3, 3, 40)[:, None]
    rows[0, :32] = 0
    rows[1, :32] = 1e-9  # d = fp16(1e-9 / 127) is 0
    rows[2, :32] = torch.arange(32) - 15.5  # amax 15.5, d = fp16(15.5 / 127): x / d near ties
    return rows


def test_q8_0_bytes_are_the_same_from_c_and_pytorch():
    try:
        native.load()
    except native.NativeUnavailable as e:
        pytest.skip(f"no C library: {e}")
    rows, fmt = _q8_rows(), kv_format("q8_0")
    assert torch.equal(_stored(rows, fmt), quantize_q8(rows))


def test_q8_0_round_trip_is_within_half_a_step():
    rows = _q8_rows()
    back = dequantize_q8(quantize_q8(rows))
    step = (rows.reshape(40, 2, 32).abs().amax(-1, keepdim=True) / 127).half().float()
    error = (back.reshape(40, 2, 32) - rows.reshape(40, 2, 32)).abs()
    assert torch.all((error <= step / 2 * (1 + 1e-6)) | (step == 0))
    assert torch.equal(back[:2, :32], torch.zeros(2, 32))  # zeros, and values under fp16's smallest scale: no NaN
    assert torch.isfinite(back).all()
