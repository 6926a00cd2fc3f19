"""The executor interface: runs a :class:`StepPlan`.

An executor returns, for each chunk of the plan, the sampled next token, or
None for a prefill chunk that leaves prompt tokens to compute.
:class:`~quanta.engine.model_executor.ModelExecutor` runs the real model; the
simulator's cost-model executor returns the same shape. This module imports
no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from quanta.engine.scheduler import StepPlan


class Executor(ABC):
    @abstractmethod
    def execute(self, plan: StepPlan) -> list[int | None]:
        """Run ``plan``; one entry per chunk: the sampled token or None."""

    def release(self, seq_id: int) -> None:
        """Forget per-sequence state of a finished sequence (default: none kept)."""

