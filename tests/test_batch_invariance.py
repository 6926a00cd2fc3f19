"""Batch-invariant greedy decoding: a prompt's tokens at temperature 0 do not depend on
chunking, on a prefix-cache hit, or on what else is batched: nor do the logits they are
picked from, to the bit.

Kernel level: every matmul kernel computes a row the same in a call of any size and on
1 or 2 threads (:mod:`quanta.model.linear`). Engine level, on a tiny random model with
quanta's C decode forms, then on the embedded model with the README's example: the same
prompt's greedy tokens equal those of a cold run alone, with the prompt split into other
chunks, after a cache hit, and beside other streams.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.sampling import SamplingParams
from quanta.launch import build_engine, load_model, resolve_dtype
from quanta.model import native
from quanta.model.linear import linear, pack_weight
from quanta.model.native.forms import available as native_available
from quanta.model.presets import _embedded_tokenizer as embedded_tokenizer
from quanta.model.quant import fp16_kernel_available, quantize
from quanta.tools.make_model import write_direct
from tiny_llama import TINY

DTYPES = [torch.float32, torch.bfloat16]
FORMS = ["int8", "int4", *(["fp16"] if fp16_kernel_available() else []), *(["q4_1", "q8_0"] if native_available() else [])]


def _set_threads(threads: int, pool: int) -> None:
    """Torch's threads and, where the C library loads, its pool's."""
    torch.set_num_threads(threads)
    if native_available():
        native.load().pool_set_threads(pool)


def _rows_agree(f, x: torch.Tensor) -> list[tuple[int, int]]:
    """(threads, rows) of the calls on the last ``rows`` rows of ``x`` that differ from a whole
    call, on 1 and 2 threads (torch's and the C pool's)."""
    before, bad = (torch.get_num_threads(), native.load().pool_threads() if native_available() else 1), []
    try:
        _set_threads(2, 2)
        whole = f(x)
        for threads in (1, 2):
            _set_threads(threads, threads)
            bad += [(threads, m) for m in (*range(1, 18), 31, 64, 129) if not torch.equal(f(x[-m:]), whole[-m:])]
    finally:
        _set_threads(*before)
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 576), (1728, 576), (576, 1536)])
def test_the_reference_computes_a_prompt_row_the_same_in_any_call(dtype, shape):
    w = torch.randn(*shape).to(dtype)
    packed = pack_weight(w)
    x = torch.randn(300, shape[1]).to(dtype)
    assert _rows_agree(lambda a: linear(a, w, None, packed), x) == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", FORMS)
def test_each_decode_form_computes_a_row_the_same_in_any_call(dtype, kind):
    form = quantize(torch.randn(96, 128) * 0.05, kind)
    assert _rows_agree(lambda a: linear(a, None, None, None, form, decode=True), torch.randn(200, 128).to(dtype)) == []


# --------------------------------------------------------------------------- engine level

@pytest.fixture(scope="module", params=DTYPES, ids=["fp32", "bf16"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-invariance")
    torch.manual_seed(3)
    config = LlamaConfig(**{**TINY, "vocab_size": 256, "max_position_embeddings": 256}, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    embedded_tokenizer().save_pretrained(path)
    return load_model(str(path), request.param, "q4_1" if native_available() else "int4")


def _greedy(loaded, probe: list[int], sched: SchedulerConfig, others: list[list[int]] = (), warm: list[int] | None = None,
            new_tokens: int = 12) -> tuple[list[int], torch.Tensor]:
    """The probe's greedy tokens and the logits they were picked from: after ``warm`` ran
    alone (a cache to hit), beside ``others``."""
    engine = build_engine(loaded, EngineConfig(max_model_len=256), sched)
    if warm is not None:
        engine.add_request(warm, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        while engine.has_work():
            engine.step()
    half = len(others) // 2
    for p in others[:half]:
        engine.add_request(p, SamplingParams(max_tokens=new_tokens + 4, temperature=0, ignore_eos=True))
    engine.step()  # the probe arrives while the first others prefill or decode
    seq = engine.add_request(probe, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    for p in others[half:]:
        engine.add_request(p, SamplingParams(max_tokens=new_tokens + 4, temperature=0, ignore_eos=True))
    rows, sample = [], engine.executor.sampler.sample

    def record(logits, params, histories, keys):
        rows.extend(logits[i].clone() for i, key in enumerate(keys) if key == seq.seq_id)
        return sample(logits, params, histories, keys)

    engine.executor.sampler.sample = record
    while engine.has_work():
        engine.step()
    return seq.output_token_ids, torch.stack(rows)


def _same(got: tuple[list[int], torch.Tensor], want: tuple[list[int], torch.Tensor]) -> bool:
    return got[0] == want[0] and torch.equal(got[1], want[1])


prompts = st.lists(st.integers(1, 255), min_size=2, max_size=60)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(probe=prompts, others=st.lists(prompts, max_size=5), chunk=st.integers(1, 24), cached=st.integers(-1, 59),
       slots=st.integers(1, 6))
def test_greedy_tokens_do_not_depend_on_chunks_cache_hits_or_neighbours(tiny, probe, others, chunk, cached, slots):
    alone = _greedy(tiny, probe, SchedulerConfig("batched", 1, {}))
    sched = SchedulerConfig("chunked", slots, {"admit_k": slots, "chunk": chunk, "prefill_cap": 64})
    warm = probe[:cached] + [7] if cached >= 0 else None  # a cached prefix of the probe, or no cache
    assert _same(_greedy(tiny, probe, sched, others, warm), alone)


@pytest.fixture(scope="module")
def moe_blocks(tmp_path_factory):
    """make-model's tiny-qwen3moe in Q4_K_M, served as ``quanta serve`` loads it: experts from their
    blocks, q/k head norms, decode steps in the native decoder's C glue."""
    if not native_available():
        pytest.skip("quanta's C kernels do not build here")
    path = write_direct("tiny-qwen3moe", tmp_path_factory.mktemp("moe-blocks") / "moe.gguf", "Q4_K_M",
                        progress=lambda _: None)
    loaded = load_model(str(path), torch.float32, "auto", prompt_weights="auto")
    assert loaded.model.native is not None and loaded.model.native.covers()
    return loaded


