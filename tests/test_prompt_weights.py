"""``--prompt-weights form``: only the q4_1 / q8_0 forms are kept, each prompt matmul rebuilds its
weight from them (``dequant.c``), and a tied head's q8_0 form is also the embedding table.

For the embedded model (Q4_1 projections, Q8_0 embedding) the forms hold the GGUF's own blocks,
so the rebuilt weights are the reference's bit for bit and so are the answers."""

from __future__ import annotations

import random

import pytest
import torch

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.sampling import SamplingParams
from quanta.launch import PromptWeightsError, build_engine, load_model, resolve_dtype
from quanta.model.form_embedding import FormEmbedding
from quanta.model.linear import PackedLinear
from quanta.model.native import forms
from quanta.model.quant import quantize

pytestmark = pytest.mark.skipif(not forms.available(), reason="quanta's C kernels do not build here")
DTYPES = sorted({resolve_dtype(None), torch.float32}, key=str)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("shape", [(8, 32), (24, 96), (960, 576)])
def test_the_c_rebuild_is_the_forms_weight(kind, shape):
    gen = torch.Generator().manual_seed(shape[0])
    form = quantize(torch.randn(*shape, generator=gen) * 0.05, kind)
    exact = form.dequantize()
    assert torch.equal(forms.dense(kind, form.data, form.scales, torch.float32), exact)
    assert torch.equal(forms.dense(kind, form.data, form.scales, torch.bfloat16), exact.bfloat16())


@pytest.fixture(scope="module", params=DTYPES, ids=str)
def pair(request):
    """The embedded model loaded both ways in one dtype."""
    return (load_model(None, request.param, "auto"), load_model(None, request.param, "auto", prompt_weights="form"))


def test_only_the_forms_are_kept_and_they_rebuild_the_reference(pair):
    ref, lean = pair
    assert "rebuilt-from-form" in lean.kernels and "rebuilt-from-form" not in ref.kernels
    assert not list(lean.model.parameters()) or all(p.dim() == 1 for p in lean.model.parameters())  # norms only
    linears = [(a, b) for a, b in zip(ref.model.modules(), lean.model.modules()) if isinstance(a, PackedLinear)]
    assert len(linears) == 4 * ref.config.num_hidden_layers
    for a, b in linears:
        assert b.packed is None and "weight" not in b._parameters
        assert torch.equal(a.weight, b.weight)
    assert isinstance(lean.model.embed_tokens, FormEmbedding)
    ids = torch.tensor([0, 1, 7, 8, 9, 1000, ref.config.vocab_size - 1, 8])
    assert torch.equal(lean.model.embed_tokens(ids), ref.model.embed_tokens(ids))


def test_a_prompt_rows_result_does_not_depend_on_the_rows_beside_it(pair):
    _, lean = pair
    gen = torch.Generator().manual_seed(3)
    for lin in (lean.model.layers[0].self_attn.qkv_proj, lean.model.layers[0].mlp.down_proj):
        x = torch.randn(70, lin.in_features, generator=gen).to(lean.model.dtype)
        full = lin(x)
        for rows in (1, 2, 3, 5, 17, 64):
            assert torch.equal(lin(x[:rows]), full[:rows]), rows


def _answers(loaded, prompts):
    engine = build_engine(loaded, EngineConfig(max_model_len=1024), SchedulerConfig(max_num_seqs=4))
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0)) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.output_token_ids for s in seqs]


def test_the_answers_are_the_references(pair):
    ref, lean = pair
    rng = random.Random(5)
    prompts = [ref.tokenizer.encode("The capital of France is")] + [[rng.randrange(1000, 40000) for _ in range(n)] for n in (90, 300)]
    got = _answers(lean, prompts)
    assert all(len(a) == 12 for a in got)
    assert got == _answers(ref, prompts)


def test_sampling_never_rebuilds_the_embedding_table(pair, monkeypatch):
    _, lean = pair

    def rebuilt(self):
        raise AssertionError("the whole embedding table was rebuilt")

    monkeypatch.setattr(FormEmbedding, "weight", property(rebuilt))
    hidden = torch.randn(2, lean.config.hidden_size).to(lean.model.dtype)
    assert lean.model.compute_logits(hidden).shape == (2, lean.config.vocab_size)
    assert len(_answers(lean, [[5, 6, 7, 8]])[0]) == 12  # prefill, then decode steps, sampling each


def test_a_model_without_a_c_form_is_refused():
    with pytest.raises(PromptWeightsError, match="--prompt-weights form needs q4_1 or q8_0"):
        load_model(None, torch.float32, "int8", prompt_weights="form")
