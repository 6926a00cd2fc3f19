"""The real engine's cost profile, timed in-process (``quanta profile-engine`` without ``--from-bench``).

Each point times :meth:`ModelExecutor.execute` on a hand-built
:class:`StepPlan` (the engine's own executor and model, no HTTP), after one
untimed warm-up call, ``repeats`` times; the median is the profile value and
``spread`` keeps ``[min, median, max]`` of every point.

- decode: a step of ``B`` sequences at context ``decode_contexts[0]`` for each
  batch size; the largest batch at each further context gives the decode
  context coefficient (extra seconds per step per context position summed over
  the batch, mean over the contexts, clamped at 0).
- fixed per-call overhead: the intercept of a least-squares line through the
  decode medians against B (clamped to [0, smallest decode step]); it is
  subtracted from every point, so ``step_cost``'s additive rule counts it once
  per fused step.
- prefill: one chunk of ``n`` tokens at position 0 gives the per-token cost at
  chunk size ``n``; the same chunk at each larger position gives the context
  coefficient (extra seconds per token per position, mean over the points,
  clamped at 0).
- Each point is stored net of the context term the cost model adds back
  (decode: ``B * context``; prefill at position 0: ``n (n - 1) / 2``), so
  :meth:`Profile.step_cost` of a measured plan reproduces its median.

The KV cache is the one ``quanta serve`` builds by default
(``--kv-cache-dtype auto``), and the profile records its geometry under
``kv`` (layers, KV heads, head dim, dtype), so ``quanta simulate
--kv-cache-memory`` can size the pool in blocks (:mod:`quanta.sim.pool`).

The command line is :mod:`quanta.sim.cli`; fitting a profile to a server's
trace instead is :mod:`quanta.sim.fit`.
"""

from __future__ import annotations

import statistics
import time
from datetime import UTC, datetime

from quanta.config import DEFAULT_BLOCK_SIZE
from quanta.engine.block_pool import blocks_for
from quanta.engine.sampling import SamplingParams
from quanta.engine.scheduler import ScheduledChunk, StepPlan
from quanta.engine.sequence import Sequence
from quanta.model.attention import kv_format
from quanta.sim.profile import Profile


def _seq(i: int, prompt_len: int, computed: int, outputs: int = 0, seqs: int = 1) -> Sequence:
    """Sequence ``i`` of ``seqs``; its blocks are every ``seqs``-th of the pool from block ``i``."""
    s = Sequence(i, [11 + (j % 1000) for j in range(prompt_len)], SamplingParams(max_tokens=8, temperature=0), arrival_time=0.0)
    s.output_token_ids = [13] * outputs
    s.num_computed_tokens = computed
    s.slot = i
    s.block_ids = [k * seqs + i for k in range(blocks_for(prompt_len + outputs, DEFAULT_BLOCK_SIZE))]
    return s


