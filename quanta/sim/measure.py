"""``quanta profile-engine``: measure the real engine's cost profile on this machine.

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
"""

from __future__ import annotations

import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from quanta.engine.sampling import SamplingParams
from quanta.engine.scheduler import ScheduledChunk, StepPlan
from quanta.engine.sequence import Sequence
from quanta.sim.profile import FORMAT, Profile, ProfileError


def _ints(text: str, flag: str, parser) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        parser.error(f"{flag} must be a comma list of positive integers, got {text!r}")
    if not xs or xs[0] < 0 or (flag != "--positions" and xs[0] < 1):
        parser.error(f"{flag} must be a comma list of positive integers, got {text!r}")
    return xs


def _seq(i: int, prompt_len: int, computed: int, outputs: int = 0) -> Sequence:
    s = Sequence(i, [11 + (j % 1000) for j in range(prompt_len)], SamplingParams(max_tokens=8, temperature=0), arrival_time=0.0)
    s.output_token_ids = [13] * outputs
    s.num_computed_tokens = computed
    s.slot = i
    return s


def _time(executor, make_plan, repeats: int) -> list[float]:
    executor.execute(make_plan())  # warm-up
    out = []
    for _ in range(repeats):
        plan = make_plan()
        t0 = time.perf_counter()
        executor.execute(plan)
        out.append(time.perf_counter() - t0)
    return out


def _decode_plan(batch: int, context: int) -> StepPlan:
    return StepPlan([ScheduledChunk(_seq(i, context, context, 1), 1) for i in range(batch)])


