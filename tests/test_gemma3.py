"""Gemma 3 (``quanta.model.gemma``) against transformers' ``Gemma3ForCausalLM``, and the reading of
``gemma3`` GGUF metadata.

The reference is a tiny random Gemma 3 (six layers: five sliding, one global; a window of 8
positions, far shorter than the 40-token sequences; linear RoPE factor 8 on the global layer, base
10000 unscaled on the others; a query scalar other than ``head_dim``, as the 27B's). Its weights
are scaled up from transformers' initialisation (projections ``1 / sqrt(fan_in)``, norms
``N(0, 0.2)`` around Gemma's ``1 + w``) so every part moves the logits. quanta computes the same
sequences in prompt chunks of several sizes, and as a prompt followed by decode rows (the padded
decode attention, with its window mask); float32 logits agree within 1e-4.

Decode rows are also checked against llama.cpp: the stored tiny-gemma3 outputs of
``tests/test_agreement_llama_cpp.py`` (sequences past the window of 32), each continuation token
fed as a decode step (the 8 sequences' rows decoded together), under that test's rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from quanta.model import gemma
from quanta.model.attention import AttentionBatch, KVCache, SeqSlice, blocks_for
from quanta.model.config import ModelConfig
from quanta.model.llama import LlamaModel
from quanta.model.loader import load_config
from quanta.model.native import forms
from quanta.tools import agreement
from quanta.tools.make_model import write_direct
from slot_cache import SlotCache
from test_agreement_llama_cpp import DATA, failures, tolerance

LAYERS, WINDOW, SCALAR = 6, 8, 48
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=True)
#: transformers' norm name -> quanta's (Llama names for the pre-norms; the block's pre-MLP norm is post_attention_layernorm)
NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attn_norm",
         "pre_feedforward_layernorm": "post_attention_layernorm", "post_feedforward_layernorm": "post_mlp_norm"}


def hf_model() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**SHAPE, sliding_window=WINDOW, query_pre_attn_scalar=SCALAR, attn_implementation="eager",
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def our_config() -> ModelConfig:
    return ModelConfig(architecture="gemma3", **SHAPE, qk_norm=True, rope_theta=1e6,
                       rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=WINDOW,
                       sliding_layers=gemma.sliding_layers(LAYERS, 6), rope_local_base_freq=10000.0,
                       query_pre_attn_scalar=SCALAR)


def our_model(ref: Gemma3ForCausalLM) -> LlamaModel:
    """quanta's Gemma of ``ref``'s weights, renamed, norms stored as ``1 + w`` (as llama.cpp's converter does)."""
    state = {}
    for name, t in ref.state_dict().items():
        if name == "lm_head.weight":
            continue
        for theirs, ours in NORMS.items():
            name = name.replace(f".{theirs}.", f".{ours}.")
        state[name] = t + 1 if name.endswith("norm.weight") else t
    model = LlamaModel(our_config())
    model.load_hf_state_dict(state)
    return model.eval()


@pytest.fixture(scope="module")
def pair():
    ref = hf_model()
    return ref, our_model(ref)


def run(model: LlamaModel, ids: torch.Tensor, chunks: list[int], decode_from: int | None = None) -> torch.Tensor:
    """Logits of every position of ``ids``: prompt chunks of ``chunks`` tokens, then (from ``decode_from``)
    one decode row a step."""
    cfg = model.config
    kv = SlotCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 128, cfg.head_dim, torch.float32)
    steps = chunks + ([1] * (len(ids) - decode_from) if decode_from is not None else [])
    out, start = [], 0
    for i, n in enumerate(steps):
        batch = AttentionBatch([kv.seq(0, start, n)], kv, decode=i >= len(chunks))
        out.append(model.compute_logits(model(ids[start:start + n], batch)))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(("chunks", "decode_from"), [([40], None), ([16, 24], None), ([1] * 8 + [32], None),
                                                     ([7, 13, 19, 1], None), ([12], 12)])
