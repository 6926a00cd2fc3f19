"""quanta's next-token distributions against llama-server's on the same GGUF, teacher-forced.

For each of 8 prompts: llama-server (``-t 2``, one slot) tokenizes the text and continues it
greedily for 64 tokens, one ``/completion`` request per prefix (the prefix as token ids,
``n_predict 1``, ``n_probs 5``, ``cache_prompt``: each request computes one new position). Its
``n_probs`` are the raw log-softmax of the logits before any sampler (``post_sampling_probs`` off:
``get_token_probabilities`` in tools/server), and each continuation token is their top-1, so the
64 positions give llama.cpp's top-5 ids and logprobs on the fixed sequence prompt +
continuation. quanta, loaded in-process as ``quanta serve`` loads the file, computes the same
sequence as one prompt and gives its log-softmax at the same 64 positions
(:mod:`quanta.tools.agreement`): one early difference cannot cascade. Reported per file: top-1
agreement share, max and median ``|logprob difference|`` over llama.cpp's top 5.

The tolerance comes from quantization, measured: ``--spread A.gguf B.gguf`` runs llama-server on
two files of the same weights (an F16 file and its Q8_0) over the same sequences, teacher-forced
(the same requests, now along the given sequences), and reports how far llama.cpp's own
logprobs move under one 8-bit rounding of every weight and activation. The two engines differ on a
Q8_0 / Q5_x / Q4_x file by no more than that: llama.cpp rounds activations to q8_0 / q8_K (F16 weights: to fp16),
quanta keeps them in fp32 and re-encodes Q4_K as q4_1 (fp16 scale and minimum: the same values up
to fp16 rounding) and Q5_K / Q6_K as q8_0 (one 8-bit rounding of the weights).

On a K-quant file (Q4_K_M, Q6_K) the two engines round differently enough that the F16-vs-Q8_0
spread is no bound: llama.cpp rounds activations to q8_K (one scale per 256), quanta re-encodes the
blocks in its own forms (Q4_K as q4_1 with fp16 sub-block scales, Q6_K as q8_0, a fused projection in
its widest part's form). Each engine's part is measured against an F32 file holding exactly the K-quant
file's dequantized weights (:func:`dequantized_copy`): llama.cpp's spread between the K-quant file and
that file (its activation rounding only) and quanta's (:func:`quanta_spread`, fp32 activations: its
re-encoding only); the bound is their sum. make-model's tiny-llama3 Q4_K_M (written directly: Q4_K,
Q6_K token_embd and layer 1's attn_v / ffn_down), this AVX2 host: llama.cpp's spread max 1.59, median
0.20; quanta's max 1.10, median 0.14; quanta against llama.cpp max 2.16, median 0.236, top-1 agreement
89.8% of 512 positions, 100% where llama.cpp's top two are not closer than the bound.

A quantized MoE file is bounded the same way: both engines round activations to 8 bits (quanta's
experts too, computed from their blocks), and at a near tie in a router either engine's rounding can
swap a token's experts, which moves that position's logprobs by nats; so each engine's spread is
measured against the F32 file of the dequantized weights and summed. make-model's tiny-qwen3moe Q8_0
(16 experts, 4 a token), this AVX2 host: llama.cpp's spread max 2.73, median 0.179; quanta's max 6.89,
median 0.167; quanta against llama.cpp max 6.18, median 0.138, top-1 agreement 93.6% of 512 positions.

Usage:
    python benchmarks/agreement_llama_cpp.py --model F.gguf [--spread F16.gguf Q8_0.gguf] [--out R.json]
    python benchmarks/agreement_llama_cpp.py --store --shape tiny-qwen3 --type Q8_0
The second writes the file with make-model's :func:`~quanta.tools.make_model.write_direct` (seed 0)
and stores llama.cpp's sequences and top-5 lists, with the measured spread of the shape's F16 and
Q8_0 files (and for an F16 / F32 file of its F32 and F16 files: fp16 activations, llama.cpp's only
rounding of F16 weights' matmuls, which quanta computes in fp32; for a K-quant or quantized MoE file both engines' spreads against
its dequantized F32 copy), in ``tests/data/llama_cpp_agreement/SHAPE-TYPE.json`` for
``tests/test_agreement_llama_cpp.py``. Never run in CI; llama-server must be built (peer_llama_cpp.py).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from peer_llama_cpp import BINARY, LLAMA_CPP_PYTHON, free_port, start, stop  # noqa: E402
from quanta.tools import agreement  # noqa: E402
from quanta.tools.make_model import K_TYPES, write_direct  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
    "The three laws of thermodynamics state that",
    "Q: What is 17 times 23?\nA:",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the Apollo 11 mission",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
)
#: generated (and compared) positions per prompt
POSITIONS = 64
STORE = Path(__file__).resolve().parents[1] / "tests" / "data" / "llama_cpp_agreement"
#: one greedy token, no sampler state carried between requests
_RAW = {"temperature": 0, "ignore_eos": True, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "dry_multiplier": 0.0}


class LlamaServer:
    """llama-server on one GGUF on a free local port (``-t 2``, one slot), stopped on exit."""

    def __init__(self, gguf: Path, log: Path) -> None:
        self.port = free_port()
        cmd = [str(BINARY), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", "2", "-np", "1",
               "-c", "2048"]
        self.proc = start(cmd, self.port, log, timeout=120)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        stop(self.proc)

    def post(self, route: str, body: dict) -> dict:
        response = self.client.post(route, json=body)
        response.raise_for_status()
        return response.json()

    def tokenize(self, text: str) -> list[int]:
        return self.post("/tokenize", {"content": text, "add_special": True})["tokens"]

    def top_after(self, prefix: list[int], n_probs: int) -> list[list[float]]:
        """llama.cpp's top ``n_probs`` ``[id, logprob]`` after ``prefix`` (its raw logits).

        One token is generated, and a ``logit_bias`` makes it :attr:`plain`: llama-server drops the
        probabilities of a generated token that ends in an incomplete UTF-8 character, and the bias
        acts on the sampler's copy of the logits only, not on the ``n_probs`` it reports."""
        out = self.post("/completion", {"prompt": prefix, "n_predict": 1, "n_probs": n_probs, "cache_prompt": True,
                                        "logit_bias": [[self.plain, 1000.0]], **_RAW})
        return _pairs(out["completion_probabilities"][0])

    @functools.cached_property
    def plain(self) -> int:
        """An ASCII token (``.``)."""
        return self.tokenize(".")[-1]

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[list[list[float]]]]:
        """``n`` greedy tokens after ``prompt`` (each the top-1 of llama.cpp's raw logits) and the
        top-5 ``[id, logprob]`` at each position."""
        tokens, rows = list(prompt), []
        for _ in range(n):
            rows.append(self.top_after(tokens, agreement.TOP))
            tokens.append(int(rows[-1][0][0]))
        return tokens[len(prompt):], rows

    def forced(self, tokens: list[int], first: int, n_probs: int) -> list[list[list[float]]]:
        """Top ``n_probs`` ``[id, logprob]`` after each prefix ``tokens[:p]``, ``first <= p <= len(tokens) - 1``."""
        return [self.top_after(tokens[:p], n_probs) for p in range(first, len(tokens))]


