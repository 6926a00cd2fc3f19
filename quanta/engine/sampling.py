"""Per-request sampling settings and what the sampler returns: torch-free.

The sampler that applies them to logits is :class:`quanta.engine.sampler.Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

#: Temperatures in (0, 0.01) sample as 0.01: dividing float32 logits by less
#: overflows them to inf and the softmax to NaN (vLLM clamps the same way).
MIN_TEMPERATURE = 1e-2

#: Seeds are 64-bit signed integers, as in vLLM (``torch.Generator`` refuses more).
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI names and ranges).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it (0-2;
            values below :data:`MIN_TEMPERATURE` act as it).
        top_p: nucleus mass kept, (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens below ``min_p * p_max``, [0, 1].
        seed: makes sampling reproducible per request (in :data:`SEED_RANGE`).
        stop: strings that end generation; the stop string is not returned.
        stop_token_ids: token ids that end generation, besides EOS.
        ignore_eos: keep generating past EOS (benchmarks use it for fixed lengths).
        presence_penalty / frequency_penalty: OpenAI penalties on generated
            tokens, each in [-2, 2].
        constraint: a :class:`TokenConstraint` (grammar) masking each step's
            logits and told each sampled token; None samples freely.
        logprobs: record the sampled token's log-probability and this many
            top alternatives (0-20) per step into ``logprob_records``; None: off.
        logprob_records: filled by the sampler, one :class:`TokenLogprob` per
            sampled token (the server creates the list).
        cache_salt: prefix reuse happens only between requests with the same
            salt (None matches only None; as vLLM's ``cache_salt``), so a
            client cannot probe another's prompt through cached-token counts.
        skip_special_tokens: the output text leaves special tokens out (as
            vLLM's); False keeps them (a tool-call format whose markers are
            special tokens) and leaves out only the end-of-output tokens.

    Raises:
        ValueError: a value out of its range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    constraint: TokenConstraint | None = None
    logprobs: int | None = None
    logprob_records: list[TokenLogprob] = field(default_factory=list)
    cache_salt: str | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be between 0 and 1"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2"),
            (self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed must be a 64-bit signed integer"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "top_logprobs must be between 0 and 20"),
            (self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
             "cache_salt must be a non-empty string"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TokenConstraint(Protocol):
    """Per-request token filter (a grammar matcher, :mod:`quanta.engine.grammar`)."""

    def mask(self, row: torch.Tensor) -> None:
        """Set the logits of tokens not allowed next to ``-inf``, in place (``row``: ``[vocab]``)."""

    def accept(self, token: int) -> None:
        """Advance past the sampled ``token``."""


@dataclass(slots=True)
class TokenLogprob:
    """One sampled token's natural-log probability under the model's raw
    distribution, and the ``top`` most likely ``(token_id, logprob)`` pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class FailedSample(int):
    """A sampled token that is not one: the row's sampling raised ``error``.

    Its value (-1) is no token id; :meth:`quanta.engine.engine.Engine.step`
    fails the row's request alone when it sees one.
    """

    error: Exception

    def __new__(cls, error: Exception) -> FailedSample:
        self = super().__new__(cls, -1)
        self.error = error
        return self
