"""``quanta make-model --shape``: random-weight GGUFs of real model shapes, written as llama.cpp's
converter writes them (metadata, tensor names and types, Llama 3.x ``rope_freqs``) with the
embedded tokenizer padded to the shape's vocabulary. Nothing here needs ``llama-quantize``
(the one test that runs it is skipped where it is not built)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from quanta import cli
from quanta.model.loader import embedded_model_path, load_config
from quanta.tools import make_model as mm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("make_model") / "tiny.gguf"
    assert cli.main(["make-model", "--shape", "tiny-llama3", "--out", str(path), "--seed", "3"]) == 0
    return path


@pytest.fixture(scope="module")
def reader(tiny) -> gguf.GGUFReader:
    return gguf.GGUFReader(tiny)


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def test_real_shapes_have_the_published_parameter_and_tensor_counts() -> None:
    # parameter counts of the Hugging Face checkpoints; tensor counts of their convert_hf_to_gguf.py GGUFs
    expected = {"llama-3.2-1b": (1_235_814_400, 147), "llama-3.2-3b": (3_212_749_824, 255),
                "llama-3.1-8b": (8_030_261_248, 292), "qwen2.5-7b": (7_615_616_512, 339),
                "qwen3-8b": (8_190_735_360, 399),
                "qwen3-1.7b": (1_720_574_976, 310)}  # its card: 1.7 B, 1.4 B without the (tied) embedding
    for name, (params, tensors) in expected.items():
        cfg = mm.shape_config(name)
        assert (mm.parameter_count(cfg), len(mm.tensor_plan(cfg))) == (params, tensors), name


def test_tensor_plans_follow_each_architecture() -> None:
    qwen = {n: s for n, s, *_ in mm.tensor_plan(mm.shape_config("qwen2.5-7b"))}
    assert qwen["blk.0.attn_q.bias"] == (3584,) and qwen["blk.0.attn_k.bias"] == (512,) and "blk.0.attn_output.bias" not in qwen
    assert qwen["output.weight"] == (152064, 3584) and "rope_freqs.weight" not in qwen
    llama8 = {n: s for n, s, *_ in mm.tensor_plan(mm.shape_config("llama-3.1-8b", layers=2))}
    assert llama8["rope_freqs.weight"] == (64,) and llama8["output.weight"] == (128256, 4096)
    assert llama8["blk.1.attn_k.weight"] == (1024, 4096) and "blk.2.attn_q.weight" not in llama8
    llama1 = {n: s for n, s, *_ in mm.tensor_plan(mm.shape_config("llama-3.2-1b"))}
    assert "output.weight" not in llama1 and llama1["blk.15.ffn_down.weight"] == (2048, 8192)


def test_rope_freqs_are_transformers_llama3_factors() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    for name in ("tiny-llama3", "llama-3.2-1b", "llama-3.1-8b"):
        c = mm.shape_config(name)
        hf = LlamaConfig(hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"], head_dim=c.get("head_dim"),
                         max_position_embeddings=c["max_position_embeddings"],
                         rope_parameters={**c["rope_scaling"], "rope_theta": c["rope_theta"]})
        scaled, _ = _compute_llama3_parameters(hf)
        dim = hf.head_dim
        plain = 1.0 / (c["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        np.testing.assert_allclose(mm.llama3_rope_factors(c), (plain / scaled).numpy(), rtol=3e-7, err_msg=name)


def test_metadata_is_the_converters(reader) -> None:
    arch = "llama"
    expected = {
        "general.architecture": arch, "general.type": "model", "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
        f"{arch}.block_count": 2, f"{arch}.context_length": 8192, f"{arch}.embedding_length": 256,
        f"{arch}.feed_forward_length": 768, f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.key_length": 64, f"{arch}.attention.value_length": 64, f"{arch}.rope.dimension_count": 64,
        f"{arch}.rope.freq_base": 500000.0, f"{arch}.vocab_size": 49280,
    }
    assert {k: _field(reader, k) for k in expected} == expected
    assert _field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert "random weights" in _field(reader, "general.description")
    assert not any(k.startswith(f"{arch}.rope.scaling") for k in reader.fields)  # llama3 RoPE lives in rope_freqs


def test_a_large_padding_reserves_256_control_tokens_then_normal_ones() -> None:
    """As a real 128k vocabulary: a few hundred control tokens, not tens of thousands."""
    base = mm.tokenizer_size()
    keys = {k: v for k, v, *_ in mm.padded_tokenizer(base + 300)}
    tokens, types = keys["tokenizer.ggml.tokens"][base:], keys["tokenizer.ggml.token_type"][base:]
    assert tokens == [f"<|reserved_{i}|>" for i in range(256)] + [f"<pad_{i}>" for i in range(44)]
    assert types == [gguf.TokenType.CONTROL] * 256 + [gguf.TokenType.NORMAL] * 44


def test_tokenizer_is_the_embedded_one_padded_with_control_tokens(reader) -> None:
    embedded = gguf.GGUFReader(embedded_model_path())
    emb_keys = [k for k in embedded.fields if k.startswith("tokenizer.")]
    assert [k for k in reader.fields if k.startswith("tokenizer.")] == emb_keys
    for key in emb_keys:
        ours, theirs = _field(reader, key), embedded.fields[key].contents()
        assert reader.fields[key].types == embedded.fields[key].types, key
        if key == "tokenizer.ggml.tokens":
            assert ours == theirs + [f"<|reserved_{i}|>" for i in range(128)]
        elif key == "tokenizer.ggml.token_type":
            assert ours == theirs + [int(gguf.TokenType.CONTROL)] * 128
        else:
            assert ours == theirs, key


def test_tensors_match_the_shape(reader) -> None:
    cfg = mm.shape_config("tiny-llama3")
    plan = mm.tensor_plan(cfg)
    assert len(reader.tensors) == len(plan) == 1 + 1 + 2 * 9 + 1
    for t, (name, shape, *_) in zip(reader.tensors, plan, strict=True):
        assert t.name == name
        assert tuple(int(d) for d in t.shape) == shape[::-1], name  # GGUF lists dims innermost first
        want = gguf.GGMLQuantizationType.F16 if len(shape) > 1 else gguf.GGMLQuantizationType.F32
        assert t.tensor_type == want, name
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied embeddings
    by_name = {t.name: t for t in reader.tensors}
    np.testing.assert_array_equal(by_name["rope_freqs.weight"].data, mm.llama3_rope_factors(cfg))


def test_weight_scales(reader) -> None:
    data = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    embedding = data["token_embd.weight"]
    assert mm.tokenizer_size() == 49152 and embedding.shape == (49280, 256)
    assert embedding[:49152].std() == pytest.approx(mm.EMBEDDING_STD, rel=0.01)
    assert (embedding[49152:] == 0).all()  # reserved tokens: logit 0, never the top one
    assert data["blk.0.ffn_down.weight"].std() == pytest.approx(768 ** -0.5, rel=0.02)
    assert data["blk.1.attn_q.weight"].std() == pytest.approx(256 ** -0.5, rel=0.02)
    assert data["blk.0.attn_norm.weight"].std() == pytest.approx(mm.NORM_STD, rel=0.3)
    np.testing.assert_allclose(data["output_norm.weight"], mm.LOGIT_STD / (mm.EMBEDDING_STD * 16))


def test_quanta_loads_the_file(tiny) -> None:
    cfg = load_config(tiny)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == \
        ("llama", 49280, 256, 768, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == (4, 2, 64, True)
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 8192
    assert cfg.rope_scaling["freq_factors"] == pytest.approx(mm.llama3_rope_factors(mm.shape_config("tiny-llama3")).tolist())


def test_seed_and_layers(reader, tmp_path) -> None:
    """Each tensor's values depend on the seed and its name only: fewer layers keep the rest."""
    one = tmp_path / "one.gguf"
    mm.write_f16("tiny-llama3", one, seed=3, layers=1, progress=lambda _: None)
    b = gguf.GGUFReader(one)
    assert _field(b, "llama.block_count") == 1 and len(b.tensors) == 1 + 1 + 9 + 1
    full = {t.name: t.data for t in reader.tensors}
    for t in b.tensors:
        np.testing.assert_array_equal(t.data, full[t.name], err_msg=t.name)
    other = tmp_path / "other.gguf"
    mm.write_f16("tiny-llama3", other, seed=4, layers=1, progress=lambda _: None)
    c = {t.name: t.data for t in gguf.GGUFReader(other).tensors}
    assert not np.array_equal(c["blk.0.attn_q.weight"], full["blk.0.attn_q.weight"])


