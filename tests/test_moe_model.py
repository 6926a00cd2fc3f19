"""MoE models against transformers: tiny random Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE and dots1 (DeepSeek-style sigmoid router with shared expert).

Tolerance: fp32 logits agree within 1e-4 absolute (observed ~2e-7), in one
chunk and in several chunks, as for the dense models in test_model.py. Norm
weights and the router's selection bias are randomized so that a misplaced
norm or bias cannot hide behind an all-ones / all-zeros init.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Dots1Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from quanta.model.attention import AttentionBatch
from quanta.model.llama import LlamaModel
from quanta.model.loader import load_checkpoint
from quanta.model.moe import MoEBlock, RoutedExperts
from slot_cache import SlotCache, logits_in_chunks

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "mixtral": MixtralConfig(**TINY, num_local_experts=6, num_experts_per_tok=2),
    "qwen2_moe": Qwen2MoeConfig(**TINY, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen3_moe": Qwen3MoeConfig(**TINY, head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, decoder_sparse_step=2),
    "olmoe": OlmoeConfig(**{**TINY, "intermediate_size": 32}, num_experts=8, num_experts_per_tok=2, clip_qkv=3.0,
                         eos_token_id=2),
    "dots1": Dots1Config(**TINY, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
                         routed_scaling_factor=2.5, sliding_window=None),
}


def _randomize(model) -> None:
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def _ours(path) -> LlamaModel:
    cfg, state = load_checkpoint(path)
    model = LlamaModel(cfg)
    model.load_hf_state_dict(state)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe_pair(request, tmp_path_factory):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(CONFIGS[request.param]).eval()
    _randomize(ref)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, _ours(path)


def test_moe_layers_follow_config(moe_pair):
    ref, ours = moe_pair
    kinds = [type(layer.mlp).__name__ for layer in ours.layers]
    expected = ["MoEBlock" if hasattr(layer.mlp, "experts") else "MLP" for layer in ref.model.layers]
    assert kinds == expected
    assert "MoEBlock" in kinds


@pytest.mark.parametrize("chunks", [[40], [16, 24], [1] * 8 + [32], [7, 13, 19, 1]])
def test_moe_logits_match_transformers(moe_pair, chunks):
    ref, ours = moe_pair
    ids = torch.randint(0, ref.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(logits_in_chunks(ours, ids, chunks), expected, atol=1e-4, rtol=0)


def test_moe_mixed_batch_matches_separate_runs(moe_pair):
    """Prefill chunks and decodes of several slots routed together equal separate runs."""
    ref, ours = moe_pair
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randint(0, ref.config.vocab_size, (n,), generator=gen) for n in (20, 9))
    with torch.no_grad():
        ra, rb = (ref(x[None]).logits[0] for x in (a, b))
    cfg = ours.config
    kv = SlotCache(cfg.num_hidden_layers, 3, cfg.num_key_value_heads, 128, cfg.head_dim, torch.float32)
    ours(a[:19], AttentionBatch([kv.seq(2, 0, 19)], kv))
    ours(b[:4], AttentionBatch([kv.seq(0, 0, 4)], kv))
    logits = ours.compute_logits(ours(torch.cat([a[19:], b[4:]]), AttentionBatch([kv.seq(2, 19, 1), kv.seq(0, 4, 5)], kv)))
    torch.testing.assert_close(logits[0], ra[19], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1:], rb[4:], atol=1e-4, rtol=0)


def test_bf16_packed_experts_match_a_per_token_loop():
    """The grouped, oneDNN-packed bf16 path equals a naive per-token float32 loop over the same bf16 weights."""
    gen = torch.Generator().manual_seed(3)
    experts = RoutedExperts(16, 64, 48)
    with torch.no_grad():
        experts.gate_up_proj.copy_(0.1 * torch.randn(experts.gate_up_proj.shape, generator=gen))
        experts.down_proj.copy_(0.1 * torch.randn(experts.down_proj.shape, generator=gen))
    experts.to(torch.bfloat16)
    experts.pack()
    x = torch.randn(30, 64, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(30)])
    weights = torch.rand(30, 4, generator=gen)
    with torch.inference_mode():
        got, active = experts(x, ids, weights)
    gu, dn = experts.gate_up_proj.float(), experts.down_proj.float()
    expected = torch.zeros(30, 64)
    for t in range(30):
        for j in range(4):
            e = int(ids[t, j])
            g, u = (gu[e] @ x[t].float()).split(48)
            expected[t] += weights[t, j] * (dn[e] @ (torch.nn.functional.silu(g) * u))
    assert active == len(set(ids.flatten().tolist()))
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def test_bf16_moe_model_runs_and_tracks_fp32(moe_pair):
    """The whole bf16 model (packed weights) stays close to fp32 on the logits' argmax."""
    ref, ours = moe_pair
    ids = torch.randint(0, ref.config.vocab_size, (24,), generator=torch.Generator().manual_seed(4))
    fp32 = logits_in_chunks(ours, ids, [24])
    bf16 = LlamaModel(ours.config)
    bf16.load_state_dict(ours.state_dict())
    bf16.to(torch.bfloat16).eval()
    bf16.pack_weights()
    cfg = ours.config
    kv = SlotCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 128, cfg.head_dim, torch.bfloat16)
    got = bf16.compute_logits(bf16(ids, AttentionBatch([kv.seq(0, 0, 24)], kv)))
    assert torch.isfinite(got).all()
    agree = (got.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    assert agree >= 0.75, agree
    assert any(isinstance(layer.mlp, MoEBlock) for layer in bf16.layers)
