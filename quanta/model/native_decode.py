"""Decode steps of a Llama-family model with the glue between matmuls in C.

A decode batch (one generated token per sequence) runs, per layer, four
matmuls through the model's own linears (their decode form, a q4_1 / q8_0
one called straight into ``block_matmul`` or an fp16 one into ``f16_matmul``,
else the linear itself) and three C
calls from :mod:`quanta.model.native`: residual add + RMSNorm, (q/k head norms +)
RoPE + KV cache write + attention, SwiGLU. An MoE layer's MLP is its
:class:`~quanta.model.moe.MoEBlock` (router, then every active expert in one C
call per projection where the experts are C forms). The residual stream stays float32 between
layers; matmul inputs and outputs are in the model dtype. The KV cache is
the same paged :class:`~quanta.model.attention.KVCache` the PyTorch path
reads, through the same block tables, so steps of either path may follow
each other.

Numerics differ from the PyTorch path (which rounds to bf16 between ops) by
about a bf16 ulp per op; ``tests/test_native_decode.py`` bounds the logit
difference and checks greedy agreement.
"""

from __future__ import annotations

import ctypes
import time

import torch

from quanta.model import native
from quanta.model.attention import AttentionBatch
from quanta.model.config import ModelConfig
from quanta.model.cores import default_threads, threads_set_by_hand
from quanta.model.moe import MoEBlock
from quanta.model.native import forms
from quanta.model.quant import QuantizedWeight
from quanta.model.thread_tuner import ThreadTuner


