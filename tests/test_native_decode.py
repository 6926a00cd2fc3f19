"""The C decode path (quanta/model/native_decode.py) against transformers and the PyTorch path.

fp32: decode logits equal transformers' within 1e-4 (the same tolerance as
the PyTorch path in test_model.py), for rows in any slot order, at different
cached lengths, one row or several, and interleaved with PyTorch steps on
the same cache. bf16: within 0.1 of the PyTorch path's logits (observed
~0.03 on these tiny models; both round to bf16, at different points).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, OlmoeConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.sampling import SamplingParams
from quanta.launch import build_engine, load_model
from quanta.model import native
from quanta.model.attention import AttentionBatch
from quanta.model.llama import LlamaModel
from quanta.model.native.forms import available
from quanta.model.presets import _embedded_tokenizer as embedded_tokenizer
from quanta.model.thread_tuner import ThreadTuner
from slot_cache import SlotCache
from tiny_llama import LLAMA3_ROPE, TINY, load_ours

pytestmark = pytest.mark.skipif(not available(), reason="quanta's C kernels do not build on this machine")

CONFIGS = {
    "llama": LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama-rope-llama3": LlamaConfig(**TINY, rope_scaling=LLAMA3_ROPE),
    "qwen2-bias": Qwen2Config(**TINY, tie_word_embeddings=False),
    "mha": LlamaConfig(**{**TINY, "num_key_value_heads": 4}),
    "qwen3-qk-norms": Qwen3Config(**TINY, head_dim=16),
    "qwen3-moe": Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True),
}
#: slot i holds a prompt of this many tokens; 115 + 6 positions are two of attention's 64-position
#: tiles on one thread (decode.c), 8-position blocks with tails of 1-7 everywhere
PROMPT_LENGTHS = (9, 23, 1, 40, 115)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(CONFIGS[request.param]).eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, load_ours(path)


def _tokens(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n + 6,), generator=gen) for n in PROMPT_LENGTHS]


def _decode(model: LlamaModel, seqs: list[torch.Tensor], dtype: torch.dtype, order: list[int],
            native_steps: set[int]) -> list[list[torch.Tensor]]:
    """Prefill each prompt on the PyTorch path, then 6 decode steps over the slots in ``order``;
    steps in ``native_steps`` run the C path. Returns per step the logits rows in ``order``."""
    cfg = model.config
    kv = SlotCache(cfg.num_hidden_layers, len(seqs), cfg.num_key_value_heads, 128, cfg.head_dim, dtype)
    decoder, model.native = model.native, None
    for slot, n in enumerate(PROMPT_LENGTHS):
        model(seqs[slot][:n], AttentionBatch([kv.seq(slot, 0, n)], kv))
    steps = []
    for step in range(6):
        model.native = decoder if step in native_steps else None
        batch = AttentionBatch([kv.seq(slot, PROMPT_LENGTHS[slot] + step, 1) for slot in order], kv, decode=True)
        ids = torch.stack([seqs[slot][PROMPT_LENGTHS[slot] + step] for slot in order])
        steps.append(list(model.compute_logits(model(ids, batch)).float()))
    model.native = decoder
    return steps


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])  # pool.c: 2 splits matmul columns and attention's positions
def pool_threads(request):
    lib = native.load()
    before = lib.pool_threads()
    lib.pool_set_threads(request.param)
    assert lib.pool_threads() == request.param
    yield request.param
    lib.pool_set_threads(before)


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [3, 4, 0, 2], [1]])
def test_fp32_native_decode_matches_transformers(pair, order, pool_threads):
    ref, ours = pair
    assert ours.enable_native_decode() == "native"
    seqs = _tokens(ref.config.vocab_size)
    with torch.no_grad():
        expected = [ref(s[None]).logits[0] for s in seqs]
    got = _decode(ours, seqs, torch.float32, order, native_steps={0, 1, 3, 5})  # 2 and 4 on the PyTorch path
    assert native.load().pool_threads() == pool_threads  # the model's calls leave the executor's choice alone
    for step, rows in enumerate(got):
        for slot, row in zip(order, rows):
            torch.testing.assert_close(row, expected[slot][PROMPT_LENGTHS[slot] + step], atol=1e-4, rtol=0)


def test_bf16_native_decode_stays_close_to_the_pytorch_path(pair):
    source = pair[1]
    decoder, source.native = source.native, None  # a ctypes library does not copy
    model = copy.deepcopy(source).to(torch.bfloat16)
    source.native = decoder
    assert model.enable_native_decode() == "native"
    seqs, order = _tokens(model.config.vocab_size), [2, 0, 4, 3, 1]
    torch_path = _decode(model, seqs, torch.bfloat16, order, native_steps=set())
    native_path = _decode(model, seqs, torch.bfloat16, order, native_steps=set(range(6)))
    for a, b in zip(torch_path, native_path):
        assert (torch.stack(a) - torch.stack(b)).abs().max() < 0.1


def test_fp16_forms_are_direct_c_calls_within_1e_4_of_the_pytorch_path(pair):
    """fp16 projections and head (f16matmul.c) run as direct C calls where they have no bias,
    and their decode logits stay within 1e-4 of the PyTorch path's through the same forms."""
    model = pair[1]
    try:
        model.quantize_weights("fp16", "fp16")
        assert model.enable_native_decode() == "native"
        assert model.native.covers() == (not model.config.attention_bias and not model.config.num_experts)
        seqs, order = _tokens(model.config.vocab_size), [2, 0, 4, 3, 1]
        torch_path = _decode(model, seqs, torch.float32, order, native_steps=set())
        native_path = _decode(model, seqs, torch.float32, order, native_steps=set(range(6)))
    finally:
        model.quantize_weights(None, None)
    for a, b in zip(torch_path, native_path):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), atol=1e-4, rtol=0)


