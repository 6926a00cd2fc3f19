"""A loaded model holds each projection once: the plain weight is freed where oneDNN's packed
copy holds it, and a tied head's packed copy once the head has a form; the answers stay the same
to the bit and ``weight`` still reads the plain values."""

from __future__ import annotations

import torch

from quanta.launch import load_model, resolve_quantization
from quanta.model.linear import PackedLinear
from quanta.model.llama import LlamaModel
from quanta.model.loader import embedded_model_path, load_checkpoint


def _kept_model() -> LlamaModel:
    """The embedded model loaded as :func:`load_model` loads it, less the freeing."""
    path = embedded_model_path()
    cfg, state = load_checkpoint(path)
    model = LlamaModel(cfg)
    model.load_hf_state_dict(state)
    model.to(torch.float32).eval()
    model.pack_weights()
    model.quantize_weights(*resolve_quantization("auto", path, False))
    return model


def test_freed_weights_answer_the_same_and_read_the_same():
    model = _kept_model()
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m.packed is not None]
    assert linears  # oneDNN packs fp32 weights wherever torch has it
    gen = torch.Generator().manual_seed(0)
    rows = {id(m): torch.randn(5, m.in_features, generator=gen) for m in linears}
    before = {id(m): (m.weight.detach().clone(), m(rows[id(m)]), m(rows[id(m)][:1], True)) for m in linears}
    hidden = torch.randn(3, model.config.hidden_size, generator=gen)
    logits = model.compute_logits(hidden)
    freed = model.drop_plain_weights()
    assert freed == len(linears) + (model.lm_head is None and model.lm_head_form is not None)
    for m in linears:
        weight, prompt, decode = before[id(m)]
        assert "weight" not in m._parameters
        assert torch.equal(m.weight, weight)
        assert torch.equal(m(rows[id(m)]), prompt)
        assert torch.equal(m(rows[id(m)][:1], True), decode)
    assert torch.equal(model.compute_logits(hidden), logits)
    assert model.drop_plain_weights() == 0  # nothing left to free


def test_load_model_frees_them():
    loaded = load_model(None, torch.float32, "auto")
    names = {n for n, _ in loaded.model.named_parameters()}
    assert not any(n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight"))
                   for n in names)
    assert "embed_tokens.weight" in names  # the embedding is still read as a table
