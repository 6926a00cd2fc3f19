"""``quanta profile moe``: pure prefill cost per token against the quantum.

Each run is the real engine (``Engine`` + ``BatchedScheduler`` +
``ModelExecutor``) serving one request of ``prompt_tokens`` random token ids
with ``max_tokens=1`` and nothing else resident, so every step is a prefill
chunk and no decode is interleaved. The prefill quantum is Q and the prefill
cap ``max(prompt_tokens, Q)``, so the prompt runs as ``prompt_tokens / Q``
equal chunks. Times are the trace's step durations (``time.monotonic`` around
``Executor.execute``); expert statistics come from the same step records.

Runs are repeated ``repeats`` times, interleaved (every quantum once, then
again) so slow drifts of a shared machine spread over all quanta; the
report gives the median and the min-max of the repeats.

Two costs are reported: the whole step (what a client sees) and the MoE
blocks alone (router to output, timed inside the model). The saturation point
is read from the MoE cost, the quantity the tokens-per-expert argument is
about: the whole-step curve also carries attention, whose chunked-prefill
work grows with Q (a chunk at offset s attends over s + Q keys with an
explicit mask, ~P^2/2 + P*Q/2 score entries for a P-token prompt) while a
prompt in one chunk takes the causal fast path (~P^2/2).

Fragmentation: the same prompt with the quantum fixed and the prefill cap
lowered, so chunks are split at cap boundaries (more, smaller calls); the
baseline is the sweep's run at that quantum with the full cap.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from quanta.config import DEFAULT_BLOCK_SIZE
from quanta.engine.block_pool import BlockPool, blocks_for
from quanta.engine.engine import Engine
from quanta.engine.model_executor import ModelExecutor
from quanta.engine.policies.batched import BatchedScheduler
from quanta.engine.sampling import SamplingParams
from quanta.model.cpu import cpu_summary
from quanta.moe import formulas

log = logging.getLogger("quanta")

DEFAULT_QUANTA = (128, 256, 512, 1024, 2048, 4096, 8192)
#: a quantum's cost counts as saturated within this fraction of the best median ms/token
SATURATION_TOLERANCE = 0.05


def prefill_run(executor: ModelExecutor, prompt: list[int], quantum: int, cap: int, max_tokens: int = 1) -> Engine:
    """Serve ``prompt`` alone through a fresh engine; returns it with its trace."""
    scheduler = BatchedScheduler(1, quantum, quantum, cap)
    scheduler.use_blocks(BlockPool(executor.kv.num_blocks, executor.kv.block_size))
    engine = Engine(scheduler, executor, executor.kv.num_blocks * executor.kv.block_size)
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_work():
        engine.step()
    return engine


def summarize_run(engine: Engine, num_tokens: int) -> dict:
    """Calls, seconds, ms/token and expert statistics (means over prefill steps) of one run."""
    steps = [r for r in engine.trace.records if r.kind == "prefill"]
    seconds = sum(r.duration for r in steps)
    stats = [r.experts for r in steps if r.experts]
    out = {"calls": len(steps), "seconds": seconds, "ms_per_token": 1000 * seconds / num_tokens,
           "chunk_tokens": [r.num_new_tokens[0] for r in steps]}
    if stats:
        out["moe_ms_per_token"] = 1000 * sum(s["seconds"] for s in stats) / num_tokens
        out["unique_experts"] = statistics.fmean(s["unique_experts"] for s in stats)
        out["tokens_per_active_expert"] = statistics.fmean(s["tokens_per_expert"] for s in stats)
    return out


def spread(values: list[float]) -> dict:
    """``{"median", "min", "max", "runs"}`` of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def saturation_point(rows: list[dict], tolerance: float = SATURATION_TOLERANCE, key: str = "moe_ms_per_token") -> float | None:
    """Smallest nominal tokens per expert whose median cost (``key``) is within ``tolerance`` of the best.

    ``key`` falls back to ``ms_per_token`` (whole step) where rows lack it;
    rows without ``tokens_per_expert`` (dense models) give None.
    """
    rows = [r for r in rows if r.get("tokens_per_expert") is not None]
    if not rows:
        return None
    key = key if all(key in r for r in rows) else "ms_per_token"
    best = min(r[key]["median"] for r in rows)
    return min(r["tokens_per_expert"] for r in rows if r[key]["median"] <= best * (1 + tolerance))