def _pairs(position: dict) -> list[list[float]]:
    return [[t["id"], t["logprob"]] for t in position["top_logprobs"]]


def llama_cpp_cases(gguf: Path, workdir: Path) -> list[dict]:
    """Per prompt: ``tokens`` (prompt + 64 greedy tokens), ``first`` (prompt length), ``top`` (64 top-5 lists)."""
    cases = []
    with LlamaServer(gguf, workdir / f"{gguf.stem}.log") as server:
        for text in PROMPTS:
            prompt = server.tokenize(text)
            generated, top = server.greedy(prompt, POSITIONS)
            cases.append({"tokens": prompt + generated, "first": len(prompt), "top": top})
    return cases


def measured_spread(a: Path, b: Path, cases: list[dict], workdir: Path) -> dict:
    """llama.cpp on files ``a`` and ``b`` over ``cases``' sequences, teacher-forced: ``|logprob
    difference|`` over ``a``'s top 5 (max, median)."""
    tops = {}
    for path, n_probs in ((a, agreement.TOP), (b, 40)):
        with LlamaServer(path, workdir / f"{path.stem}.forced.log") as server:
            tops[path] = [server.forced(c["tokens"], c["first"], n_probs) for c in cases]
    diffs = [d for ta, tb in zip(tops[a], tops[b], strict=True) for d in agreement.spread(ta, tb)]
    return {"files": [a.name, b.name], "max_diff": max(diffs), "median_diff": statistics.median(diffs), "values": len(diffs)}


