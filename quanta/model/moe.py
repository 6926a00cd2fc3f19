"""Mixture-of-Experts block: a router, routed SwiGLU experts and optional shared experts.

Replaces the dense MLP in the layers of an MoE model (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, dots1 / DeepSeek-style); attention is shared with the dense
model. Input and output are the flattened ``[T, hidden]`` tokens of a step.

Expert execution groups tokens by expert: the ``T * K`` (token, expert) pairs
are sorted by expert id, each *active* expert runs one matmul pair on its
contiguous rows (not one per token), and the weighted rows are summed back
per token with one ``index_add_``. bf16 expert weights are pre-packed for
oneDNN like :class:`~quanta.model.linear.PackedLinear` (measured on the 2-core
dev machine, 512x256 experts: ~0.25 ms per expert call packed vs ~0.3-0.45 ms
with ``F.linear`` / ``torch.mm`` at 1-12 rows).

Each forward records, per block, the number of unique experts hit, the rows
routed (``T * K``) and its wall time (two ``perf_counter`` calls);
:func:`expert_stats` averages the counts over layers and sums the times.

Reference: transformers' ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``,
``Qwen3MoeSparseMoeBlock``, ``OlmoeSparseMoeBlock`` and ``Dots1MoE`` (router
``Dots1TopkRouter``, the DeepSeek-V3 "noaux_tc" scheme), which
``tests/test_moe_model.py`` checks against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quanta.model.config import ModelConfig
from quanta.model.linear import PackedLinear, pack_weight
from quanta.model.native import forms as native_forms
from quanta.model.quant import QuantizedWeight


class Router(nn.Module):
    """Top-k expert selection.

    ``softmax`` scoring (Mixtral, Qwen-MoE, OLMoE): ``p = softmax(x W^T)`` in
    float32, keep the K largest, renormalize them when ``norm_topk_prob``
    (Mixtral always does; Qwen/OLMoE per config).

    ``sigmoid`` scoring (DeepSeek-V3 / dots1): ``s = sigmoid(x W^T)`` in
    float32; experts are *chosen* by ``s + bias`` restricted to the best
    ``topk_group`` of ``n_group`` groups (group score: sum of its two best),
    *weighted* by ``s``; optional renormalization, then times
    ``routed_scaling_factor``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.scoring = cfg.router_scoring
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.router_n_group, cfg.router_topk_group
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if self.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, E]`` float32 router logits. A float32 router (a GGUF's, read from its
        blocks) is multiplied by quanta's C kernel where it loads, each row the same whatever rows
        share the call (a torch matmul's row can move with the rows beside it, and flip a near-tied
        expert); else by ``F.linear`` in the weight's dtype."""
        if self.weight.dtype == torch.float32 and native_forms.available():
            return native_forms.f16_matmul(x.float(), self.weight)
        return F.linear(x, self.weight).float()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, H]`` -> (``[T, K]`` int64 expert ids, ``[T, K]`` float32 weights)."""
        if self.scoring == "softmax":
            probs = torch.softmax(self.logits(x), dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return ids, weights
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1)[1], 1.0)
            choice = grouped.masked_fill(keep[..., None] == 0, float("-inf")).view_as(choice)
        ids = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale


class RoutedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights (transformers v5 layout), or as two C forms holding every
    expert's rows (:meth:`use_forms`: a GGUF's experts from their own blocks).

    Attributes:
        gate_up_proj: ``[E, 2 * I, H]`` (gate rows first, then up); absent with forms.
        down_proj: ``[E, H, I]``; absent with forms.
        forms: with forms, ``(gate_up, down)``: ``[E * 2I, H]`` (expert ``e``'s gate rows, then its
            up rows, at ``e * 2I``) and ``[E * H, I]``; else empty.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))
        self._packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.forms: tuple[QuantizedWeight, QuantizedWeight] | tuple[()] = ()
        self._expert_forms: list[tuple[QuantizedWeight, QuantizedWeight]] = []

    def use_forms(self, gate_up: QuantizedWeight, down: QuantizedWeight) -> None:
        """Compute every expert with its rows of ``gate_up`` and ``down`` (shapes as :attr:`forms`)
        and drop the 3-D weights."""
        e, i, h = self.num_experts, self.intermediate, self.hidden
        if gate_up.shape != (e * 2 * i, h) or down.shape != (e * h, i):
            raise ValueError(f"expert forms {gate_up.shape} / {down.shape} do not hold {e} experts of "
                             f"{2 * i} x {h} and {h} x {i}")
        del self.gate_up_proj, self.down_proj
        self.forms = (gate_up, down)
        self._expert_forms = [(gate_up.part(x * 2 * i, (x + 1) * 2 * i), down.part(x * h, (x + 1) * h)) for x in range(e)]
        self._packed = None

    def pack(self) -> int:
        """Pre-pack every expert's bf16 weights for oneDNN; returns matrices packed (0 in fp32 or with forms)."""
        if self.forms or self.gate_up_proj.dtype != torch.bfloat16:
            self._packed = None
            return 0
        pairs = [(pack_weight(self.gate_up_proj[e].detach()), pack_weight(self.down_proj[e].detach())) for e in range(self.num_experts)]
        if any(a is None or b is None for a, b in pairs):
            self._packed = None
            return 0
        self._packed = pairs
        return 2 * len(pairs)

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> ``[n, H]`` through expert ``e``."""
        if self._expert_forms:
            gu, dn = self._expert_forms[e]
            gate, up = gu(rows).split(self.intermediate, dim=-1)
            return dn(F.silu(gate) * up)
        if self._packed is None:
            gate, up = F.linear(rows, self.gate_up_proj[e]).split(self.intermediate, dim=-1)
            return F.linear(F.silu(gate) * up, self.down_proj[e])
        gu, dn = self._packed[e]
        gate, up = torch.ops.mkldnn._linear_pointwise(rows, gu, None, "none", [], "").split(self.intermediate, dim=-1)
        return torch.ops.mkldnn._linear_pointwise(F.silu(gate) * up, dn, None, "none", [], "")

    @torch.no_grad()  # inference only (``out=`` writes); a no-op inside the model's inference_mode
    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Weighted sum of each token's K experts.

        Args:
            x: ``[T, H]`` hidden states.
            ids: ``[T, K]`` expert ids.
            weights: ``[T, K]`` float32 routing weights.

        Returns:
            (``[T, H]`` in ``x``'s dtype, number of unique experts hit).
        """
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k
        rows = x.index_select(0, token_of)  # [T*K, H], expert-contiguous
        row_weights = weights.reshape(-1)[order, None]  # [T*K, 1] float32
        if self.forms and self.forms[0].native and self.forms[1].native:
            groups = [(e, n) for e, n in enumerate(counts) if n]
            gate, up = self.forms[0].experts(rows, 2 * self.intermediate, groups).split(self.intermediate, dim=-1)
            weighted = self.forms[1].experts(F.silu(gate) * up, self.hidden, groups) * row_weights
            out = torch.zeros(t, x.shape[1], dtype=torch.float32).index_add_(0, token_of, weighted)
            return out.to(x.dtype), len(groups)
        weighted = torch.empty(rows.shape, dtype=torch.float32)  # weighted expert outputs, float32
        start = 0
        active = 0
        for e, n in enumerate(counts):
            if n:
                end = start + n
                torch.mul(self._expert(e, rows[start:end]), row_weights[start:end], out=weighted[start:end])
                start = end
                active += 1
        out = torch.zeros(t, x.shape[1], dtype=torch.float32).index_add_(0, token_of, weighted)
        return out.to(x.dtype), active