def machine_info() -> dict:
    """What the measurement ran on (CPU, cores, threads, memory, versions, load, date, commit)."""
    cpu = platform.processor()
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), cpu)
    except OSError:
        pass
    flags = cpu_summary()
    mem_gib = None
    try:
        kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
        mem_gib = round(kb / 2**20, 1)
    except (OSError, StopIteration):
        pass
    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "memory_gib": mem_gib, "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "quanta_commit": commit}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def measure_prefill_cost(loaded, quanta=DEFAULT_QUANTA, prompt_tokens: int = 8192, repeats: int = 3,
                         frag_quantum: int | None = 2048, frag_caps=(3072, 2560), seed: int = 0) -> dict:
    """Measure the cost curve, the decode step and the fragmentation cost of ``loaded`` (a LoadedModel).

    Returns:
        the JSON-ready report (see :func:`quanta.moe.report.format_report`).
    """
    cfg = loaded.config
    quanta = sorted(set(quanta))
    if max(quanta) > prompt_tokens:
        raise ValueError(f"the largest quantum ({max(quanta)}) exceeds the prompt ({prompt_tokens} tokens)")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, min(cfg.vocab_size, loaded.tokenizer.vocab_size), (prompt_tokens,), generator=gen).tolist()
    executor = ModelExecutor(loaded.model, blocks_for(prompt_tokens + 32, DEFAULT_BLOCK_SIZE), DEFAULT_BLOCK_SIZE)
    load_before = _loadavg()
    log.info("warm-up run (quantum %d)", quanta[-1])
    prefill_run(executor, prompt[: min(prompt_tokens, 1024)], min(quanta[-1], 1024), prompt_tokens)
    runs: dict[int, list[dict]] = {q: [] for q in quanta}
    frag_runs: dict[int, list[dict]] = {c: [] for c in frag_caps} if frag_quantum else {}
    for rep in range(repeats):
        for q in quanta:
            t0 = time.monotonic()
            runs[q].append(summarize_run(prefill_run(executor, prompt, q, max(prompt_tokens, q)), prompt_tokens))
            log.info("repeat %d/%d quantum %5d: %.3f ms/token (%.1f s)", rep + 1, repeats, q, runs[q][-1]["ms_per_token"],
                     time.monotonic() - t0)
        for cap in frag_runs:
            frag_runs[cap].append(summarize_run(prefill_run(executor, prompt, frag_quantum, cap), prompt_tokens))
            log.info("repeat %d/%d fragmentation cap %d: %d calls, %.3f ms/token", rep + 1, repeats, cap,
                     frag_runs[cap][-1]["calls"], frag_runs[cap][-1]["ms_per_token"])
    context = min(1024, prompt_tokens)
    decode = prefill_run(executor, prompt[:context], context, prompt_tokens, max_tokens=17)
    decode_ms = [1000 * r.duration for r in decode.trace.records if r.kind == "decode"]
    rows = [_row(cfg, q, runs[q]) for q in quanta]
    for key, ratio in (("ms_per_token", "ratio_to_best"), ("moe_ms_per_token", "moe_ratio_to_best")):
        if all(key in r for r in rows):
            best = min(r[key]["median"] for r in rows)
            for r in rows:
                r[ratio] = r[key]["median"] / best
    report = {
        "kind": "quanta-prefill-profile",
        "synthetic": cfg.synthetic,
        "model": model_shape(loaded),
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": _loadavg()},
        "method": {"prompt_tokens": prompt_tokens, "repeats": repeats,
                   "dtype": str(loaded.model.dtype).removeprefix("torch."),
                   "scheduler": "batched, max_num_seqs=1, prefill_quantum=Q, prefill_cap=max(prompt, Q)",
                   "timing": "sum of trace step durations (time.monotonic around Executor.execute) / prompt tokens",
                   "moe_timing": "wall time of the MoE blocks (router to output, perf_counter), "
                                 "summed over layers and steps / prompt tokens",
                   "statistic": "median of repeats, spread min-max", "saturation_tolerance": SATURATION_TOLERANCE,
                   "saturation_rule": "smallest tokens per expert whose median MoE-block cost is within the tolerance of the best"},
        "rows": rows,
        "saturation_tokens_per_expert": saturation_point(rows),
        "decode_step_ms": spread(decode_ms) | {"context_tokens": context, "sequences": 1},
    }
    if frag_quantum:
        report["fragmentation"] = _fragmentation(frag_quantum, prompt_tokens, runs.get(frag_quantum), frag_runs)
    return report


def model_shape(loaded) -> dict:
    """The model facts a report needs (name, architecture, expert shape, parameters)."""
    cfg = loaded.config
    return {"name": loaded.name, "path": str(loaded.path), "architecture": cfg.architecture,
            "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "num_experts": cfg.num_experts or None, "top_k": cfg.num_experts_per_tok or None,
            "moe_intermediate_size": cfg.moe_intermediate_size or None,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size or None,
            "num_moe_layers": sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)),
            "parameters": loaded.model.weight_count()}


def _row(cfg, quantum: int, runs: list[dict]) -> dict:
    row = {"quantum": quantum, "calls": runs[0]["calls"], "ms_per_token": spread([r["ms_per_token"] for r in runs])}
    if cfg.is_moe:
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        row |= {
            "unique_experts": statistics.fmean(r["unique_experts"] for r in runs),
            "unique_experts_expected": formulas.expected_unique_experts(quantum, k, e),
            "tokens_per_expert": formulas.tokens_per_expert(quantum, k, e),
            "tokens_per_active_expert": statistics.fmean(r["tokens_per_active_expert"] for r in runs),
            "moe_ms_per_token": spread([r["moe_ms_per_token"] for r in runs]),
        }
    return row


def _fragmentation(quantum: int, prompt_tokens: int, baseline: list[dict] | None, frag_runs: dict[int, list[dict]]) -> dict:
    rows = []
    base = statistics.median(r["ms_per_token"] for r in baseline) if baseline else None
    base_calls = baseline[0]["calls"] if baseline else None
    for cap, runs in [(max(prompt_tokens, quantum), baseline or []), *frag_runs.items()]:
        if not runs:
            continue
        ms = spread([r["ms_per_token"] for r in runs])
        rows.append({"prefill_cap": cap, "calls": runs[0]["calls"], "chunk_tokens": runs[0]["chunk_tokens"], "ms_per_token": ms,
                     "calls_ratio": runs[0]["calls"] / base_calls if base_calls else None,
                     "cost_ratio": ms["median"] / base if base else None})
    return {"quantum": quantum, "prompt_tokens": prompt_tokens, "rows": rows}
