"""The executor interface: runs a :class:`StepPlan`, returns a :class:`StepResult`.

:class:`~quanta.engine.model_executor.ModelExecutor` runs the real model; the
simulator's cost-model executor returns the same shape. This module imports
no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from quanta.engine.scheduler import StepPlan


@dataclass(slots=True)
class StepResult:
    """What one executed step produced.

    Attributes:
        tokens: one entry per chunk of the plan, in order: the sampled next
            token (a :class:`~quanta.engine.sampling.FailedSample` when that
            row's sampling raised), or None for a prefill chunk that leaves
            prompt tokens to compute.
        experts: MoE models only: expert activity of the step's forward pass,
            copied as is into :attr:`StepRecord.experts
            <quanta.engine.trace.StepRecord.experts>`; None otherwise.
    """

    tokens: list[int | None]
    experts: dict | None = None


class Executor(ABC):
    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan``; ``tokens`` has one entry per chunk: the sampled token or None."""

    def release(self, seq_id: int) -> None:
        """Forget per-sequence state of a finished sequence (default: none kept)."""
        return None