class SharedExpert(nn.Module):
    """Always-on SwiGLU expert with fused gate/up (Qwen2-MoE ``shared_expert``, dots1 ``shared_experts``)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = PackedLinear(hidden, 2 * intermediate, bias=False)
        self.down_proj = PackedLinear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoEBlock(nn.Module):
    """Router + routed experts (+ shared expert, optionally sigmoid-gated).

    ``forward`` maps ``[T, H]`` to ``[T, H]`` and leaves the step's expert
    statistics in :attr:`last_unique_experts` / :attr:`last_routed_rows` and
    its wall time (seconds, router to output) in :attr:`last_seconds`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.last_unique_experts = 0
        self.last_routed_rows = 0
        self.last_seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        ids, weights = self.gate(x)
        out, self.last_unique_experts = self.experts(x, ids, weights)
        self.last_routed_rows = ids.numel()
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        self.last_seconds = time.perf_counter() - start
        return out


@dataclass(slots=True)
class ExpertStats:
    """Expert activity of one forward pass, averaged over the MoE layers.

    Attributes:
        num_tokens: tokens in the pass (T).
        unique_experts: mean over layers of the experts hit at least once.
        tokens_per_expert: mean over layers of ``T * K / unique`` (rows each
            active expert computes).
        num_layers: MoE layers averaged.
        seconds: wall time of the MoE blocks, summed over layers.
    """

    num_tokens: int
    unique_experts: float
    tokens_per_expert: float
    num_layers: int
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"num_tokens": self.num_tokens, "unique_experts": round(self.unique_experts, 3),
                "tokens_per_expert": round(self.tokens_per_expert, 3), "num_layers": self.num_layers,
                "seconds": round(self.seconds, 6)}


def expert_stats(blocks: list[MoEBlock], num_tokens: int) -> ExpertStats | None:
    """Average the last forward's statistics of ``blocks``; None when there are none."""
    if not blocks:
        return None
    unique = [b.last_unique_experts for b in blocks]
    per_expert = [b.last_routed_rows / u for b, u in zip(blocks, unique) if u]
    return ExpertStats(
        num_tokens, sum(unique) / len(unique), sum(per_expert) / len(per_expert) if per_expert else 0.0, len(blocks),
        sum(b.last_seconds for b in blocks),
    )
