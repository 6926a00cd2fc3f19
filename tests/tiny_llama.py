"""Tiny random Llama-family shapes and quanta's loading of a saved transformers model, for the model tests."""

from __future__ import annotations

from quanta.model.llama import LlamaModel
from quanta.model.loader import load_checkpoint

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
#: Llama 3.1's band-wise RoPE scaling, at a length the tiny models reach
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def load_ours(path) -> LlamaModel:
    """quanta's model of the checkpoint at ``path``, in eval mode."""
    cfg, state = load_checkpoint(path)
    model = LlamaModel(cfg)
    model.load_hf_state_dict(state)
    return model.eval()
