"""Architecture hyper-parameters shared by every loader and the model code."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Architectures the dense Llama-family model implements.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(slots=True)
class ModelConfig:
    """Shape of a dense Llama-family decoder.

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
        rope_scaling: HF ``rope_scaling`` dict (``rope_type`` ``linear`` or
            ``llama3``) or None.
        max_position_embeddings: trained context length in tokens.
        tie_word_embeddings: the LM head reuses ``embed_tokens``.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        bos_token_id / eos_token_ids: special ids from the checkpoint.
        name: human-readable model name (served as the model id).
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

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
