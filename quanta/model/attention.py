"""Slot KV cache and the attention of one step over it.

Each resident sequence owns one *slot*: a row of the cache with room for
``max_model_len`` positions. A step's sequences are described by
:class:`SeqSlice` (slot, cached positions, new tokens); :class:`AttentionBatch`
turns them into the index tensors every layer shares, once per step, so the
layers' signatures stay ``forward(x, batch)``.

A batch has one role. Decode rows (one generated token per sequence) are
attended together in one padded call over a contiguous range of slots (read
in place, or through a reused scratch copy where that is faster for the
dtype); the C decode glue (:mod:`quanta.model.native_decode`) replaces this
where it runs. Prompt rows (prefill chunks, one token or many) are attended
row by row by the C decode glue's attention (``attention_rows`` in
``native/decode.c``: each row over its own positions, in a fixed order), so a
prompt position's output is the same whichever chunk computes it and
whatever shares its step; where the C library cannot run (or the head size is
not a multiple of 8), one sequence at a time by ``scaled_dot_product_attention``
with a causal mask offset by its cached length, which is not chunk-invariant
to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of every layer: ``[num_slots, num_kv_heads, max_len, head_dim]`` each.

    Memory is ``2 * (layers + 1) * slots * max_len * kv_heads * head_dim *
    itemsize`` bytes: the extra layer's worth is ``scratch``, two flat buffers
    decode attention copies cache slices into where it reads them contiguous
    (a fresh tensor per layer instead costs a page fault per 4 KiB each time:
    glibc hands allocations this large back to the kernel when freed). The
    cache starts zeroed: padded attention multiplies masked positions by a
    zero weight, and uninitialized memory may hold NaN (0 * NaN = NaN).
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.scratch = (torch.empty(shape, dtype=dtype).view(-1), torch.empty(shape, dtype=dtype).view(-1))
        self.max_len = max_len


@dataclass(slots=True)
class SeqSlice:
    """One sequence's part of a step.

    Attributes:
        slot: KV cache row of the sequence.
        start: positions already in the cache (tokens), i.e. the position of the
            first new token.
        num_new: new tokens this step (1 for a decode step).
    """

    slot: int
    start: int
    num_new: int


@dataclass
class AttentionBatch:
    """Per-step attention context shared by all layers.

    Attributes:
        seqs: sequences in token order of the flattened ``[T]`` input.
        kv: the cache new keys/values are written into.
        decode: the rows are generated tokens (one per sequence), else prompt tokens.
        positions: ``[T]`` int64 absolute positions.
        max_position: largest entry of ``positions``.
        rope_tables: cos/sin for ``positions``, filled in by the model.
    """

    seqs: list[SeqSlice]
    kv: KVCache
    decode: bool = False
    positions: torch.Tensor = field(init=False)
    max_position: int = field(init=False)
    rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    _write_slots: torch.Tensor = field(init=False)
    _prefills: list[tuple[int, SeqSlice]] = field(init=False)
    _decode: _DecodeGroup | None = field(init=False)
    _rows_scratch: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        positions, slots, self._prefills = [], [], []
        decode_rows: list[tuple[int, SeqSlice]] = []
        offset = 0
        for s in self.seqs:
            if s.start + s.num_new > self.kv.max_len:
                raise ValueError(f"sequence in slot {s.slot} needs {s.start + s.num_new} positions, cache holds {self.kv.max_len}")
            positions.extend(range(s.start, s.start + s.num_new))
            slots.extend([s.slot] * s.num_new)
            if self.decode and s.num_new != 1:
                raise ValueError(f"a decode batch takes one token a sequence, slot {s.slot} has {s.num_new}")
            (decode_rows if self.decode else self._prefills).append((offset, s))
            offset += s.num_new
        self.positions = torch.tensor(positions, dtype=torch.long)
        self.max_position = max(positions)
        self._write_slots = torch.tensor(slots, dtype=torch.long)
        self._decode = _DecodeGroup(decode_rows) if decode_rows else None

    @property
    def write_slots(self) -> torch.Tensor:
        """``[T]`` int64 cache slot of each token."""
        return self._write_slots


class _DecodeGroup:
    """Decode rows padded to a contiguous slot range ``[lo, hi)`` of the cache."""

    def __init__(self, rows: list[tuple[int, SeqSlice]]) -> None:
        slots = [s.slot for _, s in rows]
        self.lo, hi = min(slots), max(slots) + 1
        self.kv_len = max(s.start + 1 for _, s in rows)
        lengths = torch.ones(hi - self.lo, dtype=torch.long)  # idle rows attend to one dummy position
        for _, s in rows:
            lengths[s.slot - self.lo] = s.start + 1
        self.hi = hi
        self.masked_out = (torch.arange(self.kv_len)[None, :] >= lengths[:, None])[:, None, None, :]
        self.needs_mask = bool(self.masked_out.any())  # False when every row has the same length
        offsets = [off for off, _ in rows]
        row_of = [s.slot - self.lo for _, s in rows]
        self.token_index = torch.tensor(offsets, dtype=torch.long)
        self.row_index = torch.tensor(row_of, dtype=torch.long)
        #: rows are the tokens ``[first, first + rows)`` in slot order: no scatter/gather needed
        self.first = offsets[0]
        self.dense = row_of == list(range(hi - self.lo)) and offsets == list(range(self.first, self.first + len(rows)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: AttentionBatch) -> torch.Tensor:
    """Write ``k``/``v`` into the cache and attend.

    Args:
        q: ``[T, H, D]`` rotated queries.
        k, v: ``[T, KVH, D]`` rotated keys and values of the new tokens.
        layer: layer index into the cache.
        batch: the step's context.

    Returns:
        ``[T, H, D]`` attention output, in ``q``'s dtype.
    """
    kc, vc = batch.kv.k[layer], batch.kv.v[layer]
    kc[batch._write_slots, :, batch.positions] = k
    vc[batch._write_slots, :, batch.positions] = v
    if batch._decode is None and (lib := _rows_kernel(q, kc)) is not None:
        return _attend_rows(lib, q, kc, vc, batch)
    if batch._decode is None and len(batch._prefills) == 1:
        return _attend_chunk(q, kc, vc, batch._prefills[0][1])
    if not batch._prefills and batch._decode.dense:
        return _attend_decode(q, kc, vc, batch._decode, batch.kv.scratch)
    out = torch.empty_like(q)
    for offset, s in batch._prefills:
        out[offset:offset + s.num_new] = _attend_chunk(q[offset:offset + s.num_new], kc, vc, s)
    if batch._decode is not None:
        g = batch._decode
        out[g.token_index] = _attend_decode(q, kc, vc, g, batch.kv.scratch)
    return out


def _rows_kernel(q: torch.Tensor, kc: torch.Tensor):
    """The C library when it can attend these prompt rows, else None."""
    if q.shape[-1] % 8 or q.dtype not in (torch.float32, torch.bfloat16) or kc.dtype != q.dtype:
        return None
    from quanta.model import native

    try:
        return native.load()
    except native.NativeUnavailable:
        return None


def _attend_rows(lib, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """Prompt rows through ``attention_rows`` (C), on the C pool's threads for the call.

    A bf16 cache is first widened to float32, each sequence's positions once
    (exact), so the rows of a chunk share one conversion instead of each row
    converting every position it reads; the kernel computes the same bits from either."""
    from quanta.model.native_decode import default_threads

    rows, heads, dim = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    slots, kc, vc, max_len = _widened(kc, vc, batch)
    need = lib.attention_scratch(rows, heads, kc.shape[1], dim, max_len)
    if batch._rows_scratch is None or batch._rows_scratch.numel() < need:
        batch._rows_scratch = torch.empty(need, dtype=torch.float32)
    before = lib.pool_threads()
    lib.pool_set_threads(default_threads())
    try:
        lib.attention_rows(rows, q.data_ptr(), int(q.dtype == torch.bfloat16), heads, kc.shape[1], dim,
                           slots.data_ptr(), batch.positions.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                           int(kc.dtype == torch.bfloat16), kc.stride(0), kc.stride(1), max_len,
                           out.data_ptr(), batch._rows_scratch.data_ptr())
    finally:
        lib.pool_set_threads(before)
    return out


def _widened(kc: torch.Tensor, vc: torch.Tensor, batch: AttentionBatch):
    """``(slots, keys, values, max_len)`` for :func:`_attend_rows`: the cache itself when it is
    float32; for bf16, float32 copies ``[sequences, KVH, L, D]`` of each prompt sequence's
    positions (``L`` the longest), with each row's slot renumbered to its copy."""
    if kc.dtype == torch.float32:
        return batch._write_slots, kc, vc, batch.kv.max_len
    ends = [s.start + s.num_new for _, s in batch._prefills]
    length = max(ends)
    keys = kc.new_empty((len(ends), kc.shape[1], length, kc.shape[3]), dtype=torch.float32)
    values = torch.empty_like(keys)
    slots = []
    for i, (_, s) in enumerate(batch._prefills):
        end = s.start + s.num_new
        keys[i, :, :end] = kc[s.slot, :, :end]
        values[i, :, :end] = vc[s.slot, :, :end]
        slots += [i] * s.num_new
    return torch.tensor(slots, dtype=torch.long), keys, values, length