def unsupported_reason(cfg: ModelConfig, dtype: torch.dtype) -> str | None:
    """Why the C decode path cannot run this model (None: it can)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    if cfg.qk_norm_full or cfg.clip_qkv is not None:
        return "q/k norms over the whole projection"
    if cfg.head_dim % 8 or cfg.num_attention_heads % cfg.num_key_value_heads:  # attention's 8-float vectors (decode.c)
        return "head layout"
    return None


class NativeDecoder:
    """Runs all-decode steps of ``model`` (a :class:`~quanta.model.llama.LlamaModel`).

    Raises:
        ValueError: the model is not supported (see :func:`unsupported_reason`).
        native.NativeUnavailable: the C library cannot be built here.
    """

    def __init__(self, model) -> None:
        cfg = model.config
        dtype = model.dtype
        reason = unsupported_reason(cfg, dtype)
        if reason:
            raise ValueError(f"native decode does not support {reason}")
        self.lib = native.load()
        self.model, self.cfg, self.dtype = model, cfg, dtype
        self.io_bf16 = int(dtype == torch.bfloat16)
        self.eps = ctypes.c_float(cfg.rms_norm_eps)
        f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
        self.norms = [(f32(layer.input_layernorm.weight), f32(layer.post_attention_layernorm.weight)) for layer in model.layers]
        #: per layer, the q and k head norms' float32 weights (Qwen3), or None
        self.qk_norms = [(f32(a.q_norm.weight), f32(a.k_norm.weight)) if a.q_norm is not None else None
                         for a in (layer.self_attn for layer in model.layers)]
        self.final_norm = f32(model.norm.weight)
        self._scratch: torch.Tensor | None = None
        self._plan: list[list[_Direct | None]] | None = None
        self._prompts_covered: bool | None = None
        #: threads of the C kernels in a step (pool.c: 1 or 2)
        self.threads = default_threads()
        #: the threads each decode step gets, found by trying (1 or 2)
        self.tuner = ThreadTuner(self.threads, fixed=threads_set_by_hand())

    def scratch(self, rows: int, max_len: int) -> torch.Tensor:
        """float32 work space big enough for every C call of ``rows`` rows at ``max_len`` cache positions."""
        c = self.cfg
        attention = self.lib.attention_scratch(rows, c.num_attention_heads, c.num_key_value_heads, c.head_dim, max_len)
        need = max(attention, 2 * c.intermediate_size, c.hidden_size)
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        return self._scratch

    def forget_plans(self) -> None:
        """Drop the prepared calls (the model's weight forms changed)."""
        self._plan = self._prompts_covered = None

    def plan(self) -> list[list[_Direct | None]]:
        """Per layer, its projections (qkv, o, then gate_up, down of a dense MLP): the C decode form
        (:func:`native_form`), called straight, or None (the linear itself). The same at every row count."""
        if self._plan is None:
            self._plan = [[_Direct.pick(lin) for lin in _projections(layer)] for layer in self.model.layers]
        return self._plan

    def covers(self) -> bool:
        """Whether every projection of a decode step is a direct C call (:meth:`plan`) and every MoE
        layer's experts are C forms (:meth:`_experts_in_c`)."""
        return all(d is not None for layer in self.plan() for d in layer) and self._experts_in_c()

    def _experts_in_c(self) -> bool:
        """Whether every MoE block's matmuls are C kernels alone: routed experts held as C forms
        (:meth:`~quanta.model.moe.RoutedExperts.use_forms`, a GGUF's blocks: q4_1 / q8_0 / q6_k in one
        call per projection, fp16 one expert at a time) and no shared expert. True for a dense model."""
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]
        return all(b.experts.forms and all(f.c_kernel for f in b.experts.forms) and b.shared_expert is None
                   for b in blocks)

    def claim_threads(self, decode: bool, torch_threads: int) -> int:
        """Split the cores between the C kernels' pool and torch's for one forward.

        A decode forward the C kernels carry (:meth:`covers`) runs them on the threads
        :attr:`tuner` picks and torch (the embedding lookup) on 1; a prompt forward whose
        projections are C forms (:meth:`prompts_covered`) runs them on all of :attr:`threads`, and
        torch on ``torch_threads``; any other step runs the C kernels on 1 and torch on ``torch_threads``: each pool's
        idle threads spin between calls and take the core the other pool needs. Measured in-process on the 2-core dev VM
        (AVX-512 + bf16, embedded model, ``benchmarks/engine_throughput.py``'s decode,
        medians of 3): 1 row 118 tok/s with both pools at 2 threads, 180 with C 1 /
        torch 2, 274 with C 2 / torch 1; 8 rows 458 / 539 / 649; 32 rows (torch's
        bf16 matmuls) 732 / 850 / 578. Returns torch's thread count for the step.
        """
        carried = decode and self.covers()
        if not decode and self.prompts_covered():
            self.lib.pool_set_threads(self.threads)
            return torch_threads
        self.lib.pool_set_threads(self.tuner.pick() if carried else 1)
        return 1 if carried else torch_threads

    def prompts_covered(self) -> bool:
        """Whether prompt rows' projections are C forms too (a model built from a GGUF's blocks,
        :attr:`~quanta.model.linear.PackedLinear.form_for_prompts`): such a step's matmuls run on
        the pool, which then gets all of :attr:`threads` (on 1 thread a 1,000-token prompt of a
        1B Q4_K_M took 2x as long)."""
        if self._prompts_covered is None:
            self._prompts_covered = all(getattr(lin, "form_for_prompts", False)
                                        for layer in self.model.layers for lin in _projections(layer)) and self._experts_in_c()
        return self._prompts_covered

    def head_threads(self, torch_threads: int) -> int:
        """Split the cores for the LM head, as :meth:`claim_threads` does for the
        forward: a C form (:func:`native_form`: the q8_0 or fp16 head) gets the :attr:`tuner`'s current count of C
        threads and torch 1; any other form gets torch's ``torch_threads`` (one large
        GEMM, which a preempted thread delays little) and the pool 1. Measured through HTTP on
        the 2-core dev VM (``benchmarks/peer_llama_cpp.py --servers quanta --workloads 3,4
        --rounds 1``, two runs each, alternating), torch on 2 threads instead of 1 for a head
        above 2 rows: bf16, 8 streams 234-254 -> 281-298 tok/s, 32 on 8 slots 394-439 -> 456-462;
        AVX2 kernels forced (fp32, fp16 head), 205-221 -> 208-211 and 290-299 -> 316-318.
        Returns torch's thread count for the head.
        """
        carried = native_form(self.model.lm_head_form) is not None
        self.lib.pool_set_threads(self.tuner.current if carried else 1)
        return 1 if carried else torch_threads

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """``[T]`` token ids, one per decoding sequence -> ``[T, hidden]`` final-normed hidden states (model dtype).

        Runs the C kernels on the pool's current thread count, which the executor sets per step
        (:meth:`claim_threads`), and tells the :attr:`tuner` how long the step took."""
        start = time.perf_counter()
        c, lib, io = self.cfg, self.lib, self.io_bf16
        rows, heads, kv_heads, dim = input_ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        kv = batch.kv
        scratch = self.scratch(rows, batch.max_len).data_ptr()
        plan = self.plan()
        x = self.model.embed_tokens(input_ids).float().contiguous()
        width = (heads + 2 * kv_heads) * dim
        h = torch.empty(rows, c.hidden_size, dtype=self.dtype)
        attn = torch.empty(rows, heads * dim, dtype=self.dtype)
        mid = torch.empty(rows, c.intermediate_size, dtype=self.dtype)  # a dense MLP's (the config's size)
        outs = [torch.empty(rows, n, dtype=self.dtype) for n in (width, c.hidden_size, 2 * c.intermediate_size, c.hidden_size)]
        work = _MatmulScratch(lib, rows, max(c.hidden_size, c.intermediate_size), max(width, 2 * c.intermediate_size), io)
        xp, hp, ap, mp = x.data_ptr(), h.data_ptr(), attn.data_ptr(), mid.data_ptr()
        row_table, positions, tables = batch.row_table.data_ptr(), batch.positions.data_ptr(), batch.tables.data_ptr()
        table_width, block_size, max_len = batch.tables.shape[1], kv.block_size, batch.max_len
        cache_kind = kv.format.kind
        # the rows of the model's own RoPE tables (the PyTorch path's float32 values), grown to this step's positions
        cos_table, sin_table = self.model.rope.float32_tables(batch.max_position)
        rope_tables = cos_table.data_ptr(), sin_table.data_ptr()

        def project(layer, which: int, src: torch.Tensor) -> torch.Tensor:
            direct = plan[i][which]
            if direct is None:
                return _checked(_projections(layer)[which](src, True), self.dtype)
            direct(lib, rows, src.data_ptr(), io, outs[which].data_ptr(), work)
            return outs[which]

        down = None
        for i, layer in enumerate(self.model.layers):
            norm_in, norm_post = self.norms[i]
            lib.residual_rms_norm(rows, c.hidden_size, xp, _ptr(down), norm_in.data_ptr(), self.eps, hp, io, scratch)
            qkv = project(layer, 0, h)
            qk_norm = self.qk_norms[i] or (None, None)
            lib.attention_decode(rows, qkv.data_ptr(), io, heads, kv_heads, dim, *map(_ptr, qk_norm), self.eps,
                                 *rope_tables, row_table,
                                 positions, tables, table_width, block_size, kv.k[i].data_ptr(), kv.v[i].data_ptr(), cache_kind,
                                 max_len, ap, scratch)
            o = project(layer, 1, attn)
            lib.residual_rms_norm(rows, c.hidden_size, xp, o.data_ptr(), norm_post.data_ptr(), self.eps, hp, io, scratch)
            if isinstance(layer.mlp, MoEBlock):
                down = _checked(layer.mlp(h), self.dtype)
                continue
            gate_up = project(layer, 2, h)
            lib.silu_mul(rows, c.intermediate_size, gate_up.data_ptr(), io, mp, scratch)
            down = project(layer, 3, mid)
        out = torch.empty(rows, c.hidden_size, dtype=self.dtype)
        lib.residual_rms_norm(rows, c.hidden_size, xp, _ptr(down), self.final_norm.data_ptr(), self.eps,
                              out.data_ptr(), io, scratch)
        self.tuner.record(lib.pool_threads(), rows, time.perf_counter() - start)
        return out


