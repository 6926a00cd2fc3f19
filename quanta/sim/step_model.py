"""The per-step cost model: seconds of one forward call, linear in its coefficients.

A forward call carries prompt rows (chunks ``(start position, tokens)``, N rows
in all) and decode rows (B rows at context positions ``p``). Its cost is::

    overhead_s
  + N * r(N)                      prompt rows: r is piecewise linear in log N between the
                                  prefill knots (values prefill_s_per_row), flat beyond the ends
  + prefill_ctx_s * Cp            Cp = sum over prompt rows of the context they attend,
                                  sum(n * (start + (n - 1) / 2)) over the chunks
  + d(B)                          decode rows: d is piecewise linear in B between the decode
                                  knots (values decode_s), extrapolated from the last two
  + decode_ctx_s * Cd             Cd = sum of the decode rows' positions
  + interference_s_per_row * B    only when N > 0: what each decode row pays extra while
                                  prompt rows share the step
  + prefix_hit_s_per_token * H    H = prompt tokens taken from the prefix cache by the
                                  sequences whose first chunk runs in this step (not computed)

With the knots fixed, every term is a coefficient times a feature of the step
(:meth:`StepModel.features`), so the coefficients are fitted by non-negative
least squares (:func:`nnls`; :mod:`quanta.sim.fit`). ``threads`` is metadata:
the thread counts of the server the model was fitted to.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field

import numpy as np

#: the scalar terms after the two curves, in coefficient order
SCALARS = ("prefill_ctx_s", "decode_ctx_s", "interference_s_per_row", "prefix_hit_s_per_token")


class StepModelError(ValueError):
    """A step model block that is not valid."""


@dataclass
class StepModel:
    """Coefficients of the per-step cost (module docstring); seconds, positions in tokens."""

    overhead_s: float = 0.0
    prefill_knots: list[float] = field(default_factory=lambda: [1.0])
    prefill_s_per_row: list[float] = field(default_factory=lambda: [0.0])
    decode_knots: list[float] = field(default_factory=lambda: [1.0])
    decode_s: list[float] = field(default_factory=lambda: [0.0])
    prefill_ctx_s: float = 0.0
    decode_ctx_s: float = 0.0
    interference_s_per_row: float = 0.0
    prefix_hit_s_per_token: float = 0.0
    #: thread counts of the measured server (e.g. {"decode_threads": 3, "prefill_threads": 4}); informative
    threads: dict = field(default_factory=dict)
    #: how it was fitted: steps per kind, residuals (quanta.sim.fit)
    fit: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ coefficients
    def coefficients(self) -> np.ndarray:
        """All coefficients in feature order: overhead, prefill curve, decode curve, :data:`SCALARS`."""
        return np.array([self.overhead_s, *self.prefill_s_per_row, *self.decode_s,
                         *(getattr(self, k) for k in SCALARS)], dtype=float)

    def with_coefficients(self, coef) -> StepModel:
        """A copy with ``coef`` (in :meth:`coefficients` order) as its coefficients."""
        c = [float(x) for x in coef]
        npre, ndec = len(self.prefill_knots), len(self.decode_knots)
        scalars = dict(zip(SCALARS, c[1 + npre + ndec:], strict=True))
        return StepModel(c[0], list(self.prefill_knots), c[1:1 + npre], list(self.decode_knots), c[1 + npre:1 + npre + ndec],
                         **scalars, threads=dict(self.threads), fit=dict(self.fit))

    def names(self) -> list[str]:
        """A name per coefficient, in :meth:`coefficients` order."""
        return (["overhead_s"] + [f"prefill_s_per_row@{x:g}" for x in self.prefill_knots]
                + [f"decode_s@{x:g}" for x in self.decode_knots] + list(SCALARS))

    # ------------------------------------------------------------------ cost
    def features(self, prefill: list[tuple[int, int]], decode: list[int], prefix_hit: int = 0) -> np.ndarray:
        """The step's feature vector: its cost is ``features . coefficients``."""
        n = sum(c for _, c in prefill)
        b = len(decode)
        pre = n * _log_weights(self.prefill_knots, n) if n else np.zeros(len(self.prefill_knots))
        dec = _lin_weights(self.decode_knots, b) if b else np.zeros(len(self.decode_knots))
        cp = sum(c * (s + (c - 1) / 2.0) for s, c in prefill)
        scalars = [cp, float(sum(decode)), float(b) if n else 0.0, float(prefix_hit)]
        return np.concatenate([[1.0], pre, dec, scalars])

    def cost(self, prefill: list[tuple[int, int]], decode: list[int], prefix_hit: int = 0) -> float:
        """Predicted seconds of a step (0 at least)."""
        return max(0.0, float(self.features(prefill, decode, prefix_hit) @ self.coefficients()))

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepModel:
        """Raises:
            StepModelError: missing or malformed keys, knots not ascending, negative coefficients."""
        if not isinstance(d, dict):
            raise StepModelError(f"step_model must be an object, got {type(d).__name__}")
        try:
            m = cls(float(d["overhead_s"]), [float(x) for x in d["prefill_knots"]], [float(x) for x in d["prefill_s_per_row"]],
                    [float(x) for x in d["decode_knots"]], [float(x) for x in d["decode_s"]],
                    **{k: float(d.get(k, 0.0)) for k in SCALARS}, threads=dict(d.get("threads") or {}), fit=dict(d.get("fit") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise StepModelError(f"malformed step_model: {exc!r}") from exc
        m.validate()
        return m

    def validate(self) -> None:
        for name, knots, values in (("prefill", self.prefill_knots, self.prefill_s_per_row),
                                    ("decode", self.decode_knots, self.decode_s)):
            if not knots or len(knots) != len(values):
                raise StepModelError(f"step_model: {name} knots and values must be non-empty and of equal length")
            if knots != sorted(knots) or len(set(knots)) != len(knots) or knots[0] <= 0:
                raise StepModelError(f"step_model: {name} knots must be positive and strictly ascending")
        if not all(math.isfinite(x) and x >= 0 for x in self.coefficients()):
            raise StepModelError("step_model: coefficients must be finite and >= 0")


def _log_weights(knots: list[float], x: float) -> np.ndarray:
    """Weights of the knot values in a piecewise linear interpolation in log x, flat beyond the ends."""
    w = np.zeros(len(knots))
    if x <= knots[0]:
        w[0] = 1.0
    elif x >= knots[-1]:
        w[-1] = 1.0
    else:
        i = bisect.bisect_right(knots, x)
        f = (math.log(x) - math.log(knots[i - 1])) / (math.log(knots[i]) - math.log(knots[i - 1]))
        w[i - 1], w[i] = 1.0 - f, f
    return w


def _lin_weights(knots: list[float], x: float) -> np.ndarray:
    """Weights of the knot values in a piecewise linear interpolation in x, extrapolated from the two end knots
    (constant with one knot)."""
    w = np.zeros(len(knots))
    if len(knots) == 1:
        w[0] = 1.0
        return w
    i = min(max(bisect.bisect_right(knots, x), 1), len(knots) - 1)
    f = (x - knots[i - 1]) / (knots[i] - knots[i - 1])
    w[i - 1], w[i] = 1.0 - f, f
    return w


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin |a x - b|`` over ``x >= 0`` (Lawson and Hanson's active set method); columns are scaled to unit
    norm inside, so features of very different magnitudes (counts, summed contexts) fit alike."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-10 * max(1.0, float(np.abs(a).sum(axis=0).max())) * max(a.shape)
    for _ in range(3 * n + 10):
        grad = a.T @ (b - a @ x)
        grad[passive] = -np.inf
        if not np.any(grad > tol):
            break
        passive[int(np.argmax(grad))] = True
        for _ in range(3 * n + 10):
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            bad = passive & (z <= 0)
            if not bad.any():
                x = z
                break
            alpha = float(np.min(x[bad] / (x[bad] - z[bad])))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x / scale
