"""quanta against llama.cpp's stored outputs on small synthetic GGUFs, teacher-forced.

Each ``tests/data/llama_cpp_agreement/SHAPE-TYPE.json`` holds, for 8 prompts, the token sequence
(prompt + 64 greedy tokens) and llama-server's top-5 ids and logprobs at the 64 positions, as
``benchmarks/agreement_llama_cpp.py --store`` wrote them (its ``command``), with the file's sha256
and llama.cpp's own spread between the shape's F16 and Q8_0 files on the same sequences. The test
writes the same file again (make-model's ``write_direct``, seed 0: the sha256 must match, else the
stored outputs are stale), loads it as ``quanta serve`` does, computes each sequence as one prompt
and checks, over 512 positions (in float32 on every host: the tolerance below is derived for quanta's
activations in fp32; a host with native bf16 serves in bf16 by default, which adds its own rounding):

- ``|logprob difference|`` over llama.cpp's top 5: max and median at most llama.cpp's own spread
  between two files of the same weights. The tolerance, derived: the two engines compute a file's
  weights alike and differ in the rounding of activations. For Q8_0 / Q4_0 files llama.cpp rounds
  them to q8_0 and quanta's projections to 8 bits in its own blocks (its head to 15 bits): no more
  than one 8-bit rounding of every weight and activation, llama.cpp's F16-vs-Q8_0 spread (max
  ~1.3, median ~0.18 nats on these files). For F16 / F32 files quanta keeps activations in fp32
  and llama.cpp rounds them to fp16 twice: at the F16 projections' inputs (its F32-vs-F16 spread
  measures that one: max ~0.07, median ~0.009) and in its attention (Q to fp16, in both of its
  files, so not in that spread): twice the F32-vs-F16 spread. For K-quant files (Q4_K_M: Q4_K with
  Q6_K in token_embd / output and in some attn_v / ffn_down) llama.cpp rounds activations to q8_K and
  quanta re-encodes the blocks in its own forms; each engine's part is measured on the file against an
  F32 file holding exactly its dequantized weights: llama.cpp's spread between the two (its activation
  rounding only; tiny-llama3: max 1.59, median 0.20) plus quanta's (its re-encoding only, fp32
  activations; Q6_K held in its own blocks: max 1.04, median 0.13), summed (the two engines' errors can add, not cancel by design).
  A quantized MoE file (tiny-qwen3moe Q8_0) is bounded the same way: both engines round activations
  to 8 bits, and at a router's near tie either rounding can swap a token's experts (nats at that
  position), so each engine's spread against the F32 file of its dequantized weights is summed;
- top-1 agreement in at least 95% of the positions where llama.cpp's top-1 leads its second by
  more than that max (where the engines' rounding can swap them, the order is not the file's), and
  in at least 95% of all positions for F16 / F32 files.

Architectures: llama with Llama 3 ``rope_freqs`` (F16, F32 through the dequantizing loader, Q4_0, Q4_K_M),
mistral (llama layout, untied head, Q4_0), qwen2 (q/k/v biases, Q8_0), qwen3 (q/k norms, Q8_0).
gemma3 (four norms a block, GELU, sliding window 32 on five of six layers with their own RoPE base, Q8_0).
phi3 (fused attn_qkv and gate/up ffn_up, LongRoPE long factors with attn_factor, a sliding window llama.cpp ignores, Q8_0).
qwen3moe (q/k norms, an F32 router choosing 4 of 16 experts stored as 3-D tensors and computed from
their blocks, F16 and Q8_0).
A wrong RoPE layout or a wrong block decoding moves logprobs by several nats and fails.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from quanta.model.native import forms
from quanta.tools import agreement
from quanta.tools.make_model import write_direct

DATA = Path(__file__).parent / "data" / "llama_cpp_agreement"
CASES = sorted(p.stem for p in DATA.glob("*.json"))
#: least top-1 agreement share
TOP1 = 0.95


def tolerance(record: dict) -> dict:
    """The bound of ``record``'s file: for a K-quant or quantized MoE file llama.cpp's spread against the F32 file of
    its dequantized weights plus quanta's own spread against it; twice the F32-vs-F16 spread for a float file; else
    the F16-vs-Q8_0 spread."""
    if record.get("spread_kquant_f32"):
        ours, theirs = record["spread_quanta_reencoding"], record["spread_kquant_f32"]
        return {"files": [*theirs["files"], "+ quanta's re-encoding"], "max_diff": theirs["max_diff"] + ours["max_diff"],
                "median_diff": theirs["median_diff"] + ours["median_diff"]}
    if record.get("spread_f32_f16"):
        spread = record["spread_f32_f16"]
        return {**spread, "max_diff": 2 * spread["max_diff"], "median_diff": 2 * spread["median_diff"]}
    return record["spread_f16_q8_0"]


def check_file(record: dict, path: Path) -> dict:
    """quanta on ``path`` against ``record``'s llama.cpp outputs; returns the summary."""
    loaded = agreement.load_as_served(path, torch.float32)
    results = [agreement.compare(c["top"], agreement.position_logprobs(loaded, c["tokens"], c["first"]),
                                 tolerance(record)["max_diff"])
               for c in record["cases"]]
    return agreement.summarize(results)


def failures(summary: dict, record: dict) -> list[str]:
    """What ``summary`` breaks of the rules in the module docstring (empty: it agrees)."""
    bound, qtype = tolerance(record), record["file"]["type"]
    out = []
    if summary["max_diff"] > bound["max_diff"] or summary["median_diff"] > bound["median_diff"]:
        out.append(f"|logprob diff| max {summary['max_diff']:.3f} / median {summary['median_diff']:.4f} over llama.cpp's "
                   f"spread {bound['files']} {bound['max_diff']:.3f} / {bound['median_diff']:.4f}")
    if summary["decisive_top1_share"] < TOP1:
        out.append(f"top-1 agreement {summary['decisive_top1_share']:.1%} where no near tie")
    if qtype in ("F16", "F32") and summary["top1_share"] < TOP1:
        out.append(f"top-1 agreement {summary['top1_share']:.1%} of all positions")
    return out


@pytest.mark.skipif(not CASES, reason="no stored llama.cpp outputs")
@pytest.mark.parametrize("case", CASES)
def test_quanta_agrees_with_stored_llama_cpp_outputs(case: str, tmp_path: Path) -> None:
    record = json.loads((DATA / f"{case}.json").read_text())
    spec = record["file"]
    if not forms.available():
        pytest.skip("quanta's C kernels do not build here (the served model then takes other forms)")
    path = write_direct(spec["shape"], tmp_path / f"{case}.gguf", spec["type"], spec["seed"], spec["layers"], progress=lambda _: None)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == spec["sha256"], \
        f"make-model writes another {case} file than llama.cpp saw; rerun: {record['command']}"
    summary = check_file(record, path)
    assert summary["positions"] == 8 * 64
    assert not failures(summary, record), f"{case}: {failures(summary, record)} ({summary})"
