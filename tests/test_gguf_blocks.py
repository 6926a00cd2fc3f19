"""A GGUF model built from the file's own blocks (:mod:`quanta.model.gguf_blocks`) against the same
file dequantized to float32 (the reference path), on small random llama / qwen2 files whose tensors
are stored in several block types, and on the embedded model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from quanta.launch import load_model
from quanta.model import gguf_loader
from quanta.model.form_embedding import FormEmbedding
from quanta.model.gguf_blocks import load_block_model
from quanta.model.linear import PackedLinear
from quanta.model.llama import LlamaModel
from quanta.model.loader import load_checkpoint, load_config
from quanta.model.native import forms
from quanta.tools.make_model import write_direct
from slot_cache import logits_in_chunks

pytestmark = pytest.mark.skipif(not forms.available(), reason="quanta's C kernels do not build here")

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 520, 2


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> llama.cpp q/k row order (what convert_hf_to_gguf.py writes for ``llama``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny(path: Path, arch: str, types: dict[str, T], tied: bool = True, seed: int = 0) -> None:
    """A random 2-layer ``arch`` GGUF; ``types``: tensor stem (``attn_q``, ``token_embd``, ...) -> its stored type
    (default Q8_0)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)

    def add(name: str, stem: str, shape: tuple[int, ...], scale: float) -> None:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if stem in ("attn_q", "attn_k") and arch == "llama":
            values = _permute(values, HEADS if stem == "attn_q" else KV_HEADS)
        kind = types.get(stem, T.Q8_0) if len(shape) == 2 else T.F32
        if kind == T.F32:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", "token_embd", (VOCAB, HIDDEN), 1.0)
    if not tied:
        add("output.weight", "output", (VOCAB, HIDDEN), 0.1)
    add("output_norm.weight", "output_norm", (HIDDEN,), 0.2)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        for stem, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv, HIDDEN)), ("attn_v", (kv, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                            ("ffn_down", (HIDDEN, FFN))):
            add(f"blk.{i}.{stem}.weight", stem, shape, 1 / np.sqrt(shape[1]))
        for stem in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{stem}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        if arch == "qwen2":
            for p, n in (("q", HIDDEN), ("k", kv), ("v", kv)):
                w.add_tensor(f"blk.{i}.attn_{p}.bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


MIXES = {
    "llama-q8_0": ("llama", {}, True),
    "llama-q4_0-q5_1-mixed": ("llama", {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q5_1, "ffn_gate": T.Q4_1,
                                        "ffn_up": T.Q4_0, "ffn_down": T.Q5_0, "attn_output": T.Q4_0,
                                        "token_embd": T.Q4_0, "output": T.Q5_1}, False),
    "qwen2-f16": ("qwen2", {k: T.F16 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                               "ffn_down", "token_embd")}, True),
}


@pytest.fixture(scope="module", params=sorted(MIXES))
def pair(request, tmp_path_factory):
    arch, types, tied = MIXES[request.param]
    path = tmp_path_factory.mktemp("blocks") / f"{request.param}.gguf"
    write_tiny(path, arch, types, tied)
    cfg, state = load_checkpoint(path)
    ref = LlamaModel(cfg)
    ref.load_hf_state_dict(state)
    return ref.eval(), load_block_model(path, load_config(path), torch.float32)


def test_only_forms_are_kept(pair):
    _, blocks = pair
    assert "from-blocks" in blocks.describe_kernels()
    assert all(p.dim() == 1 for p in blocks.parameters())  # norms and biases only
    linears = [m for m in blocks.modules() if isinstance(m, PackedLinear)]
    assert len(linears) >= 4 * LAYERS and all(m.form is not None and m.form_for_prompts for m in linears)
    assert isinstance(blocks.embed_tokens, FormEmbedding)


def test_the_embedding_rows_are_the_files(pair):
    ref, blocks = pair
    ids = torch.tensor([0, 1, 7, 8, 9, 300, VOCAB - 1])
    torch.testing.assert_close(blocks.embed_tokens(ids), ref.embed_tokens(ids), atol=0, rtol=0)


def test_logits_agree_with_the_dequantized_file(pair):
    """Teacher-forced: the blocks path computes with 8-bit activations (llama.cpp's Q8_1 scheme), the
    reference in float32 from the same dequantized weights; their logits differ by that rounding only
    (observed up to 0.14 on these files, top-1 in 98%; without the q/k row map 0.7-4.5, top-1 in 59-66%)."""
    ref, blocks = pair
    ids = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(1))
    want = logits_in_chunks(ref, ids, [64])
    got = logits_in_chunks(blocks, ids, [64])
    assert (got - want).abs().max() < 0.25
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


def test_a_prompt_rows_logits_do_not_depend_on_chunking(pair):
    _, blocks = pair
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2))
    whole = logits_in_chunks(blocks, ids, [40])
    assert torch.equal(logits_in_chunks(blocks, ids, [7, 13, 19, 1]), whole)


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """``(start, end)`` of this process's memory mappings of the file ``path`` (/proc/self/maps)."""
    target, out = str(path.resolve()), []
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == target:
            a, b = (int(x, 16) for x in fields[0].split("-"))
            out.append((a, b))
    return out


