"""The model shapes ``quanta make-model --shape`` writes, and the tensors each one's GGUF holds.

A shape (:data:`SHAPES`) is the subset of the model's Hugging Face ``config.json`` that decides
the file; :func:`tensor_plan` lists its tensors as llama.cpp's ``convert_hf_to_gguf.py`` writes
that architecture (``LlamaModel`` for Llama and Mistral, ``Qwen2Model``, ``Qwen3Model``, ``Qwen3MoeModel``).
"""

from __future__ import annotations

from typing import Any

from quanta.tools import gemma_shapes, phi3_shapes


def _llama3_rope(factor: float, original: int = 8192) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original}


_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 131072}

_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "head_dim": 128, "rope_theta": 1000000.0,
          "rms_norm_eps": 1e-6, "max_position_embeddings": 40960}

#: the toy width of the test shapes: SmolLM2's vocabulary plus 128 reserved tokens
_TINY = {"vocab_size": 49152 + 128, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}

#: name -> the ``config.json`` keys of the real model that decide its GGUF
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True, "rope_scaling": _llama3_rope(32.0)},
    "llama-3.2-3b": {**_LLAMA3, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
                     "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True, "rope_scaling": _llama3_rope(32.0)},
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "tie_word_embeddings": False, "rope_scaling": _llama3_rope(8.0)},
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "tie_word_embeddings": False},
    "qwen3-30b-a3b": {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "tie_word_embeddings": False},
    # for tests: Llama 3.x layout (rope_freqs, tied embeddings) at toy width; SmolLM2's vocabulary plus 128 reserved tokens;
    # an original context of 64 so that the rope_freqs factors turn positions below 100 (Llama 3's 8192 would not)
    "tiny-llama3": {**_LLAMA3, "vocab_size": 49152 + 128, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True,
                    "max_position_embeddings": 8192, "rope_scaling": _llama3_rope(8.0, 64)},
    # for tests, each architecture's own parts at toy width: Mistral (llama layout, no rope_freqs, untied head),
    # Qwen2 (q/k/v biases), Qwen3 (q/k RMS norms, head_dim wider than hidden / heads)
    "tiny-mistral": {**_TINY, "architectures": ["MistralForCausalLM"], "head_dim": 32, "tie_word_embeddings": False,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-5},
    "tiny-qwen2": {**_TINY, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True, "rope_theta": 1000000.0,
                   "rms_norm_eps": 1e-6},
    "tiny-qwen3": {**_TINY, "architectures": ["Qwen3ForCausalLM"], "head_dim": 64, "tie_word_embeddings": True,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    # Qwen3-MoE (Qwen3's attention; every block's MLP 16 routed experts of which 4 run; untied head as Qwen3-30B-A3B's)
    "tiny-qwen3moe": {**_TINY, "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 64, "moe_intermediate_size": 192,
                      "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True, "tie_word_embeddings": False,
                      "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}

#: llama.cpp's GGUF architecture of each HF ``architectures[0]``
_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe"}
_GGUF_ARCH["Gemma3ForCausalLM"] = "gemma3"
#: Gemma 3 1B and tiny-gemma3 (four norms a block, sliding windows): :mod:`quanta.tools.gemma_shapes`
SHAPES.update(gemma_shapes.GEMMA3_SHAPES)
_GGUF_ARCH["Phi3ForCausalLM"] = "phi3"
#: Phi-3.5-mini and tiny-phi3 (fused attn_qkv and gate/up ffn_up, LongRoPE): :mod:`quanta.tools.phi3_shapes`
SHAPES.update(phi3_shapes.PHI3_SHAPES)


def shape_config(name: str, layers: int | None = None) -> dict:
    """Shape ``name``'s config dict, with ``layers`` decoder blocks when given.

    Raises:
        ValueError: unknown shape or a layer count below 1.
    """
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of: {', '.join(SHAPES)}")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers must be positive, got {layers}")
    return {**SHAPES[name], "num_hidden_layers": layers or SHAPES[name]["num_hidden_layers"]}


def gguf_arch(cfg: dict) -> str:
    return _GGUF_ARCH[cfg["architectures"][0]]


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def llama3_rope_factors(cfg: dict) -> Any:
    """The ``rope_freqs.weight`` values (float32 array of ``head_dim / 2``) for a ``llama3``
    ``rope_scaling``, computed as ``LlamaModel.generate_extra_tensors`` in llama.cpp's
    converter computes them (float32 torch arithmetic); None for other RoPE."""
    import math

    import torch

    rope = cfg.get("rope_scaling") or {}
    if rope.get("rope_type", "").lower() != "llama3":
        return None
    base, dim = cfg.get("rope_theta", 10000.0), head_dim(cfg)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor, high_freq_factor = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def tensor_plan(cfg: dict) -> list[tuple[str, tuple[int, ...], str, Any]]:
    """``(GGUF name, numpy shape, kind, numpy dtype)`` of every tensor in writing order (the converter's:
    ``rope_freqs`` first, then HF's alphabetical order within a block); kinds: ``rope``, ``norm``,
    ``embedding``, ``output_norm``, ``output``, ``weight``, ``bias``, ``router``. A numpy shape is ``(rows, columns)``
    (``(experts, rows, columns)`` for stacked experts); GGUF lists it reversed. The dtype: float16 for a matrix,
    float32 for a vector and for the router ``ffn_gate_inp`` (kept F32 by the converter and ``llama-quantize``)."""
    import numpy as np

    hidden, dim = cfg["hidden_size"], head_dim(cfg)
    q_rows, kv_rows = cfg["num_attention_heads"] * dim, cfg["num_key_value_heads"] * dim
    arch = gguf_arch(cfg)
    bias = arch == "qwen2"  # Qwen2's q/k/v projections always carry a bias
    plan: list[tuple[str, tuple[int, ...], str]] = []
    if (rope := llama3_rope_factors(cfg)) is not None:
        plan.append(("rope_freqs.weight", rope.shape, "rope"))
    plan += phi3_shapes.rope_factor_plan(cfg)
    plan.append(("token_embd.weight", (cfg["vocab_size"], hidden), "embedding"))
    for i in range(cfg["num_hidden_layers"]):
        blk = f"blk.{i}."
        if arch == "gemma3":
            plan += gemma_shapes.block_plan(cfg, blk, dim)
            continue
        if arch == "phi3":
            plan += phi3_shapes.block_plan(cfg, blk, dim)
            continue
        plan += [(blk + "attn_norm.weight", (hidden,), "norm"), *_ffn_plan(cfg, blk), (blk + "ffn_norm.weight", (hidden,), "norm")]
        for proj, rows in (("k", kv_rows), ("output", hidden), ("q", q_rows), ("v", kv_rows)):
            if arch in ("qwen3", "qwen3moe") and proj in ("q", "k"):  # Qwen3's per-head q/k RMS norms (k_norm sorts before k_proj)
                plan.append((f"{blk}attn_{proj}_norm.weight", (dim,), "norm"))
            if bias and proj != "output":
                plan.append((f"{blk}attn_{proj}.bias", (rows,), "bias"))
            plan.append((f"{blk}attn_{proj}.weight", (rows, hidden if proj != "output" else q_rows), "weight"))
    plan.append(("output_norm.weight", (hidden,), "output_norm"))
    if not cfg["tie_word_embeddings"]:
        plan.append(("output.weight", (cfg["vocab_size"], hidden), "output"))
    return [(name, shape, kind, np.dtype(np.float16 if len(shape) > 1 and kind != "router" else np.float32))
            for name, shape, kind in plan]


def _ffn_plan(cfg: dict, blk: str) -> list[tuple[str, tuple[int, ...], str]]:
    """A block's MLP tensors: ``ffn_down`` / ``ffn_gate`` / ``ffn_up``, or for a shape with ``num_experts`` the
    experts stacked into 3-D ``ffn_{down,gate,up}_exps`` (the converter stacks them when a block's last expert
    arrives, before ``mlp.gate`` sorts in) and the router ``ffn_gate_inp``."""
    hidden = cfg["hidden_size"]
    if not cfg.get("num_experts"):
        ffn = cfg["intermediate_size"]
        return [(blk + "ffn_down.weight", (hidden, ffn), "weight"), (blk + "ffn_gate.weight", (ffn, hidden), "weight"),
                (blk + "ffn_up.weight", (ffn, hidden), "weight")]
    experts, ffn = cfg["num_experts"], cfg["moe_intermediate_size"]
    return [(blk + "ffn_down_exps.weight", (experts, hidden, ffn), "weight"),
            (blk + "ffn_gate_exps.weight", (experts, ffn, hidden), "weight"),
            (blk + "ffn_up_exps.weight", (experts, ffn, hidden), "weight"),
            (blk + "ffn_gate_inp.weight", (experts, hidden), "router")]


def parameter_count(cfg: dict) -> int:
    """Weights of the model (``rope_freqs`` is not one)."""
    import math

    return sum(math.prod(shape) for _, shape, kind, _ in tensor_plan(cfg) if kind != "rope")
