"""Paged KV cache and the attention of one step over it.

The cache is a pool of fixed-size blocks shared by every sequence (vLLM's
PagedAttention): per layer, keys and values of ``[num_blocks, kv_heads,
block_size, head_dim]``. A sequence's positions live in the blocks its *block
table* lists, position ``p`` in block ``table[p // block_size]`` at offset
``p % block_size``; which blocks a sequence gets is the engine's business
(the model only reads and writes through the tables it is given). A step's
sequences are described by :class:`SeqSlice` (block table, cached positions,
new tokens); :class:`AttentionBatch` turns them into the index tensors every
layer shares, once per step, so the layers' signatures stay ``forward(x, batch)``.

A batch has one role. Prompt rows (prefill chunks, one token or many) are
attended row by row by the C library's attention (``attention_rows`` in
``native/decode.c``: each row over its own positions, in a fixed order, read
through its block table), so a prompt position's output is the same whichever
chunk computes it, whatever shares its step and wherever its blocks lie; where
the C library cannot run (or the head size is not a multiple of 8), one
sequence at a time by ``scaled_dot_product_attention`` over its blocks
gathered, with a causal mask offset by its cached length, which is not
chunk-invariant to the bit. Decode rows (one generated token per sequence) are
attended by the C decode glue (:mod:`quanta.model.native_decode`) where it
runs, else together in one padded call over their gathered blocks.

A layer with a sliding window (Gemma 3's local layers) attends, for the query at
position ``p``, only keys ``p - window < j <= p``: its prompt rows one sequence at a
time by ``scaled_dot_product_attention`` over the blocks the window touches (the C
rows kernel has no window), its decode rows in the padded call with the older
positions masked. Blocks wholly outside every window stay allocated and written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

#: q8_0: values a block, bytes a block (an fp16 scale and 32 int8)
Q8_GROUP, Q8_BYTES = 32, 34


@dataclass(frozen=True)
class KVFormat:
    """How the pool stores a position's keys or values of one KV head.

    Attributes:
        name: ``float32``, ``bfloat16``, ``float16`` or ``q8_0``.
        storage: the pool tensors' element dtype.
        kind: the C kernels' cache kind (``native/bf16.h``).
    """

    name: str
    storage: torch.dtype
    kind: int

    def row(self, head_dim: int) -> int:
        """Storage elements of one position's row of ``head_dim`` values: q8_0 is llama.cpp's
        ``block_q8_0``, per 32 values an fp16 scale ``d`` and 32 int8 ``q`` (value ``d * q``), 34 bytes."""
        return head_dim // Q8_GROUP * Q8_BYTES if self.name == "q8_0" else head_dim


KV_FORMATS = {f.name: f for f in (KVFormat("float32", torch.float32, 0), KVFormat("bfloat16", torch.bfloat16, 1),
                                  KVFormat("float16", torch.float16, 2), KVFormat("q8_0", torch.uint8, 3))}


def kv_format(spec: torch.dtype | str | KVFormat) -> KVFormat:
    """The format a dtype (float32, bfloat16, float16) or name stands for."""
    if isinstance(spec, KVFormat):
        return spec
    name = spec if isinstance(spec, str) else str(spec).removeprefix("torch.")
    if name not in KV_FORMATS:
        raise ValueError(f"no KV cache format {name!r}; known: {', '.join(KV_FORMATS)}")
    return KV_FORMATS[name]


class KVCache:
    """Keys and values of every layer: a pool of ``num_blocks`` blocks,
    ``[num_blocks, num_kv_heads, block_size, row]`` each (``row``: :meth:`KVFormat.row`).

    Memory is at most ``2 * layers * num_blocks * block_size * kv_heads *
    row * itemsize`` bytes (:func:`bytes_per_block`). The pool is
    allocated uninitialized (``torch.empty``): pages no sequence has written
    are never touched, so they are not resident. Nothing reads a position
    before it is written: the C kernels and the torch paths read each row's
    own positions, and the padded decode path masks the rest (scores to
    ``-inf``, gathered values to zero, since uninitialized memory may hold
    NaN and ``0 * NaN = NaN``).
    """

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype | str | KVFormat) -> None:
        if block_size <= 0 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
        self.format = kv_format(dtype)
        if self.format.name == "q8_0" and head_dim % Q8_GROUP:
            raise ValueError(f"a q8_0 KV cache needs a head size that is a multiple of {Q8_GROUP}, got {head_dim}")
        shape = (num_blocks, num_kv_heads, block_size, self.format.row(head_dim))
        self.k = [torch.empty(shape, dtype=self.format.storage) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=self.format.storage) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size


def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                    dtype: torch.dtype | str | KVFormat) -> int:
    """Bytes one block takes in a :class:`KVCache` (keys and values of every layer)."""
    fmt = kv_format(dtype)
    itemsize = torch.empty((), dtype=fmt.storage).element_size()
    return 2 * num_layers * num_kv_heads * block_size * fmt.row(head_dim) * itemsize


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., D]`` (D a multiple of 32) as q8_0 bytes ``[..., D / 32 * 34]``: per group of 32,
    ``d = fp16(amax / 127)`` and ``q = round_half_even(x / d)`` clamped to [-127, 127] (0 where d is 0);
    the bytes the C kernels' ``store_q8`` writes."""
    groups = x.float().reshape(*x.shape[:-1], -1, Q8_GROUP)
    d = (groups.abs().amax(-1, keepdim=True) / 127).half()
    q = torch.round(groups / d.float()).clamp(-127, 127).nan_to_num(0.0).to(torch.int8)
    q = torch.where(d == 0, torch.zeros_like(q), q)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], -1).reshape(*x.shape[:-1], -1)