def _attend_chunk(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, s: SeqSlice) -> torch.Tensor:
    end = s.start + s.num_new
    keys = kc[s.slot, :, :end].unsqueeze(0)
    values = vc[s.slot, :, :end].unsqueeze(0)
    query = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if s.start == 0:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
    else:
        rows = torch.arange(s.start, end)[:, None]
        mask = torch.arange(end)[None, :] <= rows
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


#: cache dtypes whose decode ``bmm`` reads the cache slice in place (a batch
#: stride of ``max_len * D``) rather than from a contiguous copy in
#: :attr:`KVCache.scratch`. ``benchmarks/decode_attention.py`` (results in
#: ``benchmarks/results/decode_attention_*.md``; 2-core AMD EPYC with
#: avx512_bf16, one thread, whole decode steps, copy / in place, median of 10
#: paired steps): float32 (MKL's batched GEMM takes the stride) 1.39x at 8
#: rows x 1,024 positions, 1.32x at 32 x 1,024, 1.11x at 32 x 256, ~1.0 at
#: 1 row, and the same with AVX2 kernels forced; bfloat16 (oneDNN) is slower
#: in place at every shape (0.66x at 32 x 1,024, 0.90x at 8 x 256) and copies.
#: Before the scratch buffers the copy was a fresh tensor per layer: 32 x
#: 1,024 took 609-690 ms a step in bf16 and 1,237-1,290 ms in fp32 (separate
#: runs of the same benchmark), against ~284 (bf16, scratch) and ~302 (fp32, in place) now.
IN_PLACE_DECODE_BMM = {torch.float32: True, torch.bfloat16: False}