def test_logits_match_transformers(pair, chunks, decode_from):
    ref, ours = pair
    ids = torch.randint(0, SHAPE["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = run(ours, ids, chunks, decode_from)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_the_window_and_local_rope_matter(pair):
    """The reference differs from a model without windows, and from one whose local layers rotate as the global."""
    ref, ours = pair
    ids = torch.randint(0, SHAPE["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    for change in ({"sliding_window": 0}, {"rope_local_base_freq": None}):
        cfg = our_config()
        for key, value in change.items():
            setattr(cfg, key, value)
        other = LlamaModel(cfg).eval()
        other.load_state_dict(ours.state_dict())
        assert (run(other, ids, [40]) - expected).abs().max() > 0.1, change


def test_native_decode_is_refused_for_gemma(pair):
    _, ours = pair
    assert ours.enable_native_decode().startswith("torch (")
    assert ours.native is None


def test_gguf_fields_follow_llama_cpp():
    keys = {"attention.sliding_window": 512, "rope.freq_base_swa": 10000.0}
    fields = gemma.gguf_fields(keys.get, 26, 1152, 4)
    assert fields["sliding_layers"] == [i for i in range(26) if i % 6 != 5]
    assert fields["sliding_window"] == 512 and fields["rope_local_base_freq"] == 10000.0
    assert "query_pre_attn_scalar" not in fields and fields["final_logit_softcapping"] is None
    assert gemma.gguf_fields(keys.get, 62, 5376, 32)["query_pre_attn_scalar"] == 168  # the 27B: hidden / heads
    assert gemma.gguf_fields({}.get, 26, 1152, 4)["sliding_layers"] == []  # no window: every layer global
    flags = {**keys, "attention.sliding_window_pattern": [True, False, True]}
    assert gemma.gguf_fields(flags.get, 3, 64, 4)["sliding_layers"] == [0, 2]
    with pytest.raises(ValueError, match="lists 3 layers"):
        gemma.gguf_fields(flags.get, 4, 64, 4)


def test_softcap():
    logits = torch.tensor([-100.0, 0.0, 3.0])
    assert torch.equal(gemma.softcap(logits, None), logits)
    torch.testing.assert_close(gemma.softcap(logits, 30.0), 30.0 * torch.tanh(logits / 30.0))


def test_make_model_file_reads_back_and_both_load_paths_agree(tmp_path: Path):
    """make-model's tiny-gemma3 GGUF: its metadata reads back as Gemma 3's fields, and the model built from
    the F16 file's blocks agrees with the one the dequantizing loader builds from the F32 file (same values)."""
    f16 = write_direct("tiny-gemma3", tmp_path / "g-F16.gguf", "F16", progress=lambda _: None)
    cfg = load_config(f16)
    assert (cfg.architecture, cfg.sliding_window, cfg.sliding_layers) == ("gemma3", 32, [0, 1, 2, 3, 4])
    assert cfg.rope_local_base_freq == 10000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.query_pre_attn_scalar is None
    if not forms.available():
        pytest.skip("no C kernels: both files take the dequantizing path")
    f32 = write_direct("tiny-gemma3", tmp_path / "g-F32.gguf", "F32", progress=lambda _: None)
    # float32 compute, as the agreement tests: a bf16 host's default would round the F32 file's weights to bf16
    blocks, dequantized = (agreement.load_as_served(f, torch.float32) for f in (f16, f32))
    assert "from-blocks" in blocks.kernels and "from-blocks" not in dequantized.kernels
    tokens = list(range(1000, 1080))  # 80 positions: past the window of 32
    a, b = (agreement.position_logprobs(m, tokens, 1) for m in (blocks, dequantized))
    assert (a - b).abs().max() < 0.02  # observed 0.003: fp16 weights either way, summation order differs


def decode_logprobs(loaded, cases: list[dict]) -> list[torch.Tensor]:
    """Per case, the log-softmax after each of ``tokens[first - 1:]``: every case's prompt in one prompt
    step, then each further token as a decode row, the cases' rows decoded together (one step a position)."""
    model, cfg = loaded.model, loaded.config
    per = blocks_for(max(len(c["tokens"]) for c in cases), 16)
    kv = KVCache(cfg.num_hidden_layers, len(cases) * per, cfg.num_key_value_heads, 16, cfg.head_dim, torch.float32)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(cases))]
    firsts = [c["first"] for c in cases]
    prompts = torch.tensor([t for c in cases for t in c["tokens"][:c["first"]]])
    hidden = model(prompts, AttentionBatch([SeqSlice(tables[i], 0, f) for i, f in enumerate(firsts)], kv))
    rows = [[h] for h in hidden[torch.tensor(firsts).cumsum(0) - 1]]
    for step in range(min(len(c["tokens"]) - c["first"] for c in cases)):
        ids = torch.tensor([c["tokens"][c["first"] + step] for c in cases])
        batch = AttentionBatch([SeqSlice(tables[i], f + step, 1) for i, f in enumerate(firsts)], kv, decode=True)
        for i, h in enumerate(model(ids, batch)):
            rows[i].append(h)
    return [torch.log_softmax(model.compute_logits(torch.stack(r)).float(), dim=-1) for r in rows]


def test_decode_rows_agree_with_stored_llama_cpp_outputs(tmp_path: Path):
    if not forms.available():
        pytest.skip("quanta's C kernels do not build here (the served model then takes other forms)")
    record = json.loads((DATA / "tiny-gemma3-Q8_0.json").read_text())
    spec = record["file"]
    path = write_direct(spec["shape"], tmp_path / "g.gguf", spec["type"], spec["seed"], spec["layers"], progress=lambda _: None)
    loaded = agreement.load_as_served(path, torch.float32)  # as test_agreement_llama_cpp's bounds assume
    assert all(len(c["tokens"]) > 32 + 8 for c in record["cases"])  # past the window
    results = [agreement.compare(c["top"], logprobs, tolerance(record)["max_diff"])
               for c, logprobs in zip(record["cases"], decode_logprobs(loaded, record["cases"]), strict=True)]
    summary = agreement.summarize(results)
    assert summary["positions"] == 8 * 64
    assert not failures(summary, record), summary


@pytest.mark.parametrize("model_type", ["gemma3", "gemma3_text"])
def test_hugging_face_gemma_directories_are_refused_in_one_line(tmp_path: Path, model_type: str):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 256}))
    with pytest.raises(ValueError, match="Gemma 3 is read from GGUF files only"):
        load_config(tmp_path)