def dequantized_copy(src: Path, shape: str, seed: int, layers: int | None, out: Path) -> Path:
    """An F32 file of ``shape`` (make-model's metadata and tensors) holding exactly ``src``'s dequantized weights."""
    import gguf

    write_direct(shape, out, "F32", seed, layers, progress=lambda _: None)
    source, target = gguf.GGUFReader(src), gguf.GGUFReader(out, "r+")
    for a, b in zip(source.tensors, target.tensors, strict=True):
        assert a.name == b.name, (a.name, b.name)
        b.data[...] = gguf.quants.dequantize(a.data, a.tensor_type).reshape(b.data.shape)
    target.data.flush()
    return out


def quanta_spread(a: Path, b: Path, cases: list[dict]) -> dict:
    """quanta (float32 activations) on files ``a`` and ``b`` over ``cases``' sequences: ``|logprob difference|``
    at llama.cpp's top 5 tokens (max, median)."""
    import torch

    rows = {}
    for path in (a, b):
        loaded = agreement.load_as_served(path, torch.float32)
        rows[path] = [agreement.position_logprobs(loaded, c["tokens"], c["first"]) for c in cases]
        del loaded
    diffs = [abs(float(la[p][int(t)]) - float(lb[p][int(t)]))
             for c, la, lb in zip(cases, rows[a], rows[b], strict=True)
             for p, pairs in enumerate(c["top"]) for t, _ in pairs[:agreement.TOP]]
    return {"files": [a.name, b.name], "max_diff": max(diffs), "median_diff": statistics.median(diffs), "values": len(diffs)}


def quanta_report(gguf: Path, cases: list[dict], margin: float = 0.0) -> dict:
    """:func:`quanta.tools.agreement.summarize` of quanta on ``gguf`` against ``cases``."""
    loaded = agreement.load_as_served(gguf)
    results = [agreement.compare(c["top"], agreement.position_logprobs(loaded, c["tokens"], c["first"]), margin)
               for c in cases]
    return {**agreement.summarize(results), "kernels": loaded.kernels}