def native_form(form: QuantizedWeight | None) -> QuantizedWeight | None:
    """``form`` if quanta's C kernels multiply it (q4_1 / q8_0 / q6_k, or fp16 held as its fp16
    weight: :attr:`~quanta.model.quant.QuantizedWeight.c_kernel`), else None."""
    return form if form is not None and form.c_kernel else None


def _projections(layer) -> tuple:
    attention = layer.self_attn.qkv_proj, layer.self_attn.o_proj
    return attention if isinstance(layer.mlp, MoEBlock) else (*attention, layer.mlp.gate_up_proj, layer.mlp.down_proj)



class _MatmulScratch:
    """``block_matmul``'s scratch for ``rows`` rows of up to ``k`` inputs and ``n`` outputs (the
    float sums only for bf16 output: float32 output takes them itself, as in
    :func:`quanta.model.native.forms.matmul`); its floats (``xs`` on) also hold ``f16_matmul``'s
    widened bf16 rows."""

    def __init__(self, lib, rows: int, k: int, n: int, io_bf16: int) -> None:
        self.quantized = torch.empty(rows * 2 * k, dtype=torch.int8)
        sums = lib.block_sums_scratch(rows, n) if io_bf16 else 0
        self.floats = torch.empty(max(rows * (k // forms.BLOCK) * 2 + sums, rows * k), dtype=torch.float32)
        self.q, self.xs = self.quantized.data_ptr(), self.floats.data_ptr()
        self.acc = self.xs + rows * (k // forms.BLOCK) * 2 * 4


class _Direct:
    """A projection's q4_1 / q8_0 / q6_k form called straight into ``block_matmul``, or its fp16 form
    into ``f16_matmul``: the same kernel as :meth:`QuantizedWeight.__call__`, without its
    per-call tensors and checks (~30 us of Python a call, against ~25-75 us of kernel at one row)."""

    def __init__(self, form: QuantizedWeight) -> None:
        self.form = form  # keeps data and scales alive
        self.kind = native.KINDS.get(form.kind, 16)  # block_matmul's kinds; 16: fp16
        self.fine = int(form.fine)
        self.n, self.k = form.shape
        self.data, self.scales = form.data.data_ptr(), form.scales.data_ptr()

    @classmethod
    def pick(cls, linear) -> _Direct | None:
        """``linear``'s decode form if it is a bias-free C one (:func:`native_form`), else None."""
        if getattr(linear, "bias", None) is not None:
            return None
        form = native_form(getattr(linear, "form", None))
        return cls(form) if form is not None else None

    def __call__(self, lib, rows: int, x: int, io_bf16: int, out: int, work: _MatmulScratch) -> None:
        if self.kind == 16:
            lib.f16_matmul(rows, self.n, self.k, x, io_bf16, self.data, out, work.xs)
            return
        if lib.block_matmul(self.kind, self.fine, rows, self.n, self.k, x, io_bf16, self.data, self.scales, out,
                            work.q, work.xs, work.acc):
            raise MemoryError("qmatmul.c could not allocate its scratch")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _checked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A matmul output as the C code reads it: contiguous, in the model dtype."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()