def _attend_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, g: _DecodeGroup,
                   scratch: tuple[torch.Tensor, torch.Tensor], in_place: bool | None = None) -> torch.Tensor:
    """One query per row: batched matmuls with query heads grouped per KV head.

    For a single query row this is ~3x faster on CPU than
    ``scaled_dot_product_attention`` (whose flash kernel is tuned for long
    query blocks). The cache slice ``[rows, KVH, L, D]`` is read as a batch of
    ``rows * KVH`` matrices, in place or first copied contiguous into
    ``scratch`` (:attr:`KVCache.scratch`) as :data:`IN_PLACE_DECODE_BMM` says
    for the cache dtype (``in_place`` overrides, for tests). Scores come out
    of ``bmm`` in the model dtype; softmax accumulates in float32.

    Returns:
        ``[decode rows, H, D]`` in ``g.token_index`` order.
    """
    rows, heads, dim = g.hi - g.lo, q.shape[1], q.shape[2]
    kv_heads = kc.shape[1]
    batch = rows * kv_heads
    if g.dense:
        query = q[g.first:g.first + rows] * dim ** -0.5
    else:
        query = q.new_zeros(rows, heads, dim)
        query[g.row_index] = q[g.token_index] * dim ** -0.5
    query = query.view(batch, heads // kv_heads, dim)  # [R*KVH, G, D]
    if in_place is None:
        in_place = IN_PLACE_DECODE_BMM.get(kc.dtype, False)
    keys, values = kc[g.lo:g.hi, :, :g.kv_len], vc[g.lo:g.hi, :, :g.kv_len]  # [R, KVH, L, D] views
    if not in_place:
        n, shape = keys.numel(), keys.shape
        keys, values = scratch[0][:n].view(shape).copy_(keys), scratch[1][:n].view(shape).copy_(values)
    keys, values = keys.flatten(0, 1), values.flatten(0, 1)  # [R*KVH, L, D]: a view either way
    scores = torch.bmm(query, keys.transpose(1, 2))  # [R*KVH, G, L]
    if g.needs_mask:
        scores.view(rows, kv_heads, -1, g.kv_len).masked_fill_(g.masked_out, float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), values).view(rows, heads, dim)
    return out if g.dense else out[g.row_index]
