"""Architecture hyper-parameters shared by every loader and the model code."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Dense Llama-family architectures.
DENSE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
#: Mixture-of-Experts architectures: Llama-family attention, an MoE block in
#: place of the MLP (see :mod:`quanta.model.moe`). ``dots1`` is the
#: DeepSeek-style block (sigmoid scoring, shared expert) with Qwen3 attention.
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "dots1")
#: Architectures the model implements.
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES


@dataclass(slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder, dense or Mixture-of-Experts.

    Field names follow Hugging Face's ``config.json`` (``LlamaConfig``) so an
    HF directory maps one to one; GGUF metadata is translated into them.

    Attributes:
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
        vocab_size: number of token ids (rows of the embedding).
        hidden_size: model width (d_model).
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: decoder blocks.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA when fewer than query heads).
        head_dim: per-head width; ``hidden_size // num_attention_heads`` unless the
            config says otherwise (Qwen3 does).
        rms_norm_eps: epsilon of RMSNorm.
        rope_theta: RoPE base frequency.
        rope_scaling: HF ``rope_scaling`` dict (``rope_type`` ``linear``, ``llama3``,
            ``yarn``, or ``freq_factors`` for GGUF ``rope_freqs``; see
            :mod:`quanta.model.rope`) or None.
        max_position_embeddings: trained context length in tokens, the default
            context cap (GGUF ``context_length``: for YaRN files the scaled one,
            not ``rope.scaling.original_context_length``).
        tie_word_embeddings: the LM head reuses ``embed_tokens``.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        bos_token_id / eos_token_ids: special ids from the checkpoint.
        name: human-readable model name (served as the model id).
        qk_norm_full: q/k RMSNorm spans the whole projection
            (``heads * head_dim``) instead of each head (OLMoE).
        clip_qkv: clamp q, k, v to ``[-clip_qkv, clip_qkv]`` (OLMoE), or None.
        sliding_window: positions a sliding layer's query sees, its own included
            (query ``p`` sees keys ``p - sliding_window < j <= p``); 0 for none.
        sliding_layers: the layers with that window (Gemma 3: five of every six).
        rope_local_base_freq: RoPE base of the sliding layers, unscaled (Gemma 3's
            10000); None: they rotate as the global layers.
        query_pre_attn_scalar: attention scores are scaled by its inverse square
            root; None means ``head_dim`` (the usual ``1 / sqrt(head_dim)``).
        final_logit_softcapping: logits become ``c * tanh(logits / c)``; None for none.

    MoE fields (all zero/defaults for a dense model):
        num_experts: routed experts per MoE layer (E); 0 means dense.
        num_experts_per_tok: routed experts per token (top-k, K).
        moe_intermediate_size: width of one routed expert's SwiGLU.
        shared_expert_intermediate_size: width of the always-on shared
            expert(s), 0 for none (Qwen2-MoE, DeepSeek/dots1).
        shared_expert_gate: the shared expert's output is scaled by
            ``sigmoid(x @ w)`` (Qwen2-MoE).
        router_scoring: ``softmax`` (Mixtral, Qwen, OLMoE) or ``sigmoid``
            (DeepSeek-V3 / dots1, with a selection bias and groups).
        norm_topk_prob: renormalize the K selected weights to sum to 1.
        routed_scaling_factor: multiplier of the routed weights (sigmoid routers).
        router_n_group / router_topk_group: group-limited top-k (DeepSeek-V3).
        dense_layers: layer indices that keep a dense MLP of
            ``intermediate_size`` (Qwen2-MoE ``mlp_only_layers``, dots1
            ``first_k_dense_replace``).
        synthetic: a label for random-weight cost-model instances written by
            ``quanta make-model`` (None for real checkpoints); reports repeat it.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    sliding_window: int = 0
    sliding_layers: list[int] = field(default_factory=list)
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_scoring: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    router_n_group: int = 1
    router_topk_group: int = 1
    dense_layers: list[int] = field(default_factory=list)
    synthetic: str | None = None

    @property
    def is_moe(self) -> bool:
        """True when at least one layer has routed experts."""
        return self.num_experts > 0 and len(self.dense_layers) < self.num_hidden_layers

    def is_moe_layer(self, layer: int) -> bool:
        """Layer ``layer`` runs an MoE block (else the dense SwiGLU MLP)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def window_of(self, layer: int) -> int:
        """The attention window of layer ``layer`` in positions; 0 for a global layer."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.num_experts_per_tok}")
            if self.router_scoring not in ("softmax", "sigmoid"):
                raise ValueError(f"router_scoring must be softmax or sigmoid, got {self.router_scoring!r}")
            if self.num_experts % self.router_n_group or not 0 < self.router_topk_group <= self.router_n_group:
                raise ValueError("router groups must divide num_experts and topk_group <= n_group")