def test_flag_errors(tiny, tmp_path, capsys) -> None:
    assert cli.main(["make-model", "--shape", "tiny-llama3", "--out", str(tiny)]) == 2
    assert "exists" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["make-model", "--preset", "tiny-moe", "--type", "Q8_0", "--out", str(tmp_path / "d")])
    assert exc.value.code == 2 and "go with --shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["make-model", "--shape", "tiny-llama3", "--type", "Q9_9", "--out", str(tmp_path / "x.gguf")])
    with pytest.raises(SystemExit):
        cli.main(["make-model", "--shape", "tiny-llama3", "--preset", "tiny-moe", "--out", str(tmp_path / "x.gguf")])
    assert not list(tmp_path.iterdir())


def test_missing_llama_quantize_is_one_line_naming_the_build(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("QUANTA_PEER_CACHE", str(tmp_path / "peer"))
    out = tmp_path / "q.gguf"
    assert cli.main(["make-model", "--shape", "tiny-llama3", "--type", "q4_k_m", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "llama-quantize" in err and "benchmarks/peer_llama_cpp.py" in err and "cmake --build" in err
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.gguf"))


@pytest.mark.skipif(not (mm.llama_cpp_source() / "build" / "bin" / "llama-quantize").exists(), reason="llama-quantize not built")
def test_quantized_type_through_llama_quantize(tmp_path) -> None:
    out = tmp_path / "tiny-q8.gguf"
    mm.make_gguf("tiny-llama3", out, "Q8_0", progress=lambda _: None)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["rope_freqs.weight"] == gguf.GGMLQuantizationType.F32
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-q8.gguf"]  # the F16 intermediate is gone


def test_qwen3_moe_shapes_follow_the_converter() -> None:
    """Qwen3-30B-A3B: the Hugging Face checkpoint's parameter count, the converter's 579 tensors (12 a block)
    with the experts stacked as 3-D tensors and the router ffn_gate_inp kept in F32."""
    cfg = mm.shape_config("qwen3-30b-a3b")
    plan = mm.tensor_plan(cfg)
    assert (mm.parameter_count(cfg), len(plan)) == (30_532_122_624, 579)
    block = [(name.removeprefix("blk.47."), shape, dtype) for name, shape, _, dtype in plan if name.startswith("blk.47.")]
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    assert block == [("attn_norm.weight", (2048,), f32), ("ffn_down_exps.weight", (128, 2048, 768), f16),
                     ("ffn_gate_exps.weight", (128, 768, 2048), f16), ("ffn_up_exps.weight", (128, 768, 2048), f16),
                     ("ffn_gate_inp.weight", (128, 2048), f32), ("ffn_norm.weight", (2048,), f32),
                     ("attn_k_norm.weight", (128,), f32), ("attn_k.weight", (512, 2048), f16),
                     ("attn_output.weight", (2048, 4096), f16), ("attn_q_norm.weight", (128,), f32),
                     ("attn_q.weight", (4096, 2048), f16), ("attn_v.weight", (512, 2048), f16)]
    assert plan[-1][:2] == ("output.weight", (151936, 2048))  # untied


def test_tiny_qwen3_moe_file(tmp_path) -> None:
    """The MoE metadata keys, the converter's size label (16 experts x the weights outside them plus one expert's:
    12.82 M + 0.15 M), 3-D expert tensors in the file's type, an F32 router, and quanta reads it as qwen3_moe."""
    path = mm.write_direct("tiny-qwen3moe", tmp_path / "moe.gguf", "Q8_0", progress=lambda _: None)
    reader = gguf.GGUFReader(path)
    arch = "qwen3moe"
    assert _field(reader, "general.architecture") == arch and _field(reader, "general.size_label") == "16x13M"
    assert {k: _field(reader, f"{arch}.{k}") for k in ("expert_count", "expert_used_count", "expert_feed_forward_length")} == \
        {"expert_count": 16, "expert_used_count": 4, "expert_feed_forward_length": 192}
    tensors = {t.name: t for t in reader.tensors}
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    assert tuple(int(d) for d in gate.shape) == (128, 192, 16) and gate.tensor_type == gguf.GGMLQuantizationType.Q8_0
    router = tensors["blk.1.ffn_gate_inp.weight"]
    assert router.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.asarray(router.data).std() == pytest.approx(mm.ROUTER_LOGIT_STD * 128 ** -0.5, rel=0.1)
    cfg = load_config(path)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == \
        ("qwen3_moe", 16, 4, 192, True)
    assert cfg.qk_norm and not cfg.tie_word_embeddings and cfg.dense_layers == []


def test_k_quant_blocks_decode_to_their_fields() -> None:
    """Q4_K / Q6_K blocks packed from fields over their whole ranges (6-bit scales and mins, signed int8
    scales) decode, by the ``gguf`` package's port of ggml's dequantize, to the weights the fields mean."""
    from quanta.tools import kquant_blocks as kb

    rng = np.random.default_rng(7)
    n = 40
    d, dmin = (rng.normal(0, 0.01, n).astype(np.float16) for _ in range(2))
    sc, mins, q = rng.integers(0, 64, (n, 8)), rng.integers(0, 64, (n, 8)), rng.integers(0, 16, (n, 256))
    blocks = kb.pack_q4_k(d, dmin, sc, mins, q)
    assert blocks.shape == (n, 144)
    decoded = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(n, 256)
    np.testing.assert_array_equal(decoded, kb.q4_k_values(d, dmin, sc, mins, q))
    sc6, q6 = rng.integers(-128, 128, (n, 16)), rng.integers(0, 64, (n, 256))
    blocks = kb.pack_q6_k(d, sc6, q6)
    assert blocks.shape == (n, 210)
    decoded = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K).reshape(n, 256)
    np.testing.assert_array_equal(decoded, kb.q6_k_values(d, sc6, q6))


def test_random_k_quant_blocks_have_the_requested_spread() -> None:
    from quanta.tools import kquant_blocks as kb

    for block_type in ("Q4_K", "Q6_K"):
        blocks = kb.random_blocks(block_type, (300, 512), 0.05, np.random.default_rng(1), zero_from=250)
        values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[block_type])
        assert values.shape == (300, 512)
        assert values[:250].std() == pytest.approx(0.05, rel=0.02) and abs(values[:250].mean()) < 0.002
        assert (values[250:] == 0).all()
        assert len(np.unique(values[:250])) > 200, block_type  # codes times sub-block scales (and mins)
    with pytest.raises(ValueError, match="multiple of 256"):
        kb.random_blocks("Q4_K", (4, 96), 0.05, np.random.default_rng(1))


def test_q4_k_m_tensor_types_are_llama_quantizes() -> None:
    """The Q6_K tensors of Llama-3.2-1B's Q4_K_M as llama-quantize writes it (tied token_embd, attn_v and
    ffn_down of blocks 0, 1, 4, 7, 10, 13, 14, 15), every other matrix Q4_K."""
    from quanta.tools import kquant_blocks as kb

    cfg = mm.shape_config("llama-3.2-1b")
    types = {name: kb.tensor_type("Q4_K_M", name, shape, cfg) for name, shape, _, dtype in mm.tensor_plan(cfg)
             if dtype == np.float16}
    six = {f"blk.{i}.{t}.weight" for i in (0, 1, 4, 7, 10, 13, 14, 15) for t in ("attn_v", "ffn_down")}
    assert {n for n, t in types.items() if t == "Q6_K"} == six | {"token_embd.weight"}
    assert set(types.values()) == {"Q4_K", "Q6_K"}
    assert kb.tensor_type("Q6_K", "blk.0.attn_q.weight", (256, 256), cfg) == "Q6_K"
    assert kb.tensor_type("Q4_K_M", "blk.3.attn_q.weight", (64, 96), cfg) == "Q5_0"  # rows not of 256: llama-quantize's fallback


def test_direct_q4_k_m_file(tmp_path) -> None:
    """tiny-llama3 in Q4_K_M written directly: the file type, Q6_K where llama-quantize puts it, the weights'
    spread, zero reserved rows, and quanta loads it."""
    path = mm.write_direct("tiny-llama3", tmp_path / "q4km.gguf", "Q4_K_M", progress=lambda _: None)
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
    tensors = {t.name: t for t in reader.tensors}
    q6 = {n for n, t in tensors.items() if t.tensor_type == gguf.GGMLQuantizationType.Q6_K}
    assert q6 == {"token_embd.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight"}
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_K

    def values(name):
        return gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)

    assert values("blk.0.ffn_down.weight").std() == pytest.approx(768 ** -0.5, rel=0.03)
    assert values("blk.1.ffn_down.weight").std() == pytest.approx(768 ** -0.5, rel=0.03)
    embedding = values("token_embd.weight")
    assert embedding[:49152].std() == pytest.approx(mm.EMBEDDING_STD, rel=0.02) and (embedding[49152:] == 0).all()
    assert load_config(path).hidden_size == 256


