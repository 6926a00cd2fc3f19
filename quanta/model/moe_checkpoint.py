"""MoE checkpoints: config fields, tensor names and shapes (HF directories and GGUF).

Every MoE checkpoint is brought to one canonical naming, per MoE layer
``model.layers.{i}.mlp.``:

- ``gate.weight`` ``[E, H]`` (router), ``gate.e_score_correction_bias`` ``[E]``
  (sigmoid routers only);
- ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``
  (transformers v5's fused layout);
- ``shared_expert.{gate,up,down}_proj.weight`` and ``shared_expert_gate.weight``
  ``[1, H]`` where the architecture has them.

Sources: Mixtral's ``block_sparse_moe.experts.{j}.w1/w3/w2`` (gate/up/down),
Qwen/OLMoE/dots1's ``mlp.experts.{j}.{gate,up,down}_proj``, dots1's
``shared_experts``, and llama.cpp's GGUF names (``ffn_gate_inp``,
``ffn_{gate,up,down}_exps``, ``ffn_*_shexp``, ``ffn_gate_inp_shexp``,
``exp_probs_b``) with metadata ``{arch}.expert_count``,
``expert_used_count``, ``expert_feed_forward_length``, ... as written by
llama.cpp's ``convert_hf_to_gguf.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from quanta.model.config import ModelConfig

#: a loaded checkpoint: HF tensor name -> tensor (the one definition, here below
#: :mod:`quanta.model.checkpoint_schema`, which builds on this module and gives it to the loaders)
StateDict = dict[str, torch.Tensor]

#: GGUF ``general.architecture`` -> ModelConfig.architecture for MoE models
#: (Mixtral GGUFs say ``llama`` and are recognised by ``llama.expert_count``).
GGUF_MOE_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "dots1": "dots1"}

#: GGUF per-block MoE tensor stems -> canonical module paths (before stacking/fusing).
GGUF_MOE_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "exp_probs_b": "mlp.gate.e_score_correction",
}

_LEGACY_EXPERT = re.compile(r"(model\.layers\.\d+\.)(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_moe_fields(arch: str, hf: dict) -> dict[str, Any]:
    """ModelConfig keyword arguments of an HF MoE ``config.json`` (``model_type`` ``arch``)."""
    layers = hf["num_hidden_layers"]
    experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf.get("moe_intermediate_size") or hf["intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
    }
    if arch == "mixtral":
        fields["norm_topk_prob"] = True  # MixtralTopKRouter always renormalizes
    elif arch == "olmoe":
        fields |= {"qk_norm_full": True, "clip_qkv": hf.get("clip_qkv")}
    elif arch in ("qwen2_moe", "qwen3_moe"):
        step = hf.get("decoder_sparse_step", 1) or 1
        only = set(hf.get("mlp_only_layers") or [])
        fields["dense_layers"] = [i for i in range(layers) if i in only or (i + 1) % step]
        if arch == "qwen2_moe":
            fields |= {"shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0), "shared_expert_gate": True}
    elif arch == "dots1":
        fields |= {
            "shared_expert_intermediate_size": fields["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
            "router_scoring": "sigmoid",
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "router_n_group": hf.get("n_group") or 1,
            "router_topk_group": hf.get("topk_group") or 1,
            "dense_layers": list(range(hf.get("first_k_dense_replace") or 0)),
        }
    return fields


def gguf_moe_fields(field: Callable[[str], Any], arch: str) -> dict[str, Any]:
    """ModelConfig keyword arguments from GGUF MoE metadata.

    Args:
        field: ``key -> value or None`` for ``{gguf_arch}.<key>`` metadata.
        arch: the ModelConfig architecture (``mixtral`` for a llama-arch GGUF with experts).
    """
    experts = field("expert_count")
    ffn = field("expert_feed_forward_length") or field("feed_forward_length")
    gating = field("expert_gating_func")  # llama.cpp: 1 softmax, 2 sigmoid
    norm = field("expert_weights_norm")
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": field("expert_used_count"),
        "moe_intermediate_size": ffn,
        # llama.cpp's defaults per architecture when the key is absent
        "norm_topk_prob": bool(norm) if norm is not None else arch in ("mixtral", "qwen3_moe"),
        "router_scoring": "sigmoid" if gating == 2 or (gating is None and arch == "dots1") else "softmax",
        "routed_scaling_factor": float(field("expert_weights_scale") or 1.0),
    }
    shared = field("expert_shared_feed_forward_length")
    if shared is None and field("expert_shared_count"):
        shared = ffn * field("expert_shared_count")
    if shared:
        fields |= {"shared_expert_intermediate_size": shared, "shared_expert_gate": arch == "qwen2_moe"}
    dense = field("leading_dense_block_count")
    if dense:
        fields["dense_layers"] = list(range(dense))
    if arch == "olmoe":
        fields["qk_norm_full"] = True
    return fields


def canonicalize(state: StateDict, config: ModelConfig) -> StateDict:
    """Rename and stack the MoE tensors of ``state`` (in place) into the canonical layout."""
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name in list(state):
        match = _LEGACY_EXPERT.fullmatch(name)
        if match is not None:
            prefix, expert, proj = match.groups()
            per_expert.setdefault((prefix, _MIXTRAL_PROJ.get(proj, proj)), {})[int(expert)] = state.pop(name)
        elif ".block_sparse_moe." in name:
            state[name.replace(".block_sparse_moe.", ".mlp.")] = state.pop(name)
        elif ".mlp.shared_experts." in name:
            state[name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")] = state.pop(name)
        elif name.endswith(".mlp.gate.e_score_correction.bias"):
            state[name.removesuffix(".bias") + "_bias"] = state.pop(name)
        elif name.endswith(".mlp.shared_expert_gate.weight") and state[name].dim() == 1:
            state[name] = state[name][None, :]
    for (prefix, proj), tensors in per_expert.items():
        if sorted(tensors) != list(range(config.num_experts)):
            raise ValueError(f"{prefix}experts: found experts {sorted(tensors)[:8]}..., expected 0..{config.num_experts - 1}")
        state[f"{prefix}mlp.experts.{proj}"] = torch.stack([tensors[j] for j in range(config.num_experts)])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate = state.pop(p + "gate_proj", None)
        if gate is None:
            gate = state.pop(p + "gate_proj.weight", None)  # GGUF 3-D tensors carry .weight
        if gate is not None:
            up = state.pop(p + "up_proj", None)
            if up is None:
                up = state.pop(p + "up_proj.weight")
            state[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        down = state.pop(p + "down_proj.weight", None)
        if down is not None:
            state[p + "down_proj"] = down
    return state


def moe_layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of the MoE tensors of layer ``layer``."""
    p, h = f"model.layers.{layer}.mlp.", config.hidden_size
    e, i = config.num_experts, config.moe_intermediate_size
    shapes = {p + "gate.weight": (e, h), p + "experts.gate_up_proj": (e, 2 * i, h), p + "experts.down_proj": (e, h, i)}
    if config.router_scoring == "sigmoid":
        shapes[p + "gate.e_score_correction_bias"] = (e,)
    s = config.shared_expert_intermediate_size
    if s:
        shapes |= {p + "shared_expert.gate_proj.weight": (s, h), p + "shared_expert.up_proj.weight": (s, h),
                   p + "shared_expert.down_proj.weight": (h, s)}
        if config.shared_expert_gate:
            shapes[p + "shared_expert_gate.weight"] = (1, h)
    return shapes
