"""MoE checkpoint loading: GGUF (llama.cpp's merged ``*_exps`` tensors) and the
two HF layouts (per-expert tensors as saved by transformers, and v5's fused
3-D ``experts.gate_up_proj``) all give the same canonical state and logits."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from quanta.model.attention import AttentionBatch
from quanta.model.llama import LlamaModel
from quanta.model.loader import load_checkpoint
from slot_cache import SlotCache

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "mixtral": (MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2), gguf.MODEL_ARCH.LLAMA),
    "qwen3_moe": (Qwen3MoeConfig(**TINY, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True), gguf.MODEL_ARCH.QWEN3MOE),
    "qwen2_moe": (Qwen2MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48), gguf.MODEL_ARCH.QWEN2MOE),
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF q/k row permutation for the llama architecture."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_moe_gguf(model, arch: gguf.MODEL_ARCH, path: Path) -> None:
    """F32 GGUF as llama.cpp's converter lays MoE out: experts merged into [E, I, H] tensors."""
    cfg = model.config
    name = gguf.MODEL_ARCH_NAMES[arch]
    w = gguf.GGUFWriter(path, name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if hasattr(cfg, "moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        weights = tensor.numpy()
        i = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if hf_name.endswith("experts.gate_up_proj"):  # transformers v5 in memory: [E, 2I, H]
            gate, up = np.split(weights, 2, axis=1)
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if hf_name.endswith("experts.down_proj"):
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", weights)
            continue
        if arch == gguf.MODEL_ARCH.LLAMA and (".q_proj." in hf_name or ".k_proj." in hf_name):
            weights = _permute(weights, cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads)
        if hf_name.endswith("shared_expert_gate.weight"):
            weights = weights[0]  # llama.cpp stores it as a vector
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(weights))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    cfg, state = load_checkpoint(path)
    model = LlamaModel(cfg)
    model.load_hf_state_dict(state)
    kv = SlotCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 64, cfg.head_dim, torch.float32)
    return model.compute_logits(model(ids, AttentionBatch([kv.seq(0, 0, len(ids))], kv)))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    hf_cfg, arch = CONFIGS[request.param]
    ref = AutoModelForCausalLM.from_config(hf_cfg).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path / "hf")
    _write_moe_gguf(ref, arch, path / "m.gguf")
    return request.param, ref, path


def test_gguf_moe_matches_hf_directory(saved):
    name, ref, path = saved
    cfg_hf, state_hf = load_checkpoint(path / "hf")
    cfg_gguf, state_gguf = load_checkpoint(path / "m.gguf")
    assert cfg_gguf.architecture == name
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size", "shared_expert_gate", "router_scoring"):
        assert getattr(cfg_gguf, field) == getattr(cfg_hf, field), field
    assert state_gguf.keys() == state_hf.keys()
    for k in state_hf:
        torch.testing.assert_close(state_gguf[k], state_hf[k], msg=k)
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(_logits(path / "m.gguf", ids), expected, atol=1e-4, rtol=0)


def test_fused_v5_layout_loads_like_per_expert_layout(saved, tmp_path):
    """A directory holding ``mlp.experts.gate_up_proj`` [E, 2I, H] loads the same as per-expert tensors."""
    name, ref, path = saved
    cfg, canonical = load_checkpoint(path / "hf")
    (tmp_path / "config.json").write_bytes((path / "hf" / "config.json").read_bytes())
    save_file({k: v.contiguous() for k, v in canonical.items()}, tmp_path / "model.safetensors")
    cfg2, state2 = load_checkpoint(tmp_path)
    assert any(k.endswith("experts.gate_up_proj") and v.dim() == 3 for k, v in state2.items())
    for k in canonical:
        torch.testing.assert_close(state2[k], canonical[k], msg=k)


def test_missing_expert_is_an_error(saved, tmp_path):
    name, ref, path = saved
    state = {k: v for k, v in load_file(path / "hf" / "model.safetensors").items() if ".experts.1." not in k}
    (tmp_path / "config.json").write_bytes((path / "hf" / "config.json").read_bytes())
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="experts"):
        load_checkpoint(tmp_path)
