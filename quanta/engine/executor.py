"""The executor interface: runs a :class:`StepPlan`, returns a :class:`StepResult`.

:class:`~quanta.engine.model_executor.ModelExecutor` runs the real model; the
simulator's cost-model executor returns the same shape. This module imports
no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
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


class StepInterrupted(Exception):
    """Raised by a step's ``interrupt`` check: every request in the step was cancelled, so its
    forward stops where it is (nothing of the step counts as computed)."""


class Executor(ABC):
    @abstractmethod
    def execute(self, plan: StepPlan, interrupt: Callable[[], None] | None = None) -> StepResult:
        """Run ``plan``; ``tokens`` has one entry per chunk: the sampled token or None.

        ``interrupt``, when given, is called at points inside a long forward (the real model:
        after each decoder block of the prompt rows) and may raise :class:`StepInterrupted`
        to end the step there; an executor without such points never calls it."""

    def release(self, seq_id: int) -> None:
        """Forget per-sequence state of a finished sequence (default: none kept)."""
        return None
