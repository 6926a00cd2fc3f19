"""RoPE scaling as GGUF files carry it (Llama 3.x ``rope_freqs``, YaRN, linear) and as transformers
computes it, and the lazily grown cos/sin tables.

References: transformers' ``ROPE_INIT_FUNCTIONS`` (inverse frequencies, attention factor), llama.cpp's
converter (``rope_freqs`` from Llama 3.1's parameters) and its ``rope_yarn`` (ggml-cpu/ops.cpp) with the
attention factor llama-context.cpp gives it, written out below in float64.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from quanta.model.attention import AttentionBatch
from quanta.model.config import ModelConfig
from quanta.model.loader import load_checkpoint, load_config
from quanta.model.native.forms import available
from quanta.model.rope import RotaryEmbedding, attention_factor, inverse_frequencies
from quanta.tools.make_model import llama3_rope_factors
from slot_cache import SlotCache
from test_loader import _write_gguf as write_model_gguf
from tiny_llama import LLAMA3_ROPE, TINY, load_ours

#: Llama 3.1 8B's RoPE (head_dim 128)
LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: a tiny Qwen2 with YaRN over the tiny models' reach: 64 trained positions, 128 served
TINY_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64}
#: the tiny models' shape, with the special ids test_loader's GGUF writer needs
SHAPE = {**TINY, "bos_token_id": 1, "eos_token_id": 2}
#: "to float32 precision": transformers rounds to float32 at every step (quanta once, from float64); observed
#: up to 2.4 float32 ulps relative, 6e-8 absolute
ULPS = 4 * torch.finfo(torch.float32).eps


def _llama_cpp_rope_freqs(head_dim: int, rope: dict) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter writes it (conversion/llama.py, generate_extra_tensors),
    by quanta's GGUF writer."""
    return llama3_rope_factors({"rope_theta": rope["rope_theta"], "head_dim": head_dim, "rope_scaling": rope})


