"""Teacher-forced agreement of quanta's next-token distributions with another engine's.

A *case* is one token sequence, ``tokens``, whose first ``first`` tokens are the prompt; its
*positions* are the ``len(tokens) - first`` rows whose next token is a continuation token
(rows ``first - 1`` to ``len(tokens) - 2``), plus nothing after the last token. The other
engine gives, for each position, its top-k ``[token id, logprob]`` pairs (llama-server's
``n_probs``: raw log-softmax of the logits, no sampling); :func:`compare` checks quanta's
log-softmax at the same positions against them:

- top-1 agreement: quanta's argmax is the other engine's top-1 token;
- ``|logprob difference|`` over the other engine's top 5 tokens at each position (max, median);
- near ties: positions where the other engine's top two logprobs are closer than a margin.

quanta runs as ``quanta serve`` loads a model (:func:`load_as_served`: ``--quantization auto``,
``--prompt-weights auto``, the default dtype and KV cache dtype) and computes each sequence as
one prompt, so every position sees exactly the sequence's earlier tokens (teacher forcing).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from quanta.launch import LoadedModel, load_model, resolve_dtype, resolve_kv_dtype
from quanta.model.attention import AttentionBatch, KVCache, SeqSlice, blocks_for

#: top tokens per position whose logprobs are compared
TOP = 5
#: the KV cache's positions per block
_BLOCK = 16


def load_as_served(path: str | Path, dtype: torch.dtype | None = None) -> LoadedModel:
    """The model of ``path`` loaded as ``quanta serve`` loads it with its default flags (``dtype``:
    the compute dtype instead of the machine's default, bfloat16 on hosts with native bf16)."""
    return load_model(str(path), dtype or resolve_dtype(None), "auto", True, "auto")


def position_logprobs(loaded: LoadedModel, tokens: list[int], first: int) -> torch.Tensor:
    """``[len(tokens) - first + 1, vocab]`` float32 log-softmax of the logits after each of
    ``tokens[first - 1:]``, ``tokens`` computed as one prompt in a fresh KV cache of the dtype
    ``quanta serve`` picks."""
    model, cfg = loaded.model, loaded.config
    if not 0 < first <= len(tokens):
        raise ValueError(f"the prompt length must be in 1..{len(tokens)}, got {first}")
    blocks = blocks_for(len(tokens), _BLOCK)
    kv = KVCache(cfg.num_hidden_layers, blocks, cfg.num_key_value_heads, _BLOCK, cfg.head_dim,
                 resolve_kv_dtype("auto", model.dtype))
    batch = AttentionBatch([SeqSlice(list(range(blocks)), 0, len(tokens))], kv)
    with torch.no_grad():
        hidden = model(torch.tensor(tokens, dtype=torch.long), batch)
        logits = model.compute_logits(hidden[first - 1:])
    return torch.log_softmax(logits.float(), dim=-1)


def compare(top: list[list[list[float]]], logprobs: torch.Tensor, margin: float = 0.0) -> dict:
    """quanta's ``logprobs`` (``[positions, vocab]``, :func:`position_logprobs`) against the other
    engine's ``top`` (per position, its ``[token id, logprob]`` pairs, best first; extra rows of
    ``logprobs`` ignored).

    Returns:
        ``positions``, ``top1`` (positions whose argmax agrees), ``diffs`` (every
        ``|logprob difference|`` over the top :data:`TOP` tokens, position by position),
        ``near_ties`` (positions whose top two logprobs differ by less than ``margin``) and
        ``decisive_top1`` (the positions of ``top1`` that are not near ties).
    """
    diffs: list[float] = []
    agree = near = decisive_agree = 0
    for row, pairs in zip(logprobs, top, strict=False):
        pairs = pairs[:TOP]
        same = int(row.argmax()) == int(pairs[0][0])
        tie = len(pairs) > 1 and pairs[0][1] - pairs[1][1] < margin
        agree, near, decisive_agree = agree + same, near + tie, decisive_agree + (same and not tie)
        diffs += [abs(float(row[int(token)]) - logprob) for token, logprob in pairs]
    return {"positions": min(len(top), len(logprobs)), "top1": agree, "diffs": diffs, "near_ties": near,
            "decisive_top1": decisive_agree}


def summarize(results: list[dict]) -> dict:
    """One summary of several :func:`compare` results: ``positions``, ``top1_share``, ``max_diff``,
    ``median_diff``, ``near_ties``, ``decisive_top1_share`` (top-1 agreement where no near tie)."""
    diffs = [d for r in results for d in r["diffs"]]
    positions = sum(r["positions"] for r in results)
    near = sum(r["near_ties"] for r in results)
    return {"positions": positions, "top1_share": sum(r["top1"] for r in results) / max(positions, 1),
            "max_diff": max(diffs, default=0.0), "median_diff": statistics.median(diffs) if diffs else 0.0,
            "near_ties": near, "decisive_top1_share": sum(r["decisive_top1"] for r in results) / max(positions - near, 1)}


def spread(a: list[list[list[float]]], b: list[list[list[float]]]) -> list[float]:
    """``|logprob difference|`` between two engines' (or files') top lists at the same positions,
    over ``a``'s top :data:`TOP` tokens that ``b`` lists too (``b`` should list more, e.g. 40)."""
    out = []
    for pa, pb in zip(a, b, strict=True):
        found = {int(t): lp for t, lp in pb}
        out += [abs(lp - found[int(t)]) for t, lp in pa[:TOP] if int(t) in found]
    return out