def test_a_lone_f16_tensor_is_the_files_mapped_pages(tmp_path):
    path = tmp_path / "f16.gguf"
    write_tiny(path, *MIXES["qwen2-f16"])
    model = load_block_model(path, load_config(path), torch.float32)
    maps = _mapped_ranges(path)

    def in_file(t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() and t.data_ptr() + t.nbytes <= b for a, b in maps)

    layer = model.layers[0]
    assert in_file(layer.self_attn.o_proj.form.data) and in_file(layer.mlp.down_proj.form.data)
    assert in_file(model._tied_head_form.data)
    assert not in_file(layer.self_attn.qkv_proj.form.data)  # q, k, v fused: copied into one matrix


def test_an_unsupported_type_is_one_line_naming_the_tensor(tmp_path):
    path = tmp_path / "iq.gguf"
    write_tiny(path, "llama", {})
    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(path)
    name = "blk.1.ffn_up.weight"
    tensor = next(t for t in reader.tensors if t.name == name)
    # rewrite the tensor's type field in its header (name, dims, type, offset): Q8_0 -> Q2_K
    at = bytes(data).index(name.encode()) + len(name) + 4 + 8 * len(tensor.shape)
    assert int.from_bytes(data[at:at + 4], "little") == T.Q8_0
    data[at:at + 4] = int(T.Q2_K).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        load_block_model(path, load_config(path), torch.float32)
    assert "blk.1.ffn_up.weight has type Q2_K" in str(err.value) and "\n" not in str(err.value)


def test_the_embedded_model_takes_its_blocks_by_default():
    loaded = load_model(None, torch.float32, "auto", prompt_weights="auto")
    assert "projections=q4_1:" in loaded.kernels and "from-blocks" in loaded.kernels
    assert loaded.model.weight_bytes() < 0.2e9


def test_prompt_steps_give_the_c_pool_all_its_threads():
    """A prompt step of a blocks model runs its matmuls on the C pool: the pool gets all its threads
    (a dequantized model's prompt matmuls are torch's, and the pool keeps 1)."""
    blocks = load_model(None, torch.float32, "auto", prompt_weights="auto").model.native
    reference = load_model(None, torch.float32, "auto", prompt_weights="reference").model.native
    assert blocks.prompts_covered() and not reference.prompts_covered()
    assert blocks.claim_threads(False, 2) == 2 and blocks.lib.pool_threads() == blocks.threads
    assert reference.claim_threads(False, 2) == 2 and reference.lib.pool_threads() == 1


def test_a_large_file_logs_its_loading_progress(tmp_path, monkeypatch, caplog):
    """A file from PROGRESS_BYTES on logs 'loading NAME: i of N layers' lines while it loads (here
    every layer, the thresholds lowered) and one naming the LM head's tensor before it is converted;
    a smaller one logs none."""
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", {})
    monkeypatch.setattr("quanta.model.gguf_blocks.PROGRESS_EVERY_S", 0.0)
    with caplog.at_level("INFO", logger="quanta.model.gguf_blocks"):
        load_block_model(path, load_config(path), torch.float32)
    assert not [r for r in caplog.records if "layers" in r.getMessage()]
    monkeypatch.setattr("quanta.model.gguf_blocks.PROGRESS_BYTES", 1)
    with caplog.at_level("INFO", logger="quanta.model.gguf_blocks"):
        load_block_model(path, load_config(path), torch.float32)
    lines = [r.getMessage() for r in caplog.records if "layers" in r.getMessage()]
    assert lines and lines[0].startswith(f"loading tiny.gguf: 1 of {LAYERS} layers (50%), ")
    assert len(lines) == 2 and lines[1].startswith(f"loading tiny.gguf: {LAYERS} of {LAYERS} layers, ")
    assert lines[1].endswith("; converting the LM head and embedding (token_embd.weight, 520 x 256 Q8_0)")


def test_q6_k_tensors_keep_their_bits_and_a_mixed_fusion_takes_q8_0(tmp_path):
    """A Q4_K_M file (make-model's, as llama-quantize types it): its Q6_K head / embedding and
    ffn_down in ``q6_k``, Q4_K in ``q4_1``, a q/k/v whose Q6_K ``attn_v`` meets Q4_K ``attn_q`` in ``q8_0``."""
    path = write_direct("tiny-llama3", tmp_path / "q4km.gguf", "Q4_K_M", progress=lambda _: None)
    types = gguf_loader.gguf_tensor_types(path)
    model = load_block_model(path, load_config(path), torch.float32)
    assert types["token_embd.weight"] == "Q6_K"
    assert model.lm_head_form.kind == model.embed_tokens.form.kind == "q6_k"
    seen = set()
    for i, layer in enumerate(model.layers):
        qkv = {types[f"blk.{i}.attn_{p}.weight"] for p in "qkv"}
        want = "q6_k" if qkv == {"Q6_K"} else "q8_0" if "Q6_K" in qkv else "q4_1"
        down = "q6_k" if types[f"blk.{i}.ffn_down.weight"] == "Q6_K" else "q4_1"
        assert (layer.self_attn.qkv_proj.form.kind, layer.mlp.down_proj.form.kind) == (want, down)
        assert layer.mlp.gate_up_proj.form.kind == "q4_1"
        seen |= {want, down}
    assert {"q8_0", "q6_k"} <= seen  # the file has both cases
