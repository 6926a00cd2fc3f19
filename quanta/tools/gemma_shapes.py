"""The ``gemma3`` shapes of ``quanta make-model`` and what llama.cpp's converter (``Gemma3Model`` in
its ``conversion/gemma.py``) writes for them beyond the Llama layout.

- tensors: per block, in HF's alphabetical order, ``attn_norm`` (input_layernorm), ``ffn_down``,
  ``ffn_gate``, ``ffn_up``, ``post_attention_norm``, ``post_ffw_norm``, ``ffn_norm``
  (pre_feedforward_layernorm), ``attn_k_norm``, ``attn_k``, ``attn_output``, ``attn_q_norm``,
  ``attn_q``, ``attn_v``; the head is tied (no ``output``). The converter stores every norm as
  ``1 + w``; random norms around 1 stand for that;
- keys: ``gemma3.attention.key_length`` / ``value_length`` (``head_dim``), a linear
  ``rope.scaling.type`` / ``factor`` where the config has one (the 4B and larger: 8, global
  layers only), ``rope.freq_base_swa`` (``rope_local_base_freq``) and
  ``attention.sliding_window``. No sliding-window pattern key: llama.cpp takes 6 (five local
  layers, then a global one).
"""

from __future__ import annotations

from typing import Any

_GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "tie_word_embeddings": True}

GEMMA3_SHAPES: dict[str, dict] = {
    "gemma-3-1b": {**_GEMMA3, "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
                   "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
                   "sliding_window": 512, "max_position_embeddings": 32768},
    # for tests: Gemma 3's block (four norms, q/k norms, GELU) at toy width, heads wider than hidden / heads as Gemma's;
    # six layers (0-4 local, 5 global), a window of 32 so the 8 prompts + 64 tokens of the agreement test run past it,
    # and the 4B's linear RoPE factor 8 on the global layer (the local ones rotate unscaled with base 10000)
    "tiny-gemma3": {**_GEMMA3, "vocab_size": 49152 + 128, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 6,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "query_pre_attn_scalar": 64,
                    "sliding_window": 32, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
}


def block_plan(cfg: dict, blk: str, head_dim: int) -> list[tuple[str, tuple[int, ...], str]]:
    """One block's tensors in the converter's order (see the module docstring)."""
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    q_rows, kv_rows = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return [(blk + "attn_norm.weight", (hidden,), "norm"), (blk + "ffn_down.weight", (hidden, ffn), "weight"),
            (blk + "ffn_gate.weight", (ffn, hidden), "weight"), (blk + "ffn_up.weight", (ffn, hidden), "weight"),
            (blk + "post_attention_norm.weight", (hidden,), "norm"), (blk + "post_ffw_norm.weight", (hidden,), "norm"),
            (blk + "ffn_norm.weight", (hidden,), "norm"), (blk + "attn_k_norm.weight", (head_dim,), "norm"),
            (blk + "attn_k.weight", (kv_rows, hidden), "weight"), (blk + "attn_output.weight", (hidden, q_rows), "weight"),
            (blk + "attn_q_norm.weight", (head_dim,), "norm"), (blk + "attn_q.weight", (q_rows, hidden), "weight"),
            (blk + "attn_v.weight", (kv_rows, hidden), "weight")]


def add_metadata(writer: Any, cfg: dict) -> None:
    """The ``gemma3.*`` keys beyond the common ones (the module docstring)."""
    import gguf

    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_freq_base_swa(cfg["rope_local_base_freq"])
    if cfg.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(cfg["sliding_window"])
