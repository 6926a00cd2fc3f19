"""Cost profiles: a small JSON file giving the cost model of one machine and model.

Format (``"format": "quanta-cost-profile/1"``), times in seconds::

    {
      "format": "quanta-cost-profile/1",
      "name": "...", "source": "where every number comes from",
      "machine": "...", "model": "...",
      "overhead_s": 0.0,                         # fixed cost of every forward call
      "prefill": {
        "axis": "chunk_tokens" | "tokens_per_expert",
        "points": [[x, seconds_per_token], ...],  # pure prefill, x ascending
        "context_s_per_token_per_pos": 0.0,     # attention: extra s per token per context position
        "moe": {"num_experts": E, "top_k": k}   # only with axis tokens_per_expert
      },
      "decode": {
        "points": [[batch_size, step_seconds], ...],
        "context_s_per_pos": 0.0                 # extra s per step per context position summed over the batch
      },
      "mixed_decode_factor": 1.0,                # share of the decode cost a fused step pays
      "step_model": {...},                       # optional: the per-step cost model fitted to engine traces
                                                 # (quanta.sim.step_model); when present it alone prices a step
      "front": {"request_s": s, "prompt_token_s": s, "response_s": s, "noise": [s, ...], "workers": 2},
                                                 # optional: the server front's latency, client -> engine (its
                                                 # loop, then one of `workers` tokenizing threads) and engine ->
                                                 # client, and the residuals drawn per request (quanta.sim.front)
      "step_noise": {"factors": [...], "source": "...",   # optional: each simulated step's cost is
                     "by_cost": [{"up_to_s": s, "factors": [...]}, ...],  # multiplied by a factor drawn
                     "steady_decode": [...]},    # uniformly from steady_decode for a step of decode rows that
                                                 # all decoded before, else from the first by_cost bin whose
                                                 # up_to_s (null: no bound) is at least the step's predicted
                                                 # cost, or from factors without by_cost
      "wake": {"idle_s": s, "factor": f, "steps": n},   # optional: a step that starts after the engine idled
                                                 # idle_s or more (or the run's first) takes factor x its cost
      "kv": {"num_layers": L, "num_kv_heads": H, "head_dim": D, "dtype": "bfloat16"},  # optional: the model's
                                                 # KV geometry and cache dtype (kv_geometry; quanta.sim.pool: --kv-cache-memory)
      "scheduler": {...},                        # knobs of the measured server (informative)
      "published": [...], "assumed": [...],      # which keys are published / assumed (shipped profiles)
      "spread": {...}                            # optional: measured spread (profile engine)
    }

Interpolation: prefill per-token cost is piecewise linear in log(x) between
points and constant beyond the ends; decode step cost is piecewise linear in
the batch size and extrapolated linearly past the last point from the last
two (constant when there is one point).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quanta.config import KV_CACHE_DTYPES

if TYPE_CHECKING:  # the step model needs numpy, which commands that load no profile do not import
    from quanta.sim.front import FrontModel
    from quanta.sim.step_model import StepModel

FORMAT = "quanta-cost-profile/1"
#: element formats a profile's ``kv`` block may name (``--kv-cache-dtype``'s, less ``auto``)
KV_DTYPES = tuple(d for d in KV_CACHE_DTYPES if d != "auto")
#: keys of a cost profile's ``kv`` block
KV_KEYS = ("num_layers", "num_kv_heads", "head_dim")


class ProfileError(ValueError):
    """A profile file that is not a valid cost profile."""


@dataclass
class Wake:
    """The first step after the engine idled ``idle_s`` or more (or a run's first step) takes ``factor``
    times its predicted cost: on a shared 2-core VM such a step ran 1.10-1.22x its prediction (over the
    others' median) (``quanta.sim.fit.fit_wake``)."""

    idle_s: float
    factor: float
    #: fitted steps that started after such an idle
    steps: int = 0

    @classmethod
    def from_dict(cls, d) -> Wake:
        if not isinstance(d, dict):
            raise ProfileError(f"wake must be an object, got {type(d).__name__}")
        return cls(float(d["idle_s"]), float(d["factor"]), int(d.get("steps", 0)))

    def validate(self) -> None:
        if not (math.isfinite(self.idle_s) and self.idle_s > 0 and math.isfinite(self.factor) and self.factor > 0):
            raise ProfileError("wake: idle_s and factor must be finite and > 0")

    def applies(self, idle_s: float | None) -> bool:
        """Whether a step that starts ``idle_s`` seconds after the previous one ended (None: the first) wakes."""
        return idle_s is None or idle_s >= self.idle_s


@dataclass
class Profile:
    prefill_points: list[tuple[float, float]]
    decode_points: list[tuple[float, float]]
    overhead_s: float = 0.0
    prefill_axis: str = "chunk_tokens"
    prefill_ctx: float = 0.0
    decode_ctx: float = 0.0
    mixed_decode_factor: float = 1.0
    moe: dict | None = None
    meta: dict = field(default_factory=dict)
    #: multiplicative step-time factors (e.g. the quantiles of measured / predicted step time), drawn uniformly
    #: per simulated step with the run's seed; None: every step takes exactly its predicted time
    step_noise: list[float] | None = None
    step_noise_source: str = ""
    #: step_noise by predicted step cost: ``(up_to_s, factors)`` in ascending ``up_to_s``, the last ``inf``;
    #: a step draws from the first bin whose bound is at least its cost (short steps jitter more, relatively)
    step_noise_bins: list[tuple[float, list[float]]] | None = None
    #: step_noise of a steady decode step (decode rows only, each of a sequence that decoded before): a
    #: sequence's first decode step now and then waits ten times its cost, a steady one does not, and a
    #: quiet decode's p99 ITL is made of the steady steps' jitter; None: such steps draw by cost too
    steady_noise: list[float] | None = None
    #: the per-step cost model fitted to engine traces; when set, :meth:`step_cost` is its cost
    step_model: StepModel | None = None
    #: the server front's latency (quanta.sim.front); None: requests reach the engine as they are sent
    front: FrontModel | None = None
    #: a step after an idle engine is slower (:class:`Wake`); None: it is not
    wake: Wake | None = None

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            d = d if isinstance(d, dict) else {}
            raise ProfileError(f"not a cost profile: format is {d.get('format')!r}, expected {FORMAT!r}")
        try:
            pre, dec = d["prefill"], d["decode"]
            p = cls(
                prefill_points=[(float(x), float(y)) for x, y in pre["points"]],
                decode_points=[(float(x), float(y)) for x, y in dec["points"]],
                overhead_s=float(d.get("overhead_s", 0.0)),
                prefill_axis=pre.get("axis", "chunk_tokens"),
                prefill_ctx=float(pre.get("context_s_per_token_per_pos", 0.0)),
                decode_ctx=float(dec.get("context_s_per_pos", 0.0)),
                mixed_decode_factor=float(d.get("mixed_decode_factor", 1.0)),
                moe=pre.get("moe"),
                meta={k: v for k, v in d.items()
                      if k not in ("format", "prefill", "decode", "overhead_s", "mixed_decode_factor", "step_noise",
                                   "step_model", "front", "wake")},
                step_noise=[float(f) for f in d["step_noise"]["factors"]] if d.get("step_noise") else None,
                step_noise_source=str((d.get("step_noise") or {}).get("source", "")),
                step_noise_bins=_noise_bins((d.get("step_noise") or {}).get("by_cost")),
                steady_noise=_factors((d.get("step_noise") or {}).get("steady_decode")),
                step_model=_step_model(d.get("step_model")),
                front=_front(d.get("front")),
                wake=Wake.from_dict(d["wake"]) if d.get("wake") is not None else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"malformed cost profile: {exc!r}") from exc
        p.validate()
        return p

    def validate(self) -> None:
        for name, pts in (("prefill", self.prefill_points), ("decode", self.decode_points)):
            if not pts:
                raise ProfileError(f"{name}.points is empty")
            xs = [x for x, _ in pts]
            if xs != sorted(xs) or len(set(xs)) != len(xs) or xs[0] <= 0:
                raise ProfileError(f"{name}.points must have positive, strictly ascending x")
            if any(y < 0 or not math.isfinite(y) for _, y in pts):
                raise ProfileError(f"{name}.points costs must be finite and >= 0")
        if self.prefill_axis not in ("chunk_tokens", "tokens_per_expert"):
            raise ProfileError(f"prefill.axis must be chunk_tokens or tokens_per_expert, got {self.prefill_axis!r}")
        if self.prefill_axis == "tokens_per_expert" and not (self.moe and self.moe.get("num_experts") and self.moe.get("top_k")):
            raise ProfileError("prefill.axis tokens_per_expert needs prefill.moe with num_experts and top_k")
        scalars = (self.overhead_s, self.prefill_ctx, self.decode_ctx, self.mixed_decode_factor)
        if not all(math.isfinite(x) and x >= 0 for x in scalars):
            raise ProfileError("overhead_s, context coefficients and mixed_decode_factor must be finite and >= 0")
        if self.moe is not None and not (isinstance(self.moe, dict) and all(
                isinstance(self.moe.get(k), int) and self.moe[k] >= 1 for k in ("num_experts", "top_k"))):
            raise ProfileError("prefill.moe needs integer num_experts and top_k >= 1")
        if self.step_noise is not None and (not self.step_noise or any(not (f > 0 and math.isfinite(f)) for f in self.step_noise)):
            raise ProfileError("step_noise.factors must be a non-empty list of finite factors > 0")
        if self.steady_noise is not None and (not self.steady_noise or self.step_noise is None or any(
                not (f > 0 and math.isfinite(f)) for f in self.steady_noise)):
            raise ProfileError("step_noise.steady_decode must be a non-empty list of finite factors > 0, beside step_noise.factors")
        if self.step_noise_bins is not None:
            bounds = [b for b, _ in self.step_noise_bins]
            if not bounds or bounds != sorted(set(bounds)) or bounds[-1] != math.inf or bounds[0] <= 0:
                raise ProfileError("step_noise.by_cost: up_to_s must be positive, strictly ascending, the last null")
            if any(not fs or any(not (f > 0 and math.isfinite(f)) for f in fs) for _, fs in self.step_noise_bins):
                raise ProfileError("step_noise.by_cost: every bin needs a non-empty list of finite factors > 0")
        if self.wake is not None:
            self.wake.validate()
        kv_geometry(self)

    def to_dict(self) -> dict:
        pre = {"axis": self.prefill_axis, "points": [list(p) for p in self.prefill_points],
               "context_s_per_token_per_pos": self.prefill_ctx}
        if self.moe:
            pre["moe"] = self.moe
        d = {"format": FORMAT, **{k: v for k, v in self.meta.items()}, "overhead_s": self.overhead_s,
             "prefill": pre, "decode": {"points": [list(p) for p in self.decode_points], "context_s_per_pos": self.decode_ctx},
             "mixed_decode_factor": self.mixed_decode_factor}
        if self.step_noise:
            d["step_noise"] = {"factors": list(self.step_noise), "source": self.step_noise_source}
            if self.step_noise_bins:
                d["step_noise"]["by_cost"] = [{"up_to_s": None if math.isinf(b) else b, "factors": list(fs)}
                                              for b, fs in self.step_noise_bins]
            if self.steady_noise:
                d["step_noise"]["steady_decode"] = list(self.steady_noise)
        if self.step_model is not None:
            d["step_model"] = self.step_model.to_dict()
        if self.front is not None:
            d["front"] = self.front.to_dict()
        if self.wake is not None:
            d["wake"] = asdict(self.wake)
        return d

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ProfileError(f"cannot read profile {path}: {exc}") from exc
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    # ------------------------------------------------------------------ cost model
    def prefill_x(self, num_tokens: int) -> float:
        """The prefill axis value of a forward carrying ``num_tokens`` prompt tokens.

        ``tokens_per_expert``: ``num_tokens * top_k / E_hit`` with ``E_hit`` the
        expected number of distinct experts hit under uniform routing,
        ``E * (1 - (1 - 1/E) ** (num_tokens * top_k))``.
        """
        if self.prefill_axis == "chunk_tokens":
            return float(num_tokens)
        e, k = self.moe["num_experts"], self.moe["top_k"]
        hit = e * (1.0 - (1.0 - 1.0 / e) ** (num_tokens * k))
        return num_tokens * k / max(hit, 1e-12)

    def prefill_per_token(self, num_tokens: int) -> float:
        """Seconds per token of pure prefill for a forward of ``num_tokens`` prompt tokens."""
        return _interp_log(self.prefill_points, self.prefill_x(num_tokens))

    def prefill_cost(self, chunks: list[tuple[int, int]]) -> float:
        """Seconds of the prefill part of a forward: ``chunks`` are (start position, tokens).

        ``N * per_token(N) + ctx * sum(n * (start + (n - 1) / 2))`` with N the prompt
        tokens of the forward (all chunks together: one batched forward).
        """
        n = sum(c for _, c in chunks)
        if n == 0:
            return 0.0
        ctx = sum(c * (s + (c - 1) / 2.0) for s, c in chunks)
        return n * self.prefill_per_token(n) + self.prefill_ctx * ctx

    def decode_cost(self, positions: list[int]) -> float:
        """Seconds of a decode step over sequences at context ``positions``."""
        if not positions:
            return 0.0
        return _interp_lin(self.decode_points, float(len(positions))) + self.decode_ctx * sum(positions)

    def noise_factors(self, cost: float, steady: bool = False) -> list[float] | None:
        """The step-noise factors a step of predicted ``cost`` seconds draws from (None: no noise); ``steady``:
        the step is a steady decode (:attr:`steady_noise`)."""
        if steady and self.steady_noise:
            return self.steady_noise
        if self.step_noise_bins:
            return next(fs for bound, fs in self.step_noise_bins if cost <= bound)
        return self.step_noise

    def step_cost(self, prefill_chunks: list[tuple[int, int]], decode_positions: list[int], prefix_hit: int = 0) -> float:
        """Seconds of one forward call: with a :attr:`step_model`, its cost (``prefix_hit``: prompt
        tokens of the step's new sequences taken from the prefix cache); else the combination rule::

            overhead + prefill_cost(prefill chunks) + f * decode_cost(decodes)

        with ``f = 1`` for a pure decode step and ``f = mixed_decode_factor`` when
        the step also carries prefill (a fused ``mixed`` step).
        """
        if self.step_model is not None:
            return self.step_model.cost(prefill_chunks, decode_positions, prefix_hit)
        f = self.mixed_decode_factor if prefill_chunks else 1.0
        return self.overhead_s + self.prefill_cost(prefill_chunks) + f * self.decode_cost(decode_positions)


def kv_geometry(profile: Profile) -> dict | None:
    """The profile's KV geometry (its ``kv`` block), or None when it has none.

    Raises:
        ProfileError: a ``kv`` block without positive integer layers, KV heads and head dim, or with a
            dtype other than float32, bfloat16, float16 or q8_0.
    """
    kv = profile.meta.get("kv")
    if kv is None:
        return None
    if not isinstance(kv, dict) or not all(isinstance(kv.get(k), int) and kv[k] >= 1 for k in KV_KEYS) \
            or kv.get("dtype") not in KV_DTYPES:
        raise ProfileError(f"kv needs positive integer {', '.join(KV_KEYS)} and a dtype among "
                           f"{', '.join(KV_DTYPES)}, got {kv!r}")
    return kv


def _interp_log(points: list[tuple[float, float]], x: float) -> float:
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


def _interp_lin(points: list[tuple[float, float]], x: float) -> float:
    if len(points) == 1:
        return points[0][1]
    xs = [p[0] for p in points]
    if x <= xs[0]:
        (x0, y0), (x1, y1) = points[0], points[1]
        return max(0.0, y0 + (x - x0) * (y1 - y0) / (x1 - x0)) if x < x0 else y0
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (x - x0) * (y1 - y0) / (x1 - x0))


def _step_model(d: dict | None) -> StepModel | None:
    if d is None:
        return None
    from quanta.sim.step_model import StepModel

    return StepModel.from_dict(d)


def _front(d: dict | None) -> FrontModel | None:
    if d is None:
        return None
    from quanta.sim.front import FrontModel

    return FrontModel.from_dict(d)


def _factors(raw) -> list[float] | None:
    return None if raw is None else [float(f) for f in raw]


def _noise_bins(raw) -> list[tuple[float, list[float]]] | None:
    """``step_noise.by_cost`` as ``(up_to_s, factors)`` pairs (a null bound is ``inf``); None when absent."""
    if raw is None:
        return None
    return [(math.inf if b["up_to_s"] is None else float(b["up_to_s"]), [float(f) for f in b["factors"]]) for b in raw]
