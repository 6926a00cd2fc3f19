"""quanta's model against the reference implementation in transformers.

Tolerances: fp32 logits agree within 1e-4 absolute on tiny random models
(observed ~1e-6; summation order differs), and within 2e-3 on SmolLM2 (30
layers of the same fp32 arithmetic in another order).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from quanta.model.attention import AttentionBatch
from quanta.model.llama import LlamaModel
from quanta.model.loader import embedded_model_path
from slot_cache import SlotCache
from tiny_llama import LLAMA3_ROPE, TINY, load_ours

CONFIGS = {
    "llama": LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama-rope-llama3": LlamaConfig(**TINY, rope_scaling=LLAMA3_ROPE),
    "qwen2": Qwen2Config(**TINY, tie_word_embeddings=False),
    "qwen3": Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=False),
}


def _run_chunks(model: LlamaModel, ids: torch.Tensor, chunks: list[int], slot: int = 0) -> torch.Tensor:
    """Logits of every position of ``ids`` computed in successive chunks of one sequence."""
    cfg = model.config
    kv = SlotCache(cfg.num_hidden_layers, slot + 1, cfg.num_key_value_heads, 128, cfg.head_dim, torch.float32)
    out, start = [], 0
    for n in chunks:
        hidden = model(ids[start:start + n], AttentionBatch([kv.seq(slot, start, n)], kv))
        out.append(model.compute_logits(hidden))
        start += n
    return torch.cat(out)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf_cfg = CONFIGS[request.param]
    ref = AutoModelForCausalLM.from_config(hf_cfg).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, load_ours(path)


@pytest.mark.parametrize("chunks", [[40], [16, 24], [1] * 8 + [32], [7, 13, 19, 1]])
def test_tiny_logits_match_transformers(tiny_pair, chunks):
    ref, ours = tiny_pair
    ids = torch.randint(0, ref.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = _run_chunks(ours, ids, chunks)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_mixed_batch_matches_separate_runs(tiny_pair):
    """Prompt chunks of one token and of several, in several slots, in one forward equal separate runs."""
    ref, ours = tiny_pair
    gen = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(0, ref.config.vocab_size, (n,), generator=gen) for n in (20, 9, 31))
    with torch.no_grad():
        ra, rb, rc = (ref(x[None]).logits[0] for x in (a, b, c))
    cfg = ours.config
    kv = SlotCache(cfg.num_hidden_layers, 5, cfg.num_key_value_heads, 128, cfg.head_dim, torch.float32)
    ours(a[:19], AttentionBatch([kv.seq(4, 0, 19)], kv))
    ours(c[:30], AttentionBatch([kv.seq(1, 0, 30)], kv))
    ours(b[:4], AttentionBatch([kv.seq(2, 0, 4)], kv))
    # slots 4 and 1 compute one more token, slot 2 five: one fused step.
    batch = AttentionBatch([kv.seq(4, 19, 1), kv.seq(2, 4, 5), kv.seq(1, 30, 1)], kv)
    logits = ours.compute_logits(ours(torch.cat([a[19:], b[4:], c[30:]]), batch))
    torch.testing.assert_close(logits[0], ra[19], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1:6], rb[4:], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[6], rc[30], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def smollm2_pair():
    path = embedded_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return ref, load_ours(path)


def test_smollm2_gguf_logits_match_transformers(smollm2_pair):
    ref, ours = smollm2_pair
    ids = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(_run_chunks(ours, ids, [48]), expected, atol=2e-3, rtol=0)
    torch.testing.assert_close(_run_chunks(ours, ids, [20, 27, 1]), expected, atol=2e-3, rtol=0)


def test_dense_equal_length_decode_matches_reference(tiny_pair):
    """Three sequences decoding at the same position through the PyTorch decode path."""
    ref, ours = tiny_pair
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, ref.config.vocab_size, (12,), generator=gen) for _ in range(3)]
    with torch.no_grad():
        expected = [ref(p[None]).logits[0, -1] for p in prompts]
    cfg = ours.config
    kv = SlotCache(cfg.num_hidden_layers, 3, cfg.num_key_value_heads, 128, cfg.head_dim, torch.float32)
    for slot, p in enumerate(prompts):
        ours(p[:11], AttentionBatch([kv.seq(slot, 0, 11)], kv))
    batch = AttentionBatch([kv.seq(slot, 11, 1) for slot in range(3)], kv, decode=True)
    logits = ours.compute_logits(ours(torch.stack([p[11] for p in prompts]), batch))
    for row, exp in zip(logits, expected):
        torch.testing.assert_close(row, exp, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_decode_attention_reads_each_row_through_its_block_table(dtype):
    """The PyTorch decode path over ragged rows whose blocks are scattered through the pool
    equals plain softmax attention over each row's own positions; the positions past a row's
    length (NaN here, as uninitialized memory may be) do not reach its output."""
    from quanta.model.attention import _attend_decode

    gen = torch.Generator().manual_seed(3)
    kv = SlotCache(2, 4, 2, 40, 8, dtype, block_size=8)
    lengths = {0: 31, 2: 8, 3: 20}
    for layer in range(2):
        for slot, n in lengths.items():
            for pos in range(n):
                block, off = kv.blocks(slot)[pos // 8], pos % 8
                kv.k[layer][block, :, off] = torch.randn(2, 8, generator=gen).to(dtype)
                kv.v[layer][block, :, off] = torch.randn(2, 8, generator=gen).to(dtype)
    batch = AttentionBatch([kv.seq(slot, n - 1, 1) for slot, n in lengths.items()], kv, decode=True)
    q = torch.randn(3, 4, 8, generator=gen).to(dtype)
    for layer in range(2):
        got = _attend_decode(q, kv.k[layer], kv.v[layer], batch)
        for row, (slot, n) in enumerate(lengths.items()):
            blocks = kv.blocks(slot)
            keys = torch.stack([kv.k[layer][blocks[p // 8], :, p % 8] for p in range(n)], dim=1).float().repeat_interleave(2, dim=0)
            values = torch.stack([kv.v[layer][blocks[p // 8], :, p % 8] for p in range(n)], dim=1).float().repeat_interleave(2, dim=0)
            weights = torch.softmax(q[row].float()[:, None, :] @ keys.transpose(1, 2) / 8 ** 0.5, dim=-1)
            expected = (weights @ values)[:, 0]
            torch.testing.assert_close(got[row].float(), expected, atol=2e-3 if dtype == torch.float32 else 5e-2, rtol=0)