def _is_moe(path: Path) -> bool:
    """Whether ``path`` holds routed experts: each engine's activation rounding can then swap a
    token's near-tied experts, so the tolerance is measured per engine against exact weights."""
    from quanta.model.loader import load_config

    return bool(load_config(path).num_experts)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def store(shape: str, qtype: str, seed: int, layers: int | None) -> Path:
    """Write the shape's ``qtype`` file, run llama-server on it, measure the shape's F16 / Q8_0 spread, and
    store everything the test needs; returns the JSON's path."""
    with tempfile.TemporaryDirectory(prefix="agreement-") as tmp:
        work = Path(tmp)
        floats = qtype in ("F16", "F32")
        files = {t: write_direct(shape, work / f"{shape}-{t}.gguf", t, seed, layers, progress=lambda _: None)
                 for t in dict.fromkeys((qtype, "F16", "Q8_0", *(("F32",) if floats else ())))}
        cases = llama_cpp_cases(files[qtype], work)
        spread = measured_spread(files["F16"], files["Q8_0"], cases, work)
        float_spread = measured_spread(files["F32"], files["F16"], cases, work) if floats else None
        kquant_spread = reencoding = None
        if qtype in K_TYPES or (qtype not in ("F16", "F32") and _is_moe(files[qtype])):
            exact = dequantized_copy(files[qtype], shape, seed, layers, work / f"{shape}-{qtype}-dequantized-F32.gguf")
            kquant_spread = measured_spread(files[qtype], exact, cases, work)
            reencoding = quanta_spread(files[qtype], exact, cases)
        record = {
            "command": "python benchmarks/agreement_llama_cpp.py " + shlex.join(sys.argv[1:]),
            "llama_cpp": f"llama-server of llama-cpp-python {LLAMA_CPP_PYTHON}'s vendored llama.cpp, -t 2 -np 1 -c 2048",
            "file": {"shape": shape, "type": qtype, "seed": seed, "layers": layers, "sha256": sha256(files[qtype])},
            "spread_f16_q8_0": spread,
            "spread_f32_f16": float_spread,
            "spread_kquant_f32": kquant_spread,
            "spread_quanta_reencoding": reencoding,
            "cases": cases,
        }
        margin = (float_spread or spread)["max_diff"]
        if kquant_spread:
            margin = kquant_spread["max_diff"] + reencoding["max_diff"]
        report = quanta_report(files[qtype], cases, margin)
    STORE.mkdir(parents=True, exist_ok=True)
    out = STORE / f"{shape}-{qtype}.json"
    out.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"{out}: {_line(report)}; llama.cpp F16 vs Q8_0 spread: max {spread['max_diff']:.3f}, "
          f"median {spread['median_diff']:.4f}")
    for key in ("spread_kquant_f32", "spread_quanta_reencoding"):
        if record[key]:
            print(f"  {key} {record[key]['files']}: max {record[key]['max_diff']:.3f}, median {record[key]['median_diff']:.4f}")
    return out


def _line(report: dict) -> str:
    return (f"{report['positions']} positions, top-1 agreement {report['top1_share']:.1%}, |logprob diff| over llama.cpp's "
            f"top 5: max {report['max_diff']:.3f}, median {report['median_diff']:.4f}; {report['near_ties']} near ties "
            f"(llama.cpp's top two closer than the tolerance), top-1 agreement elsewhere {report['decisive_top1_share']:.1%}")


def compare_file(model: Path, spread_files: list[Path] | None, out: Path | None) -> None:
    """Run both engines on ``model`` (and llama.cpp on the two spread files) and print / write the report."""
    with tempfile.TemporaryDirectory(prefix="agreement-") as tmp:
        start_time = time.monotonic()
        cases = llama_cpp_cases(model, Path(tmp))
        spread = measured_spread(*spread_files, cases, Path(tmp)) if spread_files else None
        report = quanta_report(model, cases, spread["max_diff"] if spread else 0.0)
    print(f"{model.name}: {_line(report)}")
    print(f"  quanta kernels: {report['kernels']}")
    if spread:
        print(f"  llama.cpp {spread['files'][0]} vs {spread['files'][1]} on the same sequences: max {spread['max_diff']:.3f}, "
              f"median {spread['median_diff']:.4f} (the tolerance); within it: "
              f"{report['max_diff'] <= spread['max_diff'] and report['median_diff'] <= spread['median_diff']}")
    if out:
        out.write_text(json.dumps({"model": str(model), "size": model.stat().st_size, "report": report, "spread": spread,
                                   "seconds": round(time.monotonic() - start_time, 1)}, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="the GGUF to compare")
    parser.add_argument("--spread", type=Path, nargs=2, metavar=("F16", "Q8_0"),
                        help="two files of the same weights: llama.cpp's own difference between them is the tolerance")
    parser.add_argument("--out", type=Path, help="write the report as JSON")
    parser.add_argument("--store", action="store_true", help="write --shape's --type file and store llama.cpp's outputs")
    parser.add_argument("--shape", help="with --store: a make-model shape")
    parser.add_argument("--type", default="F16", help="with --store: F32, F16, Q8_0, Q6_K, Q5_1, Q5_0, Q4_K_M, Q4_1 or Q4_0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    if args.store == bool(args.model) or (args.store and not args.shape):
        parser.error("give --model FILE, or --store with --shape")
    if args.store:
        store(args.shape, args.type.upper(), args.seed, args.layers)
    else:
        compare_file(args.model, args.spread, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
