"""A GGUF MoE's routed experts served from the file's own blocks (quanta/model/gguf_expert_blocks.py),
against the same file dequantized to float32 (the reference loader), on make-model's tiny-qwen3moe
(16 experts, 4 a token, an F32 router): the same experts' outputs for the same routing, up to the
8-bit activation rounding of the block kernels, and no float copy of an expert kept."""

from __future__ import annotations

import pytest
import torch

from quanta.model.attention import AttentionBatch
from quanta.model.config import ModelConfig
from quanta.model.gguf_blocks import load_block_model, unsupported_reason
from quanta.model.llama import LlamaModel
from quanta.model.loader import load_checkpoint, load_config
from quanta.model.native import forms
from quanta.model.quant import quantize
from quanta.tools.make_model import write_direct
from slot_cache import SlotCache, logits_in_chunks

pytestmark = pytest.mark.skipif(not forms.available(), reason="quanta's C kernels do not build here")

#: the relative error of an expert's output each file's forms allow: F16 is computed in float32
#: (the fp16 values exactly), Q8_0 / Q4_K_M with 8-bit activations per block of 32 (~0.5% a product)
BOUND = {"F16": 1e-5, "Q8_0": 0.03, "Q4_K_M": 0.03}


@pytest.fixture(scope="module", params=sorted(BOUND))
def pair(request, tmp_path_factory):
    path = write_direct("tiny-qwen3moe", tmp_path_factory.mktemp("moe") / f"moe-{request.param}.gguf",
                        request.param, progress=lambda _: None)
    cfg, state = load_checkpoint(path)
    ref = LlamaModel(cfg)
    ref.load_hf_state_dict(state)
    return request.param, path, ref.eval(), load_block_model(path, load_config(path), torch.float32)


def test_experts_are_forms_not_float_weights(pair):
    qtype, path, ref, blocks = pair
    experts = [m.mlp.experts for m in blocks.layers]
    assert all(len(e.forms) == 2 and "gate_up_proj" not in e._parameters for e in experts)
    assert all(p.dim() <= 2 and p.numel() <= 16 * 2048 for p in blocks.parameters())  # norms and routers only
    assert blocks.weight_bytes() < 1.3 * path.stat().st_size
    assert blocks.weight_count() == ref.weight_count()  # the forms' weights counted, as parameters are
    assert "from-blocks" in blocks.describe_kernels()


def test_each_expert_computes_its_own_rows(pair):
    """Every layer's experts on the same tokens and the same routing as the dequantized file's: a
    wrong expert order, gate/up swapped or a wrong block decoding moves outputs by ~100%."""
    qtype, _, ref, blocks = pair
    x = torch.randn(24, ref.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for ref_layer, layer in zip(ref.layers, blocks.layers, strict=True):
        ids, weights = ref_layer.mlp.gate(x)
        torch.testing.assert_close(layer.mlp.gate(x)[0], ids)  # the router is the file's float32 one
        want, active = ref_layer.mlp.experts(x, ids, weights)
        got, active_blocks = layer.mlp.experts(x, ids, weights)
        assert active_blocks == active
        assert ((got - want).norm() / want.norm()).item() < BOUND[qtype]


def test_a_float_file_gives_the_reference_logits(pair):
    qtype, _, ref, blocks = pair
    if qtype != "F16":
        pytest.skip("quantized files round activations: expert choices may flip at near ties")
    ids = torch.randint(0, ref.config.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits_in_chunks(blocks, ids, [48]), logits_in_chunks(ref, ids, [48]), atol=2e-3, rtol=0)


def test_a_form_part_is_its_rows():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    for kind in ("q4_1", "q8_0", "fp16"):
        form = quantize(w, kind)
        torch.testing.assert_close(form.part(8, 24).dequantize(), form.dequantize()[8:24], atol=0, rtol=0)
    with pytest.raises(ValueError, match="multiples of 8"):
        quantize(w, "q8_0").part(4, 12)


def test_moe_architectures_without_a_checked_blocks_path_keep_the_dequantizing_loader(tmp_path):
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, architecture="mixtral", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64)
    assert unsupported_reason(cfg, tmp_path / "unused.gguf").startswith("MoE experts of mixtral")