@pytest.mark.skipif(not (mm.llama_cpp_source() / "build" / "bin" / "llama-quantize").exists(), reason="llama-quantize not built")
def test_direct_k_quant_types_match_llama_quantize(tmp_path) -> None:
    for qtype in ("Q4_K_M", "Q6_K"):
        direct = mm.write_direct("tiny-llama3", tmp_path / f"{qtype}.gguf", qtype, progress=lambda _: None)
        made = mm.make_gguf("tiny-llama3", tmp_path / f"{qtype}-quantized.gguf", qtype, progress=lambda _: None)
        readers = gguf.GGUFReader(direct), gguf.GGUFReader(made)
        types = [{t.name: t.tensor_type for t in r.tensors} for r in readers]  # llama-quantize reorders the tensors
        assert types[0] == types[1], qtype
        assert direct.stat().st_size == made.stat().st_size


def test_direct_flag(tmp_path, capsys) -> None:
    out = tmp_path / "q6k.gguf"
    assert cli.main(["make-model", "--shape", "tiny-llama3", "--layers", "1", "--type", "Q6_K", "--direct", "--out", str(out)]) == 0
    assert {t.tensor_type.name for t in gguf.GGUFReader(out).tensors} == {"F32", "Q6_K"}
    assert [p.name for p in tmp_path.iterdir()] == ["q6k.gguf"]
    assert cli.main(["make-model", "--shape", "tiny-llama3", "--type", "Q4_K_S", "--direct", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "--direct writes" in capsys.readouterr().err
