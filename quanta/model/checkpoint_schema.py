"""The tensor-name schema every loader produces: Hugging Face Llama naming.

A loaded checkpoint is a float32 state dict named as in HF Llama
(``model.layers.{i}.self_attn.q_proj.weight`` ...), every 2-D weight in the
``[out_features, in_features]`` layout of ``torch.nn.Linear``; MoE layers use
the canonical names of :mod:`quanta.model.moe_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

from quanta.model import gemma, moe_checkpoint
from quanta.model.config import ModelConfig
from quanta.model.moe_checkpoint import StateDict  # what every loader returns

__all__ = ["StateDict", "check_tensors", "expected_shapes"]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor a checkpoint for ``config`` holds.

    MoE layers use the canonical names of :mod:`quanta.model.moe_checkpoint`.
    """
    hidden, q_out = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_out, ffn = config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
        }
        if config.is_moe_layer(i):
            shapes |= moe_checkpoint.moe_layer_shapes(config, i)
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (ffn, hidden),
                p + "mlp.up_proj.weight": (ffn, hidden),
                p + "mlp.down_proj.weight": (hidden, ffn),
            }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
        if config.qk_norm or config.qk_norm_full:
            full = config.qk_norm_full
            shapes |= {
                p + "self_attn.q_norm.weight": (q_out if full else config.head_dim,),
                p + "self_attn.k_norm.weight": (kv_out if full else config.head_dim,),
            }
        shapes |= gemma.layer_shapes(config, i)
    return shapes


def check_tensors(config: ModelConfig, state: StateDict, path: Path) -> None:
    """Check that ``state`` has exactly the names and shapes of :func:`expected_shapes`.

    Raises:
        ValueError: a tensor is missing, unexpected or wrongly shaped
            (the message names ``path``).
    """
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"{path}: tensors do not match a {config.architecture} model; "
            f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(state[name].shape)}, config implies {shape}"
            )