def dequantize_q8(b: torch.Tensor) -> torch.Tensor:
    """q8_0 bytes ``[..., G * 34]`` as float32 ``[..., G * 32]`` (exact: ``d * q``)."""
    groups = b.reshape(*b.shape[:-1], -1, Q8_BYTES)
    d = groups[..., :2].contiguous().view(torch.float16).float()
    q = groups[..., 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(*b.shape[:-1], -1)


def _stored(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``x`` ``[..., D]`` in the cache's format: q8_0 by the C library's ``kv_store_rows`` (the
    decode step's own quantization) where it loads, else :func:`quantize_q8` (the same bytes)."""
    if fmt.name != "q8_0":
        return x.to(fmt.storage)
    from quanta.model import native

    try:
        lib = native.load()
    except native.NativeUnavailable:
        return quantize_q8(x)
    src = x.float().contiguous()
    out = torch.empty(*x.shape[:-1], fmt.row(x.shape[-1]), dtype=torch.uint8)
    lib.kv_store_rows(src.numel() // x.shape[-1], x.shape[-1], src.data_ptr(), fmt.kind, out.data_ptr())
    return out


def _read(cache: torch.Tensor, tables: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """:func:`gather` as ``dtype`` values."""
    rows = gather(cache, tables)
    return dequantize_q8(rows).to(dtype) if fmt.name == "q8_0" else rows.to(dtype)


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold ``positions`` positions."""
    return -(-positions // block_size)


@dataclass(slots=True)
class SeqSlice:
    """One sequence's part of a step.

    Attributes:
        blocks: the sequence's block table (block ids, in position order),
            covering at least ``start + num_new`` positions.
        start: positions already in the cache (tokens), i.e. the position of the
            first new token.
        num_new: new tokens this step (1 for a decode step).
    """

    blocks: Sequence[int]
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
        tables: ``[len(seqs), width]`` int32 block tables, each cut to the
            blocks of its positions and padded with block 0.
        row_table: ``[T]`` int64 index of each token's sequence (its row of ``tables``).
        rope_tables: cos/sin for ``positions``, filled in by the model.
        local_rope_tables: the same for the sliding layers where they rotate
            with another base (Gemma 3), else None.
    """

    seqs: list[SeqSlice]
    kv: KVCache
    decode: bool = False
    positions: torch.Tensor = field(init=False)
    max_position: int = field(init=False)
    tables: torch.Tensor = field(init=False)
    row_table: torch.Tensor = field(init=False)
    rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    local_rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    write_blocks: torch.Tensor = field(init=False)
    write_offsets: torch.Tensor = field(init=False)
    _rows_scratch: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        bs = self.kv.block_size
        positions, row_table = [], []
        for i, s in enumerate(self.seqs):
            if self.decode and s.num_new != 1:
                raise ValueError(f"a decode batch takes one token a sequence, sequence {i} has {s.num_new}")
            if s.start + s.num_new > len(s.blocks) * bs:
                held = len(s.blocks) * bs
                raise ValueError(f"sequence {i} needs {s.start + s.num_new} positions, its {len(s.blocks)} blocks hold {held}")
            positions.extend(range(s.start, s.start + s.num_new))
            row_table.extend([i] * s.num_new)
        self.positions = torch.tensor(positions, dtype=torch.long)
        self.max_position = max(positions)
        self.row_table = torch.tensor(row_table, dtype=torch.long)
        self.tables = torch.zeros(len(self.seqs), blocks_for(self.max_position + 1, bs), dtype=torch.int32)
        for i, s in enumerate(self.seqs):
            n = blocks_for(s.start + s.num_new, bs)
            self.tables[i, :n] = torch.as_tensor(s.blocks[:n], dtype=torch.int32)
        self.write_blocks = self.tables[self.row_table, self.positions // bs].long()
        self.write_offsets = self.positions % bs

    @property
    def max_len(self) -> int:
        """Positions the longest sequence of the step attends to."""
        return self.max_position + 1


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: AttentionBatch,
           window: int = 0) -> torch.Tensor:
    """Write ``k``/``v`` into the cache and attend.

    Args:
        q: ``[T, H, D]`` rotated queries.
        k, v: ``[T, KVH, D]`` rotated keys and values of the new tokens.
        layer: layer index into the cache.
        batch: the step's context.
        window: the query at position ``p`` sees keys ``p - window < j <= p``; 0: all up to ``p``.

    Returns:
        ``[T, H, D]`` attention output, in ``q``'s dtype.
    """
    kc, vc, fmt = batch.kv.k[layer], batch.kv.v[layer], batch.kv.format
    kc[batch.write_blocks, :, batch.write_offsets] = _stored(k, fmt)
    vc[batch.write_blocks, :, batch.write_offsets] = _stored(v, fmt)
    if not window and (lib := _rows_kernel(q)) is not None:  # prompt and decode rows alike
        return _attend_rows(lib, q, kc, vc, batch)
    if batch.decode:
        return _attend_decode(q, kc, vc, batch, window)
    out = torch.empty_like(q)
    offset = 0
    for i, s in enumerate(batch.seqs):
        out[offset:offset + s.num_new] = _attend_chunk(q[offset:offset + s.num_new], kc, vc, fmt, batch.tables[i], s,
                                                       window)
        offset += s.num_new
    return out


def _rows_kernel(q: torch.Tensor):
    """The C library when it can attend these prompt rows, else None."""
    if q.shape[-1] % 8 or q.dtype not in (torch.float32, torch.bfloat16):
        return None
    from quanta.model import native

    try:
        return native.load()
    except native.NativeUnavailable:
        return None


def _attend_rows(lib, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """Prompt rows through ``attention_rows`` (C), on the C pool's threads for the call."""
    from quanta.model.cores import default_threads

    rows, heads, dim = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    need = lib.attention_scratch(rows, heads, kc.shape[1], dim, batch.max_len)
    if batch._rows_scratch is None or batch._rows_scratch.numel() < need:
        batch._rows_scratch = torch.empty(need, dtype=torch.float32)
    before = lib.pool_threads()
    lib.pool_set_threads(default_threads())
    try:
        lib.attention_rows(rows, q.data_ptr(), int(q.dtype == torch.bfloat16), heads, kc.shape[1], dim,
                           batch.row_table.data_ptr(), batch.positions.data_ptr(), batch.tables.data_ptr(),
                           batch.tables.shape[1], batch.kv.block_size, kc.data_ptr(), vc.data_ptr(),
                           batch.kv.format.kind, batch.max_len, out.data_ptr(), batch._rows_scratch.data_ptr())
    finally:
        lib.pool_set_threads(before)
    return out


def gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The positions of block tables ``[R, n]`` from one layer's cache, contiguous:
    ``[R, kv_heads, n * block_size, head_dim]`` (a copy)."""
    rows, n = tables.shape
    _, kv_heads, bs, dim = cache.shape
    return cache[tables.long()].transpose(1, 2).reshape(rows, kv_heads, n * bs, dim)


def _attend_chunk(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, fmt: KVFormat, table: torch.Tensor,
                  s: SeqSlice, window: int = 0) -> torch.Tensor:
    """One sequence's new rows over its blocks; with a ``window``, over the blocks from the one
    holding the first row's oldest visible position on, ``window`` rows at a time (so a long
    chunk costs its rows times about twice the window, not its rows squared)."""
    if window and s.num_new > window:
        pieces = [SeqSlice(s.blocks, s.start + i, min(window, s.num_new - i)) for i in range(0, s.num_new, window)]
        return torch.cat([_attend_chunk(q[p.start - s.start:p.start - s.start + p.num_new], kc, vc, fmt, table, p, window)
                          for p in pieces])
    end, bs = s.start + s.num_new, kc.shape[2]
    first = max(0, s.start - window + 1) // bs if window else 0  # first block any row sees
    table = table[first:blocks_for(end, bs)][None]
    lo = first * bs
    keys, values = _read(kc, table, fmt, q.dtype)[:, :, :end - lo], _read(vc, table, fmt, q.dtype)[:, :, :end - lo]
    query = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if s.start == 0 and not window:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
    else:
        rows, cols = torch.arange(s.start, end)[:, None], torch.arange(lo, end)[None, :]
        mask = cols <= rows
        if window:
            mask &= cols > rows - window
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def _attend_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: AttentionBatch,
                   window: int = 0) -> torch.Tensor:
    """One query per row, padded: the rows' blocks gathered, batched matmuls with query
    heads grouped per KV head. With a ``window``, only the blocks each row's window touches are
    gathered (:func:`_window_tables`) and the positions at or before ``p - window`` are masked too.

    For a single query row this is ~3x faster on CPU than
    ``scaled_dot_product_attention`` (whose flash kernel is tuned for long
    query blocks). Positions past a row's own are masked: scores to ``-inf``
    and gathered values to zero (an unwritten position may hold NaN). Scores
    come out of ``bmm`` in the model dtype; softmax accumulates in float32.

    Returns:
        ``[rows, H, D]`` in row order.
    """
    rows, heads, dim = q.shape
    kv_heads = kc.shape[1]
    fmt = batch.kv.format
    tables, first = _window_tables(batch, window) if window else (batch.tables, torch.zeros(1, dtype=torch.long))
    keys, values = _read(kc, tables, fmt, q.dtype), _read(vc, tables, fmt, q.dtype)  # [R, KVH, L, D]
    length = keys.shape[2]
    key_positions = first[:, None] + torch.arange(length)[None, :]  # [R or 1, L]
    masked_out = key_positions > batch.positions[:, None]  # [R, L]
    if window:
        masked_out |= key_positions <= batch.positions[:, None] - window
    values.masked_fill_(masked_out[:, None, :, None], 0)
    query = (q * dim ** -0.5).reshape(rows * kv_heads, heads // kv_heads, dim)  # [R*KVH, G, D]
    scores = torch.bmm(query, keys.flatten(0, 1).transpose(1, 2))  # [R*KVH, G, L]
    scores.view(rows, kv_heads, -1, length).masked_fill_(masked_out[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, values.flatten(0, 1)).view(rows, heads, dim)


def _window_tables(batch: AttentionBatch, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tables, first)``: per decode row ``width`` consecutive columns of its block table (as many
    blocks as a window can touch) starting at the block of its oldest visible position ``p - window + 1``,
    or at the batch table's last ``width`` columns where that runs past them (the older positions then
    masked by the window, the padding's by ``p``), and ``[R]`` the position each row's first column starts at."""
    bs = batch.kv.block_size
    width = min(blocks_for(window + bs - 1, bs), batch.tables.shape[1])
    start = (batch.positions - window + 1).clamp(min=0) // bs
    start = start.clamp(max=batch.tables.shape[1] - width)
    columns = start[:, None] + torch.arange(width)[None, :]
    return batch.tables.gather(1, columns), start * bs