def _llama_cpp_yarn(position: int, n_dims: int, base: float, factor: float, n_ctx_orig: int, beta_fast: float = 32.0,
                    beta_slow: float = 1.0, attn_factor: float = 1.0, log_mul: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[n_dims / 2]`` of one position as llama.cpp computes them for a YaRN file, in float64:
    llama-context.cpp's attention factor, ggml_rope_yarn_corr_dims, ggml_rope_cache_init / rope_yarn."""

    def get_mscale(scale: float, m: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    freq_scale = 1.0 / factor
    mscale = get_mscale(factor, 1.0) / get_mscale(factor, log_mul) if log_mul else get_mscale(factor, 1.0)
    mscale *= 1.0 / (1.0 + 0.1 * math.log(factor)) * attn_factor  # cancels rope_yarn's own, times rope.scaling.attn_factor

    def corr_dim(rotations: float) -> float:
        return n_dims * math.log(n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0, math.floor(corr_dim(beta_fast))), min(n_dims - 1, math.ceil(corr_dim(beta_slow)))
    cos, sin = [], []
    for i0 in range(0, n_dims, 2):
        theta_extrap = position * base ** (-i0 / n_dims)
        ramp_mix = 1 - min(1.0, max(0.0, (i0 // 2 - low) / max(0.001, high - low)))
        theta = freq_scale * theta_extrap * (1 - ramp_mix) + theta_extrap * ramp_mix
        scale = mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale))
        cos.append(math.cos(theta) * scale)
        sin.append(math.sin(theta) * scale)
    return np.array(cos), np.array(sin)


def _config(head_dim: int, rope_theta: float, rope_scaling: dict | None, context: int = 131072) -> ModelConfig:
    heads = 4
    return ModelConfig(architecture="llama", vocab_size=8, hidden_size=heads * head_dim, intermediate_size=8,
                       num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                       rope_theta=rope_theta, rope_scaling=rope_scaling, max_position_embeddings=context)


def _transformers_rope(cfg: PretrainedConfig) -> tuple[torch.Tensor, float]:
    return ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg)


def _write_gguf(path: Path, model: PreTrainedModel, rope: dict | None, rope_freqs: np.ndarray | None = None) -> None:
    """test_loader's float32 GGUF of ``model`` (llama.cpp's tensor names and q/k row order) with the
    ``{arch}.rope.scaling.*`` keys ``rope`` (e.g. ``{"type": "yarn", "factor": 4.0}``) and a ``rope_freqs`` tensor."""
    arch = gguf.MODEL_ARCH[model.config.model_type.upper()]
    prefix = f"{gguf.MODEL_ARCH_NAMES[arch]}.rope.scaling"

    class Writer(gguf.GGUFWriter):
        def write_header_to_file(self, *args, **kwargs) -> None:
            for key, value in (rope or {}).items():
                add = self.add_string if isinstance(value, str) else self.add_uint32 if isinstance(value, int) else self.add_float32
                add(f"{prefix}.{key}", value)
            if rope_freqs is not None:
                self.add_tensor("rope_freqs.weight", rope_freqs)
            super().write_header_to_file(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFWriter", Writer)
        write_model_gguf(model, arch, path)


def _tiny(cfg: PretrainedConfig) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _max_relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((got.double() - expected.double()).abs() / expected.double().abs()).max())


# ------------------------------------------------------------ against transformers


def test_llama31_rope_freqs_give_transformers_llama3_frequencies() -> None:
    """Llama 3.1 8B: the converter's per-frequency divisors give transformers' llama3 frequencies to a float32 ulp."""
    ref = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_parameters=LLAMA31)
    expected, expected_attention = _transformers_rope(ref)
    factors = _llama_cpp_rope_freqs(128, LLAMA31)
    cfg = _config(128, LLAMA31["rope_theta"], {"rope_type": "freq_factors", "freq_factors": factors.tolist()})
    got = inverse_frequencies(cfg)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert _max_relative(got, expected) < ULPS
    assert attention_factor(cfg) == expected_attention == 1.0
    # and quanta's own llama3 rule from the HF parameters agrees as closely
    own = inverse_frequencies(_config(128, LLAMA31["rope_theta"], {k: v for k, v in LLAMA31.items() if k != "rope_theta"}))
    assert _max_relative(own, expected) < ULPS


YARN_CASES = {
    "qwen2.5": ({"factor": 4.0, "original_max_position_embeddings": 32768}, 128, 1e6),
    "betas": ({"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0}, 64, 10000.0),
    "mscale": ({"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707}, 64, 10000.0),
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_matches_transformers(case: str) -> None:
    params, head_dim, theta = YARN_CASES[case]
    context = int(params["factor"] * params["original_max_position_embeddings"])
    ref = Qwen2Config(hidden_size=8 * head_dim, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=context,
                      rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})
    expected, expected_attention = _transformers_rope(ref)
    cfg = _config(head_dim, theta, {"rope_type": "yarn", **params}, context)
    assert _max_relative(inverse_frequencies(cfg), expected) < ULPS
    assert attention_factor(cfg) == pytest.approx(expected_attention, rel=1e-12)


# ------------------------------------------------------------ GGUF files


@pytest.mark.parametrize("extra", [{}, {"yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0, "attn_factor": 0.9},
                                   {"yarn_log_multiplier": 1.0}])
def test_gguf_yarn_tables_match_llama_cpp(tmp_path: Path, extra: dict) -> None:
    """A YaRN file with Qwen2.5-7B's RoPE (head_dim 128, theta 1e6, 4 x 32K): cos/sin (attention factor in
    them) as llama.cpp's rope_yarn gives them; ``context_length`` (the scaled one) stays the model's context."""
    shape = {**SHAPE, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 131072}
    model = _tiny(Qwen2Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    keys = {"type": "yarn", "factor": 4.0, "original_context_length": 32768, **extra}
    _write_gguf(tmp_path / "yarn.gguf", model, keys)
    cfg = load_config(tmp_path / "yarn.gguf")
    assert cfg.max_position_embeddings == 131072 and cfg.rope_scaling["rope_type"] == "yarn"
    rope = RotaryEmbedding(cfg)
    cos, sin = rope.float32_tables(0)
    assert cos.shape == (RotaryEmbedding.INITIAL_POSITIONS, 128)  # not 131072 rows up front
    beta = {"beta_fast": extra.get("yarn_beta_fast", 32.0), "beta_slow": extra.get("yarn_beta_slow", 1.0)}
    for position in (0, 1, 17, 1000, 4095):
        want_cos, want_sin = _llama_cpp_yarn(position, 128, 1e6, 4.0, 32768, **beta, attn_factor=extra.get("attn_factor", 1.0),
                                             log_mul=extra.get("yarn_log_multiplier", 0.0))
        # float32 angles: position * an ulp of the frequency
        np.testing.assert_allclose(cos[position, :64].double().numpy(), want_cos, rtol=0, atol=2e-7 * (position + 1))
        np.testing.assert_allclose(sin[position, :64].double().numpy(), want_sin, rtol=0, atol=2e-7 * (position + 1))
        assert torch.equal(cos[position, :64], cos[position, 64:])


def test_gguf_linear_and_unknown_scaling_types(tmp_path: Path) -> None:
    model = _tiny(LlamaConfig(**SHAPE))
    _write_gguf(tmp_path / "linear.gguf", model, {"type": "linear", "factor": 4.0})
    cfg = load_config(tmp_path / "linear.gguf")
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    plain = inverse_frequencies(_config(16, model.config.rope_parameters["rope_theta"], None))
    torch.testing.assert_close(inverse_frequencies(cfg), plain / 4, rtol=0, atol=0)
    _write_gguf(tmp_path / "none.gguf", model, {"factor": 1.0})  # no type: llama.cpp's linear, factor 1: plain
    assert load_config(tmp_path / "none.gguf").rope_scaling is None
    _write_gguf(tmp_path / "longrope.gguf", model, {"type": "longrope", "factor": 4.0})
    with pytest.raises(ValueError, match=r"unsupported GGUF RoPE scaling type 'longrope' \(supported: none, linear, yarn\)$"):
        load_config(tmp_path / "longrope.gguf")


def test_gguf_rope_freqs_of_the_wrong_length_is_refused(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "m.gguf", _tiny(LlamaConfig(**SHAPE)), None, rope_freqs=np.ones(5, dtype=np.float32))
    with pytest.raises(ValueError, match="rope_freqs.weight has 5 values; head_dim 16 needs 8"):
        load_config(tmp_path / "m.gguf")


CASES = {
    # Llama 3.x as llama.cpp converts it: the llama3 rule as a rope_freqs tensor, no scaling keys
    "llama3-rope-freqs": (LlamaConfig(**SHAPE, rope_scaling=LLAMA3_ROPE), None),
    "qwen2-yarn": (Qwen2Config(**SHAPE, rope_parameters=TINY_YARN),
                   {"type": "yarn", "factor": 2.0, "original_context_length": 64}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_pair(request, tmp_path_factory):
    """(transformers' model, quanta's model of its GGUF, the GGUF's path)."""
    hf_cfg, keys = CASES[request.param]
    ref = _tiny(hf_cfg)
    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    freqs = _llama_cpp_rope_freqs(16, hf_cfg.rope_parameters) if hf_cfg.rope_parameters["rope_type"] == "llama3" else None
    _write_gguf(path, ref, keys, freqs)
    return ref, load_ours(path), path


def test_gguf_config_frequencies_equal_transformers(gguf_pair) -> None:
    ref, _, path = gguf_pair
    cfg, state = load_checkpoint(path)
    assert "rope_freqs.weight" not in state and not any("rope" in k for k in state)
    assert cfg.max_position_embeddings == ref.config.max_position_embeddings
    expected, expected_attention = _transformers_rope(ref.config)
    assert _max_relative(inverse_frequencies(cfg), expected) < ULPS
    assert attention_factor(cfg) == pytest.approx(expected_attention, rel=1e-6)  # the GGUF holds float32 keys


def test_gguf_logits_match_transformers(gguf_pair) -> None:
    """Prompt logits of the GGUF through quanta equal transformers' (the same 1e-4 as test_model.py)."""
    ref, ours, _ = gguf_pair
    ids = torch.randint(0, ref.config.vocab_size, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    cfg = ours.config
    kv = SlotCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 128, cfg.head_dim, torch.float32)
    got = ours.compute_logits(ours(ids, AttentionBatch([kv.seq(0, 0, 100)], kv)))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.skipif(not available(), reason="quanta's C kernels do not build on this machine")
def test_native_decode_reads_the_scaled_tables(gguf_pair) -> None:
    """Decode steps on the C path (which takes the model's cos/sin tables) equal transformers' logits."""
    ref, ours, _ = gguf_pair
    assert ours.enable_native_decode() == "native"
    ids = torch.randint(0, ref.config.vocab_size, (70,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    cfg = ours.config
    kv = SlotCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 128, cfg.head_dim, torch.float32)
    decoder, ours.native = ours.native, None
    ours(ids[:66], AttentionBatch([kv.seq(0, 0, 66)], kv))
    ours.native = decoder
    for position in range(66, 70):
        hidden = ours(ids[position:position + 1], AttentionBatch([kv.seq(0, position, 1)], kv, decode=True))
        torch.testing.assert_close(ours.compute_logits(hidden)[0], expected[position], atol=1e-4, rtol=0)


def test_tables_grow_past_the_first_positions() -> None:
    cfg = _config(128, LLAMA31["rope_theta"], {k: v for k, v in LLAMA31.items() if k != "rope_theta"})
    rope = RotaryEmbedding(cfg)
    assert rope.float32_tables(4095)[0].shape[0] == 4096
    cos, sin = rope.tables(torch.tensor([3, 10000]), 10000, torch.float32)
    assert rope.float32_tables(0)[0].shape[0] == 2 * 10001
    angles = torch.outer(torch.tensor([3.0, 10000.0]), rope.inv_freq)
    torch.testing.assert_close(cos[:, 0, :64], angles.cos(), rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 0, 64:], angles.sin(), rtol=0, atol=0)
