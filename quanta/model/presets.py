"""Synthetic model instances for cost experiments (``quanta make-model``).

A preset is an HF ``config.json`` dict; :func:`make_model` fills it with
random weights (normal, std 0.02, norms 1, as transformers initializes; the
embedding std 1, see :func:`make_model`) and
writes an HF directory (``config.json``, ``model.safetensors`` in bf16, the
embedded SmolLM2 tokenizer) that ``quanta serve --model DIR`` and
``quanta profile`` load like any checkpoint. The outputs of such a model are
meaningless; only its shape and therefore its cost are real. Every config is
labelled with ``quanta_synthetic`` and every report repeats the label.

``seed-moe-mini`` keeps the seed study's routing proportions (256 routed
experts, 6 per token, 1 shared expert; DeepSeek-style sigmoid router with
renormalized weights, as the ``dots1`` architecture) and scales width and
depth down to fit a 2-core, 24 GiB machine: 4 layers of width 512, 4 query
heads of 64 (attention kept small so the experts' cost shows), routed
experts of width 256 (~0.4 B parameters, ~0.8 GB in bf16). Per layer its
experts hold 256 * 3 * 512 * 256 * 2 B = 201 MB, which a chunk of Q tokens
reads almost whole once Q * 6 / 256 >= 3 (E x (1 - (1 - K/E)^Q) > 243).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

SYNTHETIC_LABEL = "random weights for cost experiments (quanta make-model --preset {name}); outputs are meaningless"

_SMOLLM2_VOCAB = 49152
_COMMON = {
    "vocab_size": _SMOLLM2_VOCAB, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "attention_bias": False,
}

PRESETS: dict[str, dict] = {
    "seed-moe-mini": {
        "model_type": "dots1", "architectures": ["Dots1ForCausalLM"], **_COMMON,
        "hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 16384,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "first_k_dense_replace": 0,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "sliding_window": None,
    },
    "mixtral-mini": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **_COMMON,
        "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 16384,
        "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None,
    },
    "tiny-moe": {
        "model_type": "dots1", "architectures": ["Dots1ForCausalLM"], **_COMMON,
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 1, "first_k_dense_replace": 0,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "sliding_window": None,
    },
}


def preset_config(name: str) -> dict:
    """The labelled HF ``config.json`` dict of preset ``name``.

    Raises:
        ValueError: unknown preset.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return {**PRESETS[name], "quanta_synthetic": SYNTHETIC_LABEL.format(name=name), "quanta_preset": name,
            "torch_dtype": "bfloat16"}


def _shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a preset config (per-expert layout, as transformers saves it)."""
    from quanta.model.checkpoint_schema import expected_shapes  # canonical shapes of the config
    from quanta.model.hf_loader import hf_config

    config = hf_config(cfg, {}, Path(cfg.get("quanta_preset", "preset")))
    shapes = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("experts.gate_up_proj"):
            e, two_i, h = shape
            for j in range(e):
                shapes[name.replace("gate_up_proj", f"{j}.gate_proj.weight")] = (two_i // 2, h)
                shapes[name.replace("gate_up_proj", f"{j}.up_proj.weight")] = (two_i // 2, h)
        elif name.endswith("experts.down_proj"):
            e, h, i = shape
            for j in range(e):
                shapes[name.replace("down_proj", f"{j}.down_proj.weight")] = (h, i)
        elif ".shared_expert." in name and cfg["model_type"] == "dots1":
            shapes[name.replace(".shared_expert.", ".shared_experts.")] = shape
        else:
            shapes[name] = shape
    return shapes


def make_model(name: str, out: str | Path, seed: int = 0) -> Path:
    """Write preset ``name`` with random bf16 weights and the embedded tokenizer to ``out``.

    Returns:
        the directory written.

    Raises:
        ValueError: unknown preset, or ``out`` exists and is not an empty directory.
    """
    cfg = preset_config(name)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    tokenizer = _embedded_tokenizer()
    cfg |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for tensor_name, shape in _shapes(cfg).items():
        if "norm" in tensor_name:
            state[tensor_name] = torch.ones(shape, dtype=torch.bfloat16)
        elif tensor_name.endswith("e_score_correction_bias"):
            state[tensor_name] = torch.zeros(shape, dtype=torch.bfloat16)
        elif tensor_name == "model.embed_tokens.weight":
            # std 1 (not 0.02): the residual stream stays token-specific through
            # every layer, so routers route each token differently, as the
            # load-balanced routers of trained MoE models do (with std 0.02 the
            # attention outputs' common component dominates and a few experts
            # take most tokens).
            state[tensor_name] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        else:
            state[tensor_name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt", "quanta_synthetic": cfg["quanta_synthetic"]})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    return out


def parameter_count(name: str) -> int:
    """Parameters of preset ``name`` (all experts counted)."""
    return sum(math.prod(s) for s in _shapes(preset_config(name)).values())


def _embedded_tokenizer():
    """The HF tokenizer of the embedded SmolLM2 GGUF (converted once, then cached)."""
    from quanta.model.loader import embedded_model_path
    from quanta.model.tokenizer import Tokenizer

    return Tokenizer.from_path(embedded_model_path())._hf
