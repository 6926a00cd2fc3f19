"""Per-request prompt and output lengths drawn from a distribution.

A distribution is one spec string (``--prompt-dist`` / ``--output-dist``)
around a centre ``L`` (``--prompt-words`` / ``--max-tokens``):

- ``fixed`` (default): every request ``L``.
- ``uniform:R`` (``0 <= R < 1``): an integer uniform in
  ``[floor(L*(1-R)), ceil(L*(1+R))]``, at least 1 -- ``vllm bench serve
  --random-range-ratio R`` (vLLM >= 0.9's symmetric range).
- ``lognormal:S`` (``S > 0``): ``round(exp(N(ln L, S)))``, at least 1: median
  ``L``, log-space standard deviation ``S``.
- ``file:PATH``: drawn with replacement from the positive integers of PATH
  (one a line, or a JSON list); ``L`` is ignored.
- ``eos`` (outputs only): no ``ignore_eos``; ``L`` is only the cap and the
  model's own end-of-sequence decides the length (the natural EOS length).

Draws use their own generator seeded from the workload's seed and what is
drawn, so changing a length distribution never moves arrival times or prompt
text, and the bench client and the simulator draw the same lengths.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

KINDS = ("fixed", "uniform", "lognormal", "file", "eos")


class LengthError(ValueError):
    """A length spec that cannot be parsed, or a lengths file that cannot be used."""


def parse(spec: str, allow_eos: bool = True) -> tuple[str, object]:
    """``(kind, parameter)`` of a spec: ``("fixed", None)``, ``("uniform", R)``, ``("lognormal", S)``,
    ``("file", [lengths])``, ``("eos", None)``.

    Raises:
        LengthError: unknown kind, a parameter out of range, ``eos`` where not allowed, or a lengths
            file that is missing, empty or holds anything but positive integers.
    """
    kind, _, arg = spec.partition(":")
    if kind not in KINDS or (kind == "eos" and not allow_eos):
        allowed = [k for k in KINDS if allow_eos or k != "eos"]
        raise LengthError(f"unknown length distribution {spec!r} (expected one of {', '.join(allowed)}; "
                          "uniform:R, lognormal:S, file:PATH)")
    if kind in ("fixed", "eos"):
        if arg:
            raise LengthError(f"{kind} takes no parameter, got {spec!r}")
        return kind, None
    if kind == "file":
        return kind, read_lengths(arg)
    try:
        x = float(arg)
    except ValueError:
        raise LengthError(f"{kind} needs a number, e.g. {kind}:0.5, got {spec!r}") from None
    if kind == "uniform" and not 0 <= x < 1:
        raise LengthError(f"uniform:R needs 0 <= R < 1 (as vllm --random-range-ratio), got {spec!r}")
    if kind == "lognormal" and not (x > 0 and math.isfinite(x)):
        raise LengthError(f"lognormal:S needs a positive sigma, got {spec!r}")
    return kind, x


def read_lengths(path: str) -> list[int]:
    """Positive integer lengths of a file: one a line (blank lines and ``#`` comments skipped) or a JSON list.

    Raises:
        LengthError: unreadable, empty, or an entry that is not a positive integer (named by line).
    """
    if not path:
        raise LengthError("file:PATH needs a path")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise LengthError(f"cannot read lengths file {path}: {exc.strerror or exc}") from None
    if text.lstrip().startswith("["):
        try:
            items = [(i + 1, v) for i, v in enumerate(json.loads(text))]
        except ValueError as exc:
            raise LengthError(f"lengths file {path}: not a JSON list: {exc}") from None
        where = "entry"
    else:
        items = [(i + 1, ln.strip()) for i, ln in enumerate(text.splitlines()) if ln.strip() and not ln.lstrip().startswith("#")]
        where = "line"
    out = []
    for n, v in items:
        try:
            x = int(v) if not isinstance(v, float) or v.is_integer() else None
        except (TypeError, ValueError):
            x = None
        if x is None or isinstance(v, bool) or x < 1:
            raise LengthError(f"lengths file {path}, {where} {n}: expected a positive integer, got {v!r}")
        out.append(x)
    if not out:
        raise LengthError(f"lengths file {path} holds no length")
    return out


def draw(spec: str, centre: int, n: int, seed: int, what: str) -> list[int]:
    """``n`` lengths from ``spec`` around ``centre`` (tokens or words), reproducible from ``seed`` and
    ``what`` (``"prompt"``/``"output"``, so the two streams differ)."""
    kind, arg = parse(spec)
    rng = random.Random(f"{what}-lengths:{seed}")
    if kind in ("fixed", "eos"):
        return [centre] * n
    if kind == "uniform":
        lo, hi = max(1, math.floor(centre * (1 - arg))), max(1, math.ceil(centre * (1 + arg)))
        return [rng.randint(lo, hi) for _ in range(n)]
    if kind == "lognormal":
        return [max(1, round(rng.lognormvariate(math.log(centre), arg))) for _ in range(n)]
    return [rng.choice(arg) for _ in range(n)]


def describe(spec: str, centre: int, unit: str) -> str:
    """A few words for the report, e.g. ``uniform 32-96 tokens``."""
    kind, arg = parse(spec)
    if kind == "fixed":
        return f"{centre} {unit}"
    if kind == "eos":
        return f"natural EOS length, at most {centre} {unit}"
    if kind == "uniform":
        return f"uniform {max(1, math.floor(centre * (1 - arg)))}-{max(1, math.ceil(centre * (1 + arg)))} {unit}"
    if kind == "lognormal":
        return f"lognormal, median {centre} {unit}, sigma {arg:g}"
    return f"empirical from {spec[5:]} ({len(arg)} values, median {sorted(arg)[len(arg) // 2]} {unit})"