def test_sequences_of_different_lengths_share_steps(pair):
    """Two sequences (lengths 30 and 17, past and near the window) prefilled in one step and decoded together
    give each one's logits alone: the windows follow each row's own position."""
    ref, ours = pair
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen) for n in (30, 17)]
    alone = [run(ours, ids, [len(ids) - 6], len(ids) - 6) for ids in seqs]
    cfg = ours.config
    kv = SlotCache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 64, cfg.head_dim, torch.float32)
    starts = [len(ids) - 6 for ids in seqs]
    hidden = ours(torch.cat([ids[:n] for ids, n in zip(seqs, starts, strict=True)]),
                  AttentionBatch([kv.seq(i, 0, n) for i, n in enumerate(starts)], kv))
    firsts = torch.tensor(starts).cumsum(0) - 1
    together = [[row] for row in ours.compute_logits(hidden[firsts])]
    for step in range(6):
        ids = torch.stack([s[n + step] for s, n in zip(seqs, starts, strict=True)])
        batch = AttentionBatch([kv.seq(i, n + step, 1) for i, n in enumerate(starts)], kv, decode=True)
        for i, row in enumerate(ours.compute_logits(ours(ids, batch))):
            together[i].append(row)
    for mine, solo in zip(together, alone, strict=True):
        torch.testing.assert_close(torch.stack(mine), solo[-7:], atol=1e-5, rtol=0)  # positions n - 1 .. n + 5