def measure(loaded, chunks: list[int], positions: list[int], batches: list[int], decode_contexts: list[int],
            repeats: int, say=print) -> Profile:
    """Time the real executor on hand-built plans and fit a :class:`Profile` (module docstring).

    Sizes in tokens; ``decode_contexts[0]`` is the context of the batch sweep.
    """
    from quanta.engine.model_executor import ModelExecutor

    ctx0 = decode_contexts[0]
    max_len = max(max(positions) + max(chunks), max(decode_contexts) + 2) + 1
    ex = ModelExecutor(loaded.model, max(batches), max_len)
    spread: dict = {"decode": {}, "prefill": {}}
    dec = {}
    for b in batches:
        ts = _time(ex, lambda b=b: _decode_plan(b, ctx0), repeats)
        dec[b] = statistics.median(ts)
        spread["decode"][str(b)] = [min(ts), dec[b], max(ts)]
        say(f"decode batch {b}: {dec[b] * 1e3:.2f} ms/step (min {min(ts) * 1e3:.2f}, max {max(ts) * 1e3:.2f})")
    bmax, dec_coefs = max(batches), []
    for c in decode_contexts[1:]:
        ts = _time(ex, lambda c=c: _decode_plan(bmax, c), repeats)
        t = statistics.median(ts)
        spread["decode"][f"{bmax}@{c}"] = [min(ts), t, max(ts)]
        dec_coefs.append(max(0.0, (t - dec[bmax]) / (bmax * (c - ctx0))))
        say(f"decode batch {bmax} at context {c}: {t * 1e3:.2f} ms/step")
    decode_ctx = statistics.mean(dec_coefs) if dec_coefs else 0.0
    if len(batches) > 1:
        mx, my = statistics.mean(batches), statistics.mean(dec.values())
        slope = sum((x - mx) * (dec[x] - my) for x in batches) / sum((x - mx) ** 2 for x in batches)
        overhead = my - slope * mx
    else:
        overhead = 0.0
    overhead = min(max(overhead, 0.0), min(dec.values()))
    pre: dict[tuple[int, int], float] = {}
    for n in chunks:
        for pos in positions:
            ts = _time(ex, lambda n=n, pos=pos: StepPlan([ScheduledChunk(_seq(0, pos + n, pos), n)]), repeats)
            pre[n, pos] = statistics.median(ts)
            spread["prefill"][f"{n}@{pos}"] = [min(ts), pre[n, pos], max(ts)]
            say(f"prefill chunk {n} at position {pos}: {pre[n, pos] / n * 1e3:.3f} ms/token")
    p0 = positions[0]
    coefs = [max(0.0, (pre[n, pos] - pre[n, p0]) / (n * (pos - p0))) for n in chunks for pos in positions if pos > p0]
    prefill_ctx = statistics.mean(coefs) if coefs else 0.0
    points = [(float(n), max(pre[n, p0] - overhead - prefill_ctx * n * (p0 + (n - 1) / 2), 0.0) / n) for n in chunks]
    meta = {
        "name": f"engine_{loaded.config.model_type if hasattr(loaded.config, 'model_type') else 'model'}",
        "source": ("measured by quanta profile-engine on this machine: ModelExecutor.execute on hand-built plans, "
                   f"median of {repeats} timed repeats after one warm-up; overhead = intercept of the decode step cost vs batch size"),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": _machine(), "model": str(getattr(loaded, "name", "") or "embedded SmolLM2-135M-Instruct"),
        "dtype": str(loaded.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "measured": {"chunks": chunks, "positions": positions, "batches": batches, "decode_contexts": decode_contexts,
                     "repeats": repeats},
        "spread": spread,
    }
    decode_points = [(float(b), max(dec[b] - overhead - decode_ctx * b * ctx0, 0.0)) for b in batches]
    return Profile(prefill_points=points, decode_points=decode_points, overhead_s=overhead, prefill_ctx=prefill_ctx,
                   decode_ctx=decode_ctx, mixed_decode_factor=1.0, meta=meta)


def _machine() -> dict:
    from quanta.bench.output import machine

    return machine()


def profile_engine_cli(args, parser) -> int:
    from quanta.flags import dtype_name, writable_prefix

    writable_prefix(args.out, parser)
    if args.from_bench:
        return _from_bench(args, parser)
    from quanta.launch import load_model, resolve_dtype

    chunks = _ints(args.chunks, "--chunks", parser)
    positions = _ints(args.positions, "--positions", parser)
    batches = _ints(args.batches, "--batches", parser)
    contexts = _ints(args.decode_contexts, "--decode-contexts", parser)
    if args.repeats < 1:
        parser.error("--repeats must be a positive integer")
    dtype = dtype_name(args.dtype)
    loaded = load_model(args.model, resolve_dtype(dtype), getattr(args, "quantization", "auto"))
    prof = measure(loaded, chunks, positions, batches, contexts, args.repeats)
    assert prof.to_dict()["format"] == FORMAT
    prof.validate()
    prof.save(args.out)
    print(f"wrote {args.out}")
    return 0


def _bench_traces(path: str) -> tuple[list[list[dict]], dict, dict]:
    """The server traces of every measured run of a bench result, its first applied config and machine.

    Raises:
        ValueError: not a readable, measured quanta bench result.
    """
    import json

    from quanta.sim.compare import CompareError, check_measured

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        check_measured(path, doc)
        conds = [c for c in doc["conditions"] if c.get("valid", True)]
        traces = [r["trace"] for c in conds for r in c.get("runs") or [] if r.get("trace")]
        applied = next((c.get("applied") for c in conds if c.get("applied")), None) or {}
    except CompareError as exc:
        raise ValueError(str(exc)) from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a readable quanta bench result ({type(exc).__name__}: {exc})") from exc
    return traces, applied, doc.get("machine", {})


def _from_bench(args, parser) -> int:
    from quanta.sim.fit import FitError, fit

    if len(set(args.from_bench)) != len(args.from_bench):
        parser.error("--from-bench: the same file is given twice")
    traces, applied, machine = [], {}, {}
    for path in args.from_bench:
        try:
            t, a, m = _bench_traces(path)
        except ValueError as exc:
            parser.error(f"--from-bench: {exc}")
        traces += t
        applied, machine = applied or a, machine or m
    if not traces:
        parser.error("--from-bench: the results hold no server trace (was the server quanta?)")
    meta = {"name": Path(args.out).stem,
            "source": ("fitted by quanta profile-engine --from-bench to the server-trace steps (/v1/trace) of "
                       + ", ".join(args.from_bench) + " (quanta.sim.fit: decode least squares, prefill bins, residual quantiles)"),
            "machine": machine, "model": applied.get("model", "unknown"), "dtype": applied.get("dtype", "unknown")}
    try:
        prof = fit(traces, meta)
        prof.validate()
    except (FitError, ProfileError) as exc:
        parser.error(f"--from-bench: {exc}")
    except (KeyError, TypeError, AttributeError) as exc:
        parser.error(f"--from-bench: malformed trace record ({type(exc).__name__}: {exc})")
    prof.save(args.out)
    f = prof.meta["fit"]
    print(f"fitted {f['steps']} steps ({f['decode_steps']} decode, {f['prefill_steps']} prefill, {f['mixed_steps']} fused) "
          f"of {len(traces)} runs; wrote {args.out}")
    return 0
