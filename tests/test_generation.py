"""Greedy generation of the real model through the engine equals transformers' greedy tokens.

The prompts run concurrently under small quanta, so each is prefilled in
several chunks, split at the prefill cap, interleaved with the others' decode
steps and batched with sequences of other lengths. fp32 on both sides.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.sampling import SamplingParams
from quanta.launch import build_engine, load_model
from quanta.model.loader import embedded_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Write a haiku about the sea.\nThe sea",
    "In 1969, the first humans landed on the Moon. The mission was called Apollo 11 and its crew were",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32)


@pytest.fixture(scope="module")
def reference_tokens(loaded):
    path = embedded_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([loaded.tokenizer.encode(prompt)])
        with torch.inference_mode():
            gen = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _generate(loaded, sched: SchedulerConfig, block_size: int = 32) -> tuple[list[list[int]], object]:
    engine = build_engine(loaded, EngineConfig(max_model_len=256, block_size=block_size), sched)
    seqs = [engine.add_request(loaded.tokenizer.encode(p), SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
            for p in PROMPTS]
    for _ in range(10_000):
        if not engine.has_work():
            break
        engine.step()
    return [s.output_token_ids for s in seqs], engine.trace


def test_one_chunk_each_matches_transformers(loaded, reference_tokens):
    got, _ = _generate(loaded, SchedulerConfig("batched", 4, {}))
    assert got == reference_tokens


@pytest.mark.parametrize("block_size", [8, 64])
def test_block_size_changes_no_token(loaded, reference_tokens, block_size):
    """Chunks of 5 that straddle blocks of 8, and blocks larger than a prompt, give the same greedy tokens."""
    got, _ = _generate(loaded, SchedulerConfig("chunked", 3, {"chunk": 5}), block_size)
    assert got == reference_tokens


POLICY_CASES = {
    "static": {},
    "continuous": {"admit_k": 2},
    "chunked": {"admit_k": 1, "chunk": 5, "prefill_cap": 12},
    "budget": {"max_num_batched_tokens": 9},
}


@pytest.mark.parametrize("name", sorted(POLICY_CASES))
def test_every_policy_matches_unchunked_greedy(loaded, reference_tokens, name):
    """Chunking, admission and fusing never change greedy results (max_num_seqs 3 < 4 prompts)."""
    got, trace = _generate(loaded, SchedulerConfig(name, 3, POLICY_CASES[name]))
    assert got == reference_tokens
    if name == "budget":
        assert any(r.kind == "mixed" for r in trace.records)


def test_chunked_interleaved_batched_matches_transformers(loaded, reference_tokens):
    sched = SchedulerConfig("batched", 4, {"prefill_quantum": 8, "mixed_prefill_quantum": 4, "prefill_cap": 12})
    got, trace = _generate(loaded, sched)
    prefill_chunks = [n for r in trace.records if r.kind == "prefill" for n in r.num_new_tokens]
    assert max(prefill_chunks) <= 8 and len(prefill_chunks) > len(PROMPTS)  # really chunked
    assert any(len(r.seq_ids) > 1 for r in trace.records if r.kind == "decode")  # really batched
    assert got == reference_tokens
