"""Engine throughput on the embedded model, with transformers as the in-run baseline.

Measures, on one machine in one run:
- prefill tok/s of a 2,000-token prompt (one chunk, nothing decoding);
- aggregate decode tok/s with 1, 8 and 32 concurrent sequences (tokens
  emitted by decode steps / busy time of decode steps, both from the engine
  trace);
- the same two figures for ``transformers`` (forward on the prompt; batched
  ``generate`` of N sequences, decode time = generate(64 new) - generate(1 new)).

Each figure is the median of ``--repeats`` runs with the min-max range.
quanta runs as served (``--quantization auto``: int4 decode kernels for the
Q4_1 GGUF, and fp16 copies on CPUs without native bf16, see
:mod:`quanta.model.quant`); transformers holds the dequantized weights, which
the int4 form represents up to bf16 scale rounding and fp16 to half precision.
Usage: ``python benchmarks/engine_throughput.py [--dtype bf16|fp32] [--quantization auto|none|int8|int4|fp16] [--repeats 3]``
"""

from __future__ import annotations

import quanta  # noqa: F401  first: it sets libgomp's spin count before torch loads libgomp (quanta/__init__.py)

# isort: split
import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quanta.bench.output import machine
from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.sampling import SamplingParams
from quanta.launch import QUANTIZATION_CHOICES, build_engine, cpu_summary, load_model, resolve_dtype
from quanta.model.loader import load_checkpoint

PROMPT_LEN = 2000
DECODE_PROMPT_LEN = 32
NEW_TOKENS = 64
BATCHES = (1, 8, 32)


def machine_info() -> dict:
    """The machine (see :func:`quanta.bench.output.machine`) plus CPU flags, torch's version and threads."""
    return {**machine(), "cpu_flags": cpu_summary(), "threads": torch.get_num_threads(), "torch": torch.__version__}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def quanta_prefill(loaded, dtype_name: str) -> float:
    sched = SchedulerConfig("batched", 1, {"prefill_quantum": 2048, "mixed_prefill_quantum": 2048, "prefill_cap": 4096})
    engine = build_engine(loaded, EngineConfig(dtype=dtype_name, max_model_len=PROMPT_LEN + 8), sched)
    engine.add_request(_prompt(PROMPT_LEN, 0), SamplingParams(max_tokens=1, temperature=0))
    while engine.has_work():
        engine.step()
    rec = [r for r in engine.trace.records if r.kind == "prefill"]
    return PROMPT_LEN / sum(r.duration for r in rec)


def quanta_decode(loaded, dtype_name: str, batch: int) -> float:
    sched = SchedulerConfig("batched", batch, {})
    engine = build_engine(loaded, EngineConfig(dtype=dtype_name, max_model_len=DECODE_PROMPT_LEN + NEW_TOKENS + 8), sched)
    for i in range(batch):
        engine.add_request(_prompt(DECODE_PROMPT_LEN, i), SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    decodes = [r for r in engine.trace.records if r.kind == "decode"]
    return sum(sum(r.num_emitted) for r in decodes) / sum(r.duration for r in decodes)


def reference_model(path: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    """transformers' Llama with the very weights quanta serves (dequantized, in ``dtype``).

    Built from our state dict rather than transformers' own GGUF loader, which
    may keep the weights quantized and so would not be the same model.
    """
    cfg, state = load_checkpoint(path)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    model = LlamaForCausalLM(hf_cfg)
    model.load_state_dict(state, strict=False)
    return model.to(dtype).eval()


def hf_prefill(ref) -> float:
    ids = torch.tensor([_prompt(PROMPT_LEN, 0)])
    with torch.inference_mode():
        t0 = time.perf_counter()
        ref(ids, logits_to_keep=1)
        return PROMPT_LEN / (time.perf_counter() - t0)


def hf_decode(ref, batch: int) -> float:
    ids = torch.tensor([_prompt(DECODE_PROMPT_LEN, i) for i in range(batch)])
    mask = torch.ones_like(ids)

    def timed(new: int) -> float:
        t0 = time.perf_counter()
        ref.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    with torch.inference_mode():
        decode_time = timed(NEW_TOKENS) - timed(1)
    return batch * (NEW_TOKENS - 1) / decode_time


def summarize(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": samples}


def fmt(s: dict) -> str:
    return f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None)
    ap.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine_throughput.json")
    args = ap.parse_args()
    dtype_name = {"bf16": "bfloat16", "fp32": "float32", None: None}[args.dtype]
    dtype = resolve_dtype(dtype_name)
    dtype_name = str(dtype).removeprefix("torch.")
    loaded = load_model(None, dtype, args.quantization)
    ref = reference_model(loaded.path, dtype)

    rows = {"prefill 2000-token prompt": ("prefill", None)}
    rows.update({f"decode, {b} concurrent": ("decode", b) for b in BATCHES})
    results = {}
    for label, (kind, b) in rows.items():
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(quanta_prefill(loaded, dtype_name) if kind == "prefill" else quanta_decode(loaded, dtype_name, b))
            theirs.append(hf_prefill(ref) if kind == "prefill" else hf_decode(ref, b))
        results[label] = {"quanta": summarize(ours), "transformers": summarize(theirs),
                          "ratio": summarize([a / c for a, c in zip(ours, theirs)])}
        print(f"  measured {label}", file=sys.stderr)

    info = machine_info()
    print(f"\nmachine: {info['cpu']} ({info['cpu_flags']}), {info['threads']} threads, torch {info['torch']}; "
          f"dtype {dtype_name}; quanta kernels: {loaded.kernels}; "
          f"median (min-max) of {args.repeats} runs, tok/s\n")
    print("| measurement | quanta tok/s | transformers tok/s | ratio (same run) |")
    print("|---|---|---|---|")
    for label, r in results.items():
        ratio = r["ratio"]
        print(f"| {label} | {fmt(r['quanta'])} | {fmt(r['transformers'])} | "
              f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}) |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"date": datetime.now(UTC).isoformat(), "machine": info, "dtype": dtype_name, "repeats": args.repeats,
              "quantization": args.quantization, "kernels": loaded.kernels,
              "results": results}
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\nraw samples: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