def test_models_it_cannot_run_keep_the_pytorch_path(tmp_path):
    torch.manual_seed(0)
    olmoe = OlmoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, clip_qkv=8.0)
    AutoModelForCausalLM.from_config(olmoe).save_pretrained(tmp_path)
    model = load_ours(tmp_path)
    assert model.enable_native_decode() == "torch (native decode does not support q/k norms over the whole projection)"
    assert model.native is None


def test_a_machine_without_a_compiler_reports_why(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(native.NativeUnavailable):
        native.build()
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC")
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        native.build()


def test_an_unwritable_cache_reports_why(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("QUANTA_CACHE_DIR", str(blocker))
    with pytest.raises(native.NativeUnavailable, match="cannot build in"):
        native.build()


def test_loading_the_library_keeps_subnormal_floats():
    """A library linked with -ffast-math would set flush-to-zero for the whole process
    (hypothesis refuses to run then, and torch's float results change)."""
    native.load()
    tiny = float("5e-324")
    assert tiny * 1.5 > 0 and torch.tensor(1e-40).item() * 2 > 0


def test_the_library_is_built_once_per_machine_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTA_CACHE_DIR", str(tmp_path))
    first = native.build()
    assert first.parent == tmp_path / "native" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp  # cached, not rebuilt


def test_the_serve_flag_turns_native_decode_off_and_the_startup_line_says_so():
    from quanta.flags import configs_from_args, parse_serve_flags
    from quanta.launch import load_model

    engine_cfg, _ = configs_from_args(parse_serve_flags(["--native-decode", "off"]))
    assert engine_cfg.native_decode is False
    assert configs_from_args(parse_serve_flags([]))[0].native_decode is True
    loaded = load_model(None, torch.float32, "none", native_decode=engine_cfg.native_decode)
    assert loaded.model.native is None and loaded.kernels.endswith("decode=torch (--native-decode off)")


@pytest.mark.parametrize("form", ["q4_1", "fp16"])
def test_steps_the_c_kernels_carry_get_their_threads_and_torch_gets_the_rest(tmp_path, form):
    """claim_threads: a decode forward whose projections are all C calls (q4_1, or fp16 through
    f16matmul.c) runs the C pool on the
    tuner's count (fixed at 2 here) and torch on 1, at every batch size; prompt forwards (even of one token, or beside
    decode rows in a step) run the pool on 1 and torch on its own count, which the executor
    leaves as it found it. head_threads: the q8_0 or fp16 head takes the C pool's split for every head."""
    config = LlamaConfig(**{**TINY, "vocab_size": 256}, tie_word_embeddings=True)  # q8_0 packs 8 columns a group
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    embedded_tokenizer().save_pretrained(tmp_path)  # load_model wants one; the requests are token ids
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    streams = 5
    try:
        loaded = load_model(str(tmp_path), torch.float32, form)
        model, lib = loaded.model, native.load()
        model.native.tuner = ThreadTuner(2, fixed=True)
        seen: list[tuple[int, bool, int, int]] = []  # (tokens, decode, torch threads, C threads) a forward
        heads: list[tuple[int, int, int]] = []  # (rows, torch threads, C threads) an LM head
        forward, compute_logits = model.forward, model.compute_logits

        def record(input_ids, batch, between_layers=None):
            seen.append((input_ids.shape[0], batch.decode, torch.get_num_threads(), lib.pool_threads()))
            return forward(input_ids, batch, between_layers)

        def record_head(hidden):
            heads.append((hidden.shape[0], torch.get_num_threads(), lib.pool_threads()))
            return compute_logits(hidden)

        model.forward, model.compute_logits = record, record_head
        engine = build_engine(loaded, EngineConfig(max_model_len=64, block_size=8), SchedulerConfig("batched", streams, {}))
        for i in range(streams):  # request 0 outlives the others: its last steps decode alone
            engine.add_request([5 + i, 6, 7], SamplingParams(max_tokens=6 + 3 * (i == 0), temperature=0, ignore_eos=True))
        while engine.has_work():
            engine.step()
        for prompt in (list(range(5, 14)), list(range(5, 13)) + [99]):  # the second: a one-token tail after a cached block
            engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0))
            while engine.has_work():
                engine.step()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for tokens, decode, torch_threads, c_threads in seen:
        assert (torch_threads, c_threads) == ((1, 2) if decode else (2, 1)), (tokens, decode)
    assert {(t, d) for t, d, _, _ in seen} >= {(1, True), (streams, True), (1, False)}
    assert any(t > 1 and not d for t, d, _, _ in seen)
    assert {rows for rows, _, _ in heads} >= {1, streams}
    assert all((torch_threads, c_threads) == (1, 2) for _, torch_threads, c_threads in heads)


