""":class:`ModelExecutor` runs a :class:`StepPlan` through the real model.

Returns, like every :class:`~quanta.engine.executor.Executor`, a
:class:`~quanta.engine.executor.StepResult`: the sampled next token for each
chunk (None for a prefill chunk that leaves prompt tokens to compute) and, on
MoE models, the step's expert statistics.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager

import torch

from quanta.config import DEFAULT_BLOCK_SIZE
from quanta.engine.executor import Executor, StepResult
from quanta.engine.sampler import Sampler
from quanta.engine.scheduler import StepPlan
from quanta.model import native
from quanta.model.attention import AttentionBatch, KVCache, KVFormat, SeqSlice
from quanta.model.cores import default_threads
from quanta.model.llama import LlamaModel


def default_decode_threads(cores: int | None = None) -> int:
    """Intra-op threads for decode-sized steps: all cores this process may run on (its affinity,
    e.g. a ``taskset`` or a ``bench sweep --ray`` slot) but one, at least 1.

    A decode step is a few hundred tiny ops; with every core in torch's OpenMP
    pool, the HTTP server's event loop and a local client preempt a pool
    thread and the whole step waits for it. Measured on the 2-core dev VM
    (``quanta serve`` + ``quanta bench run`` on one machine, embedded model,
    int4 decode): one stream 35.5 -> 22.3 ms per token, 8 streams 81 -> 54 ms
    per step, with 1 thread instead of 2.
    """
    cores = cores or len(os.sched_getaffinity(0)) or 1
    return max(1, cores - 1)


#: steps with at most this many tokens run on the decode thread count
DECODE_STEP_TOKENS = 64


class ModelExecutor(Executor):
    """Runs plans through a :class:`LlamaModel` over a paged KV cache.

    A sequence's block table is its ``block_ids``, which the scheduler's block
    accounting (:class:`~quanta.engine.kv_blocks.BlockTables`) fills; the pool
    is allocated uninitialized, so blocks no sequence has reached are not resident.

    Args:
        model: the loaded model (its parameters' dtype is the compute dtype).
        num_blocks: KV blocks of the pool.
        block_size: positions per KV block (a multiple of 8).
        kv_dtype: the KV cache's elements (a dtype, a :class:`~quanta.model.attention.KVFormat` or its name; None: the model's dtype).
        decode_threads: intra-op threads of steps of at most
            ``DECODE_STEP_TOKENS`` tokens (None: torch's thread count at
            construction, which larger steps use; ``quanta serve`` sets
            :func:`default_decode_threads`). A step the native decoder's C
            kernels carry runs torch on 1 thread instead
            (:meth:`quanta.model.native_decode.NativeDecoder.claim_threads`); the
            LM head gets its own split (``head_threads``: all of torch's threads
            for a head outside the C forms).
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 decode_threads: int | None = None, kv_dtype: torch.dtype | KVFormat | None = None) -> None:
        self.prefill_threads = torch.get_num_threads()
        self.decode_threads = min(decode_threads or self.prefill_threads, self.prefill_threads)
        cfg = model.config
        dtype = model.dtype
        self.model = model
        #: every matmul a C form (a GGUF's blocks) on torch's decode path (no native decoder: Gemma, OLMoE's clipped norms)
        self._blocks = model.native is None and model.weight_forms[0] == "blocks"
        self.kv = KVCache(cfg.num_hidden_layers, num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim, kv_dtype or dtype)
        self.sampler = Sampler()

    def execute(self, plan: StepPlan, interrupt: Callable[[], None] | None = None) -> StepResult:
        """Run the plan's prompt chunks and its decode tokens as two forwards (either may be
        empty), then one LM head over every sampled row.

        A row's role, not the step's mix, picks its kernels (:mod:`quanta.model.linear`):
        a decode token is computed the same whether or not a prefill chunk shares its step,
        and a prompt position the same whichever chunk holds it. ``interrupt`` is called after
        each decoder block of the prompt forward (:class:`~quanta.engine.executor.StepInterrupted`
        ends the step there)."""
        prompt = [c for c in plan.chunks if c.seq.is_prefilling]
        decode = [c for c in plan.chunks if not c.seq.is_prefilling]
        hidden, samplers = [], []
        for chunks, is_decode in ((prompt, False), (decode, True)):
            if chunks:
                rows, seqs = self._forward(chunks, is_decode, None if is_decode else interrupt)
                hidden.append(rows)
                samplers += seqs
        tokens = self._sample(torch.cat(hidden), samplers) if samplers else []
        stats = self.model.expert_stats()
        experts = stats.to_dict() if stats is not None else None
        by_seq = dict(zip((s.seq_id for s in samplers), tokens))
        return StepResult([by_seq.get(c.seq.seq_id) for c in plan.chunks], experts)

    def _forward(self, chunks: list, decode: bool, interrupt: Callable[[], None] | None) -> tuple[torch.Tensor, list]:
        """Hidden states of the rows to sample among ``chunks`` (all prompt or all decode) and their sequences."""
        ids: list[int] = []
        slices, sample_rows, samplers = [], [], []
        for chunk in chunks:
            seq, n = chunk.seq, chunk.num_new_tokens
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids(start, n))
            slices.append(SeqSlice(seq.block_ids, start, n))
            if start + n >= seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                samplers.append(seq)
        batch = AttentionBatch(slices, self.kv, decode)
        threads = self.decode_threads if len(ids) <= DECODE_STEP_TOKENS else self.prefill_threads
        if self.model.native is not None:
            threads = self.model.native.claim_threads(decode, threads)
        elif self._blocks:
            threads = _c_pool_carries(decode, threads)
        with _torch_threads(threads):
            hidden = self.model(torch.tensor(ids, dtype=torch.long), batch, interrupt)
        return hidden[sample_rows], samplers

    def _sample(self, hidden: torch.Tensor, samplers: list) -> list[int]:
        threads = self.prefill_threads
        if self.model.native is not None:
            threads = self.model.native.head_threads(self.prefill_threads)
        elif self._blocks:
            threads = _c_pool_carries(True, threads)
        with _torch_threads(threads):
            logits = self.model.compute_logits(hidden)
        return self.sampler.sample(
            logits, [s.params for s in samplers], [s.output_token_ids for s in samplers], [s.seq_id for s in samplers]
        )

    def release(self, seq_id: int) -> None:
        """Forget per-sequence sampler state."""
        self.sampler.forget(seq_id)


def _c_pool_carries(decode: bool, torch_threads: int) -> int:
    """Give the C pool its threads (:func:`~quanta.model.cores.default_threads`) for a forward or an
    LM head whose matmuls are all C forms but which runs on torch's path (a model built from a GGUF's
    blocks that the native decoder does not take: Gemma); returns torch's threads: 1 for a decode step or the
    head (its ops are small; idle OpenMP threads would spin on the pool's core), ``torch_threads`` for
    a prompt step (its attention). The pool starts on 1 thread, where every such model's matmuls ran:
    on the 8-layer Qwen3-30B-A3B-shaped Q4_K_M (2 AVX2 cores) a decode step took ~57 ms."""
    native.load().pool_set_threads(default_threads())
    return 1 if decode else torch_threads


@contextmanager
def _torch_threads(threads: int):
    """Run the block on ``threads`` intra-op threads; the process's setting stays as found."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
