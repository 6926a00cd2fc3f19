"""Cost of grammar-constrained decoding per engine step (issue 13).

Runs the in-process engine (embedded SmolLM2, greedy, ignore_eos) on a batch
of 4 requests, 32 output tokens each, three ways, interleaved over
``--repeats`` rounds:

- ``free``: no request constrained;
- ``one``: one request under a JSON grammar (``json_object``), three free;
- ``all``: all four constrained.

Reports the median decode-step time (ms) of each, and the time the sampler
thread waits for a mask (``mask`` call, ms per constrained row per step): the
mask is computed on a worker thread during the forward pass, so this wait is
what a constrained row adds to the step that every request in the batch
shares. Run: ``.venv/bin/python benchmarks/grammar_overhead.py --repeats 3``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine import grammar as grammar_module
from quanta.engine.grammar import Grammar, GrammarCompiler
from quanta.engine.sampling import SamplingParams
from quanta.launch import build_engine, load_model, resolve_dtype

PROMPT = "Describe the city of Paris as a JSON object with a few fields."


def run(engine, compiler, prompt_ids, constrained: int, waits: list[float]) -> list[float]:
    for i in range(4):
        constraint = compiler.constraint(Grammar.json_object()) if i < constrained else None
        engine.add_request(prompt_ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, constraint=constraint))
    first = len(engine.trace.records)
    while engine.has_work():
        engine.step()
    return [(r.end - r.start) * 1e3 for r in list(engine.trace.records)[first:] if r.kind == "decode"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(None, resolve_dtype(None))
    engine = build_engine(loaded, EngineConfig(model=None, max_model_len=512), SchedulerConfig("batched", 4))
    compiler = GrammarCompiler(loaded.tokenizer.hf, loaded.tokenizer.eos_token_ids)
    prompt_ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    waits: list[float] = []
    original_mask = grammar_module.GrammarConstraint.mask

    def timed_mask(self, row):
        t0 = time.perf_counter()
        original_mask(self, row)
        waits.append((time.perf_counter() - t0) * 1e3)

    grammar_module.GrammarConstraint.mask = timed_mask
    steps = {"free": [], "one": [], "all": []}
    run(engine, compiler, prompt_ids, 1, [])  # warm-up
    waits.clear()
    for _ in range(args.repeats):
        for name, n in (("free", 0), ("one", 1), ("all", 4)):
            steps[name] += run(engine, compiler, prompt_ids, n, waits)
    for name, values in steps.items():
        print(f"{name:5s} decode step median {statistics.median(values):7.2f} ms  (n={len(values)})")
    print(f"mask wait per constrained row: median {statistics.median(waits):.3f} ms, p90 "
          f"{sorted(waits)[int(0.9 * len(waits))]:.3f} ms (n={len(waits)})")


if __name__ == "__main__":
    main()
