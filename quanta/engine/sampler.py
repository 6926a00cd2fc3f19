"""The sampler that turns logits into next tokens.

Order of logit processing follows vLLM: a request's grammar mask
(:class:`~quanta.engine.sampling.TokenConstraint`), penalties, temperature,
then top-k, top-p and min-p filters; greedy (argmax) when ``temperature ==
0``. Log-probabilities (``SamplingParams.logprobs``) are taken from the raw
logits, as vLLM returns them by default. Rows without a constraint or
penalties that sample greedily take the batch's argmax and skip all of this.
"""

from __future__ import annotations

from collections import Counter

import torch

from quanta.engine.sampling import MIN_TEMPERATURE, FailedSample, SamplingParams, TokenLogprob


class Sampler:
    """Samples one token per row of logits, each row with its own parameters."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]], keys: list[int]) -> list[int]:
        """Pick next tokens.

        Args:
            logits: ``[N, vocab]`` float32.
            params: N sampling settings.
            histories: N lists of already generated token ids (for penalties).
            keys: N sequence ids; a seeded request keeps its generator under its key.

        Returns:
            N token ids; a row whose sampling raised is a :class:`FailedSample`
            carrying the exception, so that its request fails alone.
        """
        greedy = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for i, p in enumerate(params):
            try:
                out.append(self._sample_row(logits[i], greedy[i], p, histories[i], keys[i]))
            except Exception as exc:  # this row's request fails alone (Engine.step)
                out.append(FailedSample(exc))
        return out

    def _sample_row(self, raw: torch.Tensor, greedy: int, p: SamplingParams, history: list[int], key: int) -> int:
        if p.greedy and not (p.presence_penalty or p.frequency_penalty) and p.constraint is None:
            token = greedy
        else:
            row = raw.clone()
            if p.constraint is not None:
                p.constraint.mask(row)
            row = _penalize(row, history, p)
            token = int(row.argmax()) if p.greedy else self._draw(row, p, key)
        if p.constraint is not None:
            p.constraint.accept(token)
        if p.logprobs is not None:
            p.logprob_records.append(_logprob(raw, token, p.logprobs))
        return token

    def forget(self, key: int) -> None:
        """Drop the generator of a finished sequence."""
        self._generators.pop(key, None)

    def _draw(self, row: torch.Tensor, p: SamplingParams, key: int) -> int:
        probs = _filtered_probs(row / max(p.temperature, MIN_TEMPERATURE), p)
        gen = None
        if p.seed is not None:
            gen = self._generators.get(key)
            if gen is None:
                gen = self._generators[key] = torch.Generator().manual_seed(p.seed)
        return int(torch.multinomial(probs, 1, generator=gen))


def _logprob(raw: torch.Tensor, token: int, top: int) -> TokenLogprob:
    logp = torch.log_softmax(raw.float(), dim=-1)
    pairs = []
    if top:
        values, ids = torch.topk(logp, top)
        pairs = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logp[token]), pairs)


def _penalize(row: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    if not history or not (p.presence_penalty or p.frequency_penalty):
        return row
    counts = Counter(history)
    ids = torch.tensor(list(counts.keys()), dtype=torch.long)
    freq = torch.tensor(list(counts.values()), dtype=row.dtype)
    row[ids] -= p.frequency_penalty * freq + p.presence_penalty
    return row


def _filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop_sorted = cumulative - sorted_probs > p.top_p
        probs = probs.masked_fill(drop_sorted.scatter(0, order, drop_sorted), 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()