@pytest.mark.parametrize(("chunk", "cached", "slots"), [(5, 17, 4), (24, -1, 3), (1, 40, 6)])
def test_an_moe_from_its_blocks_decodes_the_same_in_any_company(moe_blocks, chunk, cached, slots):
    """Its routed experts meet other sequences' rows in one grouped call and its decode rows run the
    C glue: the probe's tokens and logits stay those of the probe alone, to the bit."""
    gen = torch.Generator().manual_seed(chunk)
    probe = torch.randint(1, 256, (45,), generator=gen).tolist()
    others = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (30, 9, 52, 17)]
    alone = _greedy(moe_blocks, probe, SchedulerConfig("batched", 1, {}))
    sched = SchedulerConfig("chunked", slots, {"admit_k": slots, "chunk": chunk, "prefill_cap": 64})
    warm = probe[:cached] + [7] if cached >= 0 else None
    assert _same(_greedy(moe_blocks, probe, sched, others, warm), alone)


# --------------------------------------------------------------------------- the README's example

@pytest.mark.parametrize("dtype", sorted({resolve_dtype(None), torch.float32}, key=str), ids=str)
def test_the_readme_example_answers_the_same_cold_cached_and_beside_seven_streams(dtype):
    loaded = load_model(None, dtype, "auto")
    chat = loaded.tokenizer.apply_chat_template
    probe = chat([{"role": "user", "content": "What is the capital of France?"}])
    others = [chat([{"role": "user", "content": f"Write a poem about {w}."}])
              for w in ("cats", "dogs", "the sea", "a robot", "rain", "a king", "bread")]
    sched = SchedulerConfig("batched", 8, {})
    cold = _greedy(loaded, probe, sched)
    assert _same(_greedy(loaded, probe, sched, warm=probe), cold)
    assert _same(_greedy(loaded, probe, sched, others=others, warm=probe[:20]), cold)
    if dtype == torch.float32:
        assert loaded.tokenizer.decode(cold[0]).startswith("The capital of France is Paris")