def test_one_call_for_all_experts_gives_each_expert_its_own_bits(pair):
    """The routed experts' one C call (block_matmul_experts) against each expert's rows of the form
    called alone, row groups in any expert order, bf16 and float32 rows."""
    qtype, _, _, blocks = pair
    experts = blocks.layers[0].mlp.experts
    gate_up, down = experts.forms
    if not gate_up.native:
        pytest.skip(f"{qtype}: fp16 experts are called one by one")
    width = 2 * experts.intermediate
    groups = [(3, 5), (0, 7), (15, 1), (9, 11)]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(24, experts.hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
        got, start = gate_up.experts(x, width, groups), 0
        for e, n in groups:
            assert torch.equal(got[start:start + n], gate_up.part(e * width, (e + 1) * width)(x[start:start + n]))
            start += n
    with pytest.raises(ValueError):
        gate_up.experts(x, width, [(16, 24)])  # no 17th expert


def test_decode_steps_run_the_native_decoder_with_every_matmul_in_c(pair):
    """An MoE from blocks takes the native decoder (q/k head norms in its attention glue, the MoE block
    for the MLP): every matmul of a decode step and of a prompt step is a C form, so the C pool gets
    the step's threads and torch 1 for decode."""
    from quanta.model import native
    from quanta.model.cores import default_threads

    _, _, _, blocks = pair
    try:
        assert blocks.enable_native_decode() == "native"
        assert blocks.native.covers() and blocks.native.prompts_covered()
        lib = native.load()
        lib.pool_set_threads(1)
        assert blocks.native.claim_threads(True, 2) == 1 and lib.pool_threads() == blocks.native.tuner.current
        assert blocks.native.claim_threads(False, 2) == 2 and lib.pool_threads() == default_threads()
    finally:
        blocks.native = None


def test_a_blocks_model_on_torchs_decode_path_gives_the_c_pool_its_threads(pair):
    """A blocks model without a native decoder (Gemma's norms; here one switched off) runs torch's
    path, every matmul a C form, so the executor gives the C pool its threads (it starts on 1) and
    torch 1 for decode steps."""
    from quanta.engine import model_executor
    from quanta.model import native
    from quanta.model.cores import default_threads

    _, _, _, blocks = pair
    executor = model_executor.ModelExecutor(blocks, num_blocks=4)
    assert blocks.native is None and executor._blocks
    lib = native.load()
    lib.pool_set_threads(1)
    assert model_executor._c_pool_carries(True, 2) == 1 and lib.pool_threads() == default_threads()
    assert model_executor._c_pool_carries(False, 2) == 2


def test_native_decode_steps_agree_with_torchs_path(pair):
    """The same decode rows through the native decoder's C glue and through torch's path (the same C
    forms for every matmul): logits within float32 rounding of the glue (norms, RoPE, attention)
    and the 8-bit activations it may tip."""
    _, _, ref, blocks = pair
    cfg = blocks.config
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n + 3,), generator=gen) for n in (11, 30, 2)]
    kv = SlotCache(cfg.num_hidden_layers, len(prompts), cfg.num_key_value_heads, 64, cfg.head_dim, torch.float32)
    for slot, p in enumerate(prompts):
        blocks(p[:-3], AttentionBatch([kv.seq(slot, 0, len(p) - 3)], kv))
    try:
        assert blocks.enable_native_decode() == "native"
        for step in range(3):
            batch = AttentionBatch([kv.seq(s, len(p) - 3 + step, 1) for s, p in enumerate(prompts)], kv, decode=True)
            ids = torch.stack([p[len(p) - 3 + step] for p in prompts])
            decoder, blocks.native = blocks.native, None
            torch_path = blocks.compute_logits(blocks(ids, batch))  # writes the same cache rows again
            blocks.native = decoder
            native_path = blocks.compute_logits(blocks(ids, batch))
            # ~1e-6..1e-5 observed: an 8-bit activation rounded the other way now and then; without the
            # q/k head norms in the C glue ~1
            assert ((native_path - torch_path).norm() / torch_path.norm()).item() < 1e-4
    finally:
        blocks.native = None


def test_a_prompt_rows_logits_do_not_depend_on_chunking(pair):
    """The router too: its float32 weight goes through the C kernel (a torch matmul's row moved with
    the rows beside it and flipped near-tied experts between chunkings)."""
    _, _, ref, blocks = pair
    ids = torch.randint(0, ref.config.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    assert torch.equal(logits_in_chunks(blocks, ids, [7, 13, 19, 1]), logits_in_chunks(blocks, ids, [40]))


@pytest.mark.parametrize("k", [64, 61])
def test_a_float32_weight_takes_the_row_by_row_kernel(k):
    w = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(6))
    got = forms.f16_matmul(x, w)
    torch.testing.assert_close(got, x @ w.T, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(forms.f16_matmul(x[r:r + 1], w), got[r:r + 1]) for r in range(9))
    torch.testing.assert_close(forms.f16_matmul(x.bfloat16(), w).float(), (x.bfloat16().float() @ w.T), atol=0.05, rtol=0.01)