def _time(executor, make_plan, repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls of ``executor.execute(make_plan())`` after one untimed warm-up."""
    executor.execute(make_plan())  # warm-up
    out = []
    for _ in range(repeats):
        plan = make_plan()
        t0 = time.perf_counter()
        executor.execute(plan)
        out.append(time.perf_counter() - t0)
    return out


def _median(executor, make_plan, repeats: int, spread: dict, key: str) -> tuple[float, list[float]]:
    """The median of :func:`_time`'s seconds and the times; ``spread[key]`` gets ``[min, median, max]``."""
    ts = _time(executor, make_plan, repeats)
    med = statistics.median(ts)
    spread[key] = [min(ts), med, max(ts)]
    return med, ts


def _decode_plan(batch: int, context: int) -> StepPlan:
    return StepPlan([ScheduledChunk(_seq(i, context, context, 1, batch), 1) for i in range(batch)])


def _prefill_plan(n: int, pos: int) -> StepPlan:
    return StepPlan([ScheduledChunk(_seq(0, pos + n, pos), n)])


def _time_decode(ex, batches: list[int], decode_contexts: list[int], repeats: int, spread: dict,
                 say) -> tuple[dict[int, float], float]:
    """``({B: median step seconds at decode_contexts[0]}, decode context coefficient)``."""
    ctx0, dec = decode_contexts[0], {}
    for b in batches:
        dec[b], ts = _median(ex, lambda b=b: _decode_plan(b, ctx0), repeats, spread, str(b))
        say(f"decode batch {b}: {dec[b] * 1e3:.2f} ms/step (min {min(ts) * 1e3:.2f}, max {max(ts) * 1e3:.2f})")
    bmax, coefs = max(batches), []
    for c in decode_contexts[1:]:
        t, _ = _median(ex, lambda c=c: _decode_plan(bmax, c), repeats, spread, f"{bmax}@{c}")
        coefs.append(max(0.0, (t - dec[bmax]) / (bmax * (c - ctx0))))
        say(f"decode batch {bmax} at context {c}: {t * 1e3:.2f} ms/step")
    return dec, statistics.mean(coefs) if coefs else 0.0


def _overhead(dec: dict[int, float]) -> float:
    """Intercept of the least-squares line of step seconds against B, clamped to [0, smallest step]."""
    if len(dec) > 1:
        mx, my = statistics.mean(dec), statistics.mean(dec.values())
        slope = sum((x - mx) * (dec[x] - my) for x in dec) / sum((x - mx) ** 2 for x in dec)
        overhead = my - slope * mx
    else:
        overhead = 0.0
    return min(max(overhead, 0.0), min(dec.values()))


def _time_prefill(ex, chunks: list[int], positions: list[int], repeats: int, spread: dict,
                  say) -> tuple[dict[tuple[int, int], float], float]:
    """``({(n, position): median seconds}, prefill context coefficient)``."""
    pre: dict[tuple[int, int], float] = {}
    for n in chunks:
        for pos in positions:
            pre[n, pos], _ = _median(ex, lambda n=n, pos=pos: _prefill_plan(n, pos), repeats, spread, f"{n}@{pos}")
            say(f"prefill chunk {n} at position {pos}: {pre[n, pos] / n * 1e3:.3f} ms/token")
    p0 = positions[0]
    coefs = [max(0.0, (pre[n, pos] - pre[n, p0]) / (n * (pos - p0))) for n in chunks for pos in positions if pos > p0]
    return pre, statistics.mean(coefs) if coefs else 0.0


def measure(loaded, chunks: list[int], positions: list[int], batches: list[int], decode_contexts: list[int],
            repeats: int, say=print) -> Profile:
    """Time the real executor on hand-built plans and derive a :class:`Profile` (module docstring).

    Sizes in tokens; ``decode_contexts[0]`` is the context of the batch sweep.
    """
    from quanta.engine.model_executor import ModelExecutor
    from quanta.launch import resolve_kv_dtype

    ctx0, p0 = decode_contexts[0], positions[0]
    max_len = max(max(positions) + max(chunks), max(decode_contexts) + 2) + 1
    kv_dtype = resolve_kv_dtype("auto", loaded.model.dtype)
    ex = ModelExecutor(loaded.model, max(batches) * blocks_for(max_len, DEFAULT_BLOCK_SIZE), DEFAULT_BLOCK_SIZE,
                       kv_dtype=kv_dtype)
    spread: dict = {"decode": {}, "prefill": {}}
    dec, decode_ctx = _time_decode(ex, batches, decode_contexts, repeats, spread["decode"], say)
    overhead = _overhead(dec)
    pre, prefill_ctx = _time_prefill(ex, chunks, positions, repeats, spread["prefill"], say)
    points = [(float(n), max(pre[n, p0] - overhead - prefill_ctx * n * (p0 + (n - 1) / 2), 0.0) / n) for n in chunks]
    decode_points = [(float(b), max(dec[b] - overhead - decode_ctx * b * ctx0, 0.0)) for b in batches]
    measured = {"chunks": chunks, "positions": positions, "batches": batches, "decode_contexts": decode_contexts,
                "repeats": repeats}
    return Profile(prefill_points=points, decode_points=decode_points, overhead_s=overhead, prefill_ctx=prefill_ctx,
                   decode_ctx=decode_ctx, mixed_decode_factor=1.0, meta=_meta(loaded, measured, spread, kv_dtype))


def kv_meta(config, kv_dtype) -> dict:
    """A profile's ``kv`` block: the model's KV geometry and the cache dtype (:mod:`quanta.sim.pool`)."""
    return {"num_layers": config.num_hidden_layers, "num_kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "dtype": kv_format(kv_dtype).name}


def _meta(loaded, measured: dict, spread: dict, kv_dtype) -> dict:
    from quanta.bench.output import machine

    return {
        "name": f"engine_{loaded.config.model_type if hasattr(loaded.config, 'model_type') else 'model'}",
        "source": ("measured by quanta profile-engine on this machine: ModelExecutor.execute on hand-built plans, "
                   f"median of {measured['repeats']} timed repeats after one warm-up; "
                   "overhead = intercept of the decode step cost vs batch size"),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(), "model": str(getattr(loaded, "name", "") or "embedded SmolLM2-135M-Instruct"),
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "kv": kv_meta(loaded.config, kv_dtype),
        "measured": measured,
        "spread": spread,
    }