@pytest.mark.parametrize("given, expected", [(None, "10000"), ("5", "5")])
def test_importing_quanta_shortens_openmp_spinning_unless_the_user_chose(given, expected):
    """quanta/__init__.py sets GOMP_SPINCOUNT before torch loads libgomp; a user's value wins."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | ({"GOMP_SPINCOUNT": given} if given else {})
    code = "import quanta, os, torch; print(os.environ['GOMP_SPINCOUNT'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == expected


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="the kernel's transparent huge pages are off")
@pytest.mark.parametrize("given", [None, "0"])
def test_importing_quanta_puts_large_torch_buffers_in_huge_pages_unless_the_user_chose(given):
    """quanta/__init__.py sets THP_MEM_ALLOC_ENABLE before torch's first allocation, so a torch
    buffer of 2 MiB or more is madvised for huge pages and a new 64 MiB tensor faults in huge
    pages (the process's AnonHugePages); a user's 0 wins (where the kernel's mode is "always",
    every large buffer gets huge pages anyway)."""
    huge = given is None or "[always]" in THP_MODE.read_text()
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env |= {"THP_MEM_ALLOC_ENABLE": given} if given else {}
    code = ("import quanta, re, torch\n"
            "a = torch.ones(64 << 20, dtype=torch.uint8)\n"
            "rollup = open('/proc/self/smaps_rollup').read()\n"
            "print(int(re.search(r'AnonHugePages:\\s+(\\d+)', rollup).group(1)) >= 32 << 10)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(huge)
