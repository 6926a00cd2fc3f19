"""The ``phi3`` shapes of ``quanta make-model`` and what llama.cpp's converter (``Phi3MiniModel`` in
its ``conversion/phi.py``) writes for them beyond the Llama layout.

- tensors: per block ``attn_norm``, ``ffn_down``, ``ffn_up`` (HF's ``gate_up_proj``: the gate rows,
  then the up rows, ``2 * intermediate_size`` in all), ``ffn_norm``, ``attn_output``, ``attn_qkv``
  (q, k, v rows stacked), in HF's alphabetical order; for a ``longrope`` scaling the F32
  ``rope_factors_long.weight`` and ``rope_factors_short.weight`` first;
- keys: ``phi3.rope.scaling.original_context_length``, ``phi3.rope.dimension_count``,
  ``phi3.attention.sliding_window`` (0 when the config has none) and, for ``longrope``,
  ``phi3.rope.scaling.attn_factor = sqrt(1 + ln(max / original) / ln(original))``.
"""

from __future__ import annotations

import math
from typing import Any

#: Phi-3.5-mini-instruct's ``rope_scaling`` factors (its ``config.json``)
_PHI35_LONG = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115, 1.600000023841858,
    1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863, 4.789999961853027, 7.400000095367432,
    7.700000286102295, 9.09000015258789, 12.199999809265137, 17.670000076293945, 24.46000099182129, 28.57000160217285,
    30.420001983642578, 30.840002059936523, 32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992,
    50.340003967285156, 50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
    62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457, 63.77000427246094,
    63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688, 64.06999969482422, 64.08000183105469,
    64.12000274658203, 64.41000366210938, 64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999633789062]
_PHI35_SHORT = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, *[1.0499999523162842] * 5, 1.0699999332427979,
    1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788, 1.8799997568130493,
    1.9099997282028198, 1.9399996995925903, 1.9899996519088745, *[2.0199997425079346] * 6, *[2.0299997329711914] * 9,
    2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
    2.749999523162842, 2.8399994373321533]

PHI3_SHAPES: dict[str, dict] = {
    "phi-3.5-mini": {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": False,
                     "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                     "original_max_position_embeddings": 4096, "sliding_window": 262144,
                     "rope_scaling": {"type": "longrope", "long_factor": _PHI35_LONG, "short_factor": _PHI35_SHORT}},
    # for tests: Phi-3's fused attn_qkv / gate-up ffn_up and LongRoPE at toy width (head_dim 32, GQA). An original
    # context of 1024, below llama-server's 2048 and quanta's default 4096, so both take the long factors (up to
    # 28: they turn positions below 100), and a sliding window of 32 that llama.cpp ignores for phi3 (so must quanta)
    "tiny-phi3": {"architectures": ["Phi3ForCausalLM"], "vocab_size": 49152 + 128, "hidden_size": 128, "intermediate_size": 384,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
                  "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                  "original_max_position_embeddings": 1024, "sliding_window": 32,
                  "rope_scaling": {"type": "longrope", "long_factor": [round(1.25 ** i, 4) for i in range(16)],
                                   "short_factor": [round(1 + 0.05 * i, 4) for i in range(16)]}},
}


def _longrope(cfg: dict) -> dict | None:
    rope = cfg.get("rope_scaling") or {}
    return rope if rope.get("type", rope.get("rope_type", "")).lower() in ("longrope", "su") else None


def rope_factor_plan(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """The LongRoPE factor tensors (kind ``rope``) of a ``longrope`` config, else none."""
    rope = _longrope(cfg)
    if rope is None:
        return []
    return [(f"rope_factors_{kind}.weight", (len(rope[f"{kind}_factor"]),), "rope") for kind in ("long", "short")]


def rope_factor_values(cfg: dict, name: str) -> Any:
    """float32 values of ``rope_factors_long.weight`` / ``rope_factors_short.weight``."""
    import numpy as np

    kind = name.removeprefix("rope_factors_").removesuffix(".weight")
    return np.array(_longrope(cfg)[f"{kind}_factor"], dtype=np.float32)


def block_plan(cfg: dict, blk: str, head_dim: int) -> list[tuple[str, tuple[int, ...], str]]:
    """One block's tensors in the converter's order (HF names sorted: input_layernorm, mlp.down_proj,
    mlp.gate_up_proj, post_attention_layernorm, self_attn.o_proj, self_attn.qkv_proj)."""
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    q_rows, kv_rows = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return [(blk + "attn_norm.weight", (hidden,), "norm"), (blk + "ffn_down.weight", (hidden, ffn), "weight"),
            (blk + "ffn_up.weight", (2 * ffn, hidden), "weight"), (blk + "ffn_norm.weight", (hidden,), "norm"),
            (blk + "attn_output.weight", (hidden, q_rows), "weight"),
            (blk + "attn_qkv.weight", (q_rows + 2 * kv_rows, hidden), "weight")]


def add_metadata(writer: Any, cfg: dict, head_dim: int) -> None:
    """The ``phi3.*`` keys Phi3MiniModel writes beyond the common ones (see the module docstring)."""
    original = cfg["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(head_dim)
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if _longrope(cfg) is not None:
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def general_name(shape: str) -> str:
    """``general.name`` of a make-model file: ``{shape} (random weights)``, with ``phi3`` / ``phi-3``
    spelled ``phi 3``: llama.cpp gives a model so named Phi-3's special-token attributes by name
    (``<unk>``, ``<s>``, ``</s>``), which the embedded SmolLM2 vocabulary lacks, and then fails to load
    (``unordered_map::at``)."""
    return f"{shape.replace('phi3', 'phi 3').replace('phi-3', 'phi 3')} (random weights)"
