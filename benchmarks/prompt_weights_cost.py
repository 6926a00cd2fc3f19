"""What ``--prompt-weights form`` costs in prefill: the embedded model loaded both ways, in-process.

Both engines (``--prompt-weights reference`` and ``form``, same dtype, one sequence, no prefix
cache) prefill the same cold prompt of N random ids and sample one token; the engines alternate
within each round, so the ratio is measured in one run on the same machine state. The table has
prefill tok/s, median (min-max) over rounds, and form / reference.

Usage (never in CI): ``python benchmarks/prompt_weights_cost.py [--tokens 512,2048,8192]
[--rounds 3] [--dtype bf16|fp32] [--out benchmarks/results/prompt_weights_cost]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peer_llama_cpp import int_list, run_record, summarize, write_result  # noqa: E402
from quanta.config import EngineConfig, SchedulerConfig  # noqa: E402
from quanta.engine.sampling import SamplingParams  # noqa: E402
from quanta.flags import dtype_name  # noqa: E402
from quanta.launch import build_engine, load_model, resolve_dtype  # noqa: E402

MODES = ("reference", "form")


def prefill_seconds(engine, prompt: list[int]) -> float:
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int_list, default=[512, 2048, 8192], help="comma list of prompt lengths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: the server's default here")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prompt_weights_cost")
    args = ap.parse_args()
    sizes = args.tokens
    if args.rounds < 1:
        ap.error("--rounds must be positive")
    dtype = resolve_dtype(dtype_name(args.dtype) if args.dtype else None)
    cfg = EngineConfig(max_model_len=max(sizes) + 64, prefix_cache=False)
    engines = {m: build_engine(load_model(None, dtype, "auto", prompt_weights=m), cfg, SchedulerConfig(max_num_seqs=1))
               for m in MODES}
    info = run_record(dtype=str(dtype).removeprefix("torch."))
    rates: dict[int, dict[str, list[float]]] = {n: {m: [] for m in MODES} for n in sizes}
    for rnd in range(args.rounds):
        for n in sizes:
            prompt = [random.Random(rnd * 100_000 + n).randrange(1000, 40000) for _ in range(n)]
            for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                rates[n][mode].append(n / prefill_seconds(engines[mode], prompt))
            print(f"  round {rnd + 1} {n}: " + ", ".join(f"{m} {rates[n][m][-1]:.0f} tok/s" for m in MODES), file=sys.stderr)
    out = [f"# Prefill with --prompt-weights form against reference ({info['date'][:10]})", "",
           f"- machine: {info['cpu']}, {info['logical_cores']} cores; flags `{info['cpu_flags']}`; dtype {info['dtype']}; "
           f"1-minute load before: {info['load']:.1f}",
           f"- command: `python benchmarks/prompt_weights_cost.py --tokens {','.join(map(str, sizes))} --rounds {args.rounds}"
           f"{' --dtype ' + args.dtype if args.dtype else ''}`",
           f"- in-process, one cold prompt alone, the two engines alternating; median (min-max) of {args.rounds} rounds", "",
           "| prompt tokens | reference tok/s | form tok/s | form / reference |", "|---|---|---|---|"]
    for n, per in rates.items():
        s = {m: summarize(per[m]) for m in MODES}
        cells = [f"{s[m]['median']:.0f} ({s[m]['min']:.0f}-{s[m]['max']:.0f})" for m in MODES]
        out.append(f"| {n:,} | {cells[0]} | {cells[1]} | {s['form']['median'] / s['reference']['median']:.2f} |")
    text = "\n".join(out) + "\n"
    print(text)
    write_result(args.out, text, {"info": info, "rates": {str(k): v for k, v in rates.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
