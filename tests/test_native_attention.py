"""The C library's attention (``native/decode.c``) against a float64 reference, and its bits.

``attention_rows`` attends prompt rows over a paged pool: each row's positions split in two
parts, scores in groups of 8 from each part's start, tiles of 32 positions between multiples of
32 with the KV heads taking turns, a group that crosses into a tile reading the 8 positions
before it. The contexts below put the second part's start at every offset within a group and
the tiles across block edges (block sizes 8, 24, 32), for every cache kind: the output must be
the reference's, and each row's bits the same whether it is attended alone, beside 18 others of
its sequence, or on one thread.
"""

from __future__ import annotations

import pytest
import torch

from quanta.model import native
from quanta.model.attention import KV_FORMATS, _stored, dequantize_q8
from quanta.model.native.forms import available as native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the C library does not build here")

HEADS, KV_HEADS, DIM = 9, 3, 64


def _pool(rows: torch.Tensor, fmt, table: torch.Tensor, block_size: int):
    """``rows`` ``[L, kv_heads, dim]`` stored through ``table`` in a pool with blocks to spare:
    (pool, the values as the kernel reads them back, float64)."""
    pool = torch.zeros(2 * table.numel() + 3, KV_HEADS, block_size, fmt.row(DIM), dtype=fmt.storage)
    stored = _stored(rows, fmt)  # [L, kv_heads, row]
    for p in range(rows.shape[0]):
        pool[table[p // block_size], :, p % block_size] = stored[p]
    return pool, (dequantize_q8(stored) if fmt.name == "q8_0" else stored).double()


def _attend(lib, q, kc, vc, table, fmt, positions, block_size: int, threads: int = 2) -> torch.Tensor:
    rows = q.shape[0]
    max_len = int(positions.max()) + 1
    scratch = torch.empty(lib.attention_scratch(rows, HEADS, KV_HEADS, DIM, max_len), dtype=torch.float32)
    out, row_table, tables = torch.empty_like(q), torch.zeros(rows, dtype=torch.int64), table[None].contiguous()
    before = lib.pool_threads()
    lib.pool_set_threads(threads)
    try:
        lib.attention_rows(rows, q.data_ptr(), 0, HEADS, KV_HEADS, DIM, row_table.data_ptr(), positions.data_ptr(),
                           tables.data_ptr(), table.numel(), block_size,
                           kc.data_ptr(), vc.data_ptr(), fmt.kind, max_len, out.data_ptr(), scratch.data_ptr())
    finally:
        lib.pool_set_threads(before)
    return out


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for r, p in enumerate(positions.tolist()):
        for h in range(HEADS):
            k, v = keys[: p + 1, h // group], values[: p + 1, h // group]
            w = torch.softmax(k @ q[r, h * DIM:(h + 1) * DIM].double() / DIM ** 0.5, 0)
            out[r, h * DIM:(h + 1) * DIM] = w @ v
    return out


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "q8_0"])
@pytest.mark.parametrize("length, block_size", [(75, 32), (203, 24), (130, 8), (1029, 32)])
def test_prompt_rows_match_the_reference_and_each_row_alone(kind, length, block_size):
    lib, fmt, gen = native.load(), KV_FORMATS[kind], torch.Generator().manual_seed(length)
    keys, values = torch.randn(length, KV_HEADS, DIM, generator=gen), torch.randn(length, KV_HEADS, DIM, generator=gen)
    blocks = -(-length // block_size)
    table = torch.randperm(2 * blocks + 3, generator=gen)[:blocks].to(torch.int32)  # scattered over the pool
    (kc, k_back), (vc, v_back) = _pool(keys, fmt, table, block_size), _pool(values, fmt, table, block_size)
    rows = 19  # two blocks of consecutive rows (16 + 3)
    positions = torch.arange(length - rows, length, dtype=torch.int64)
    q = torch.randn(rows, HEADS * DIM, generator=gen)
    together = _attend(lib, q, kc, vc, table, fmt, positions, block_size)
    torch.testing.assert_close(together.double(), _reference(q, k_back, v_back, positions), atol=2e-5, rtol=1e-4)
    for r in (0, 7, rows - 1):
        alone = _attend(lib, q[r:r + 1].clone(), kc, vc, table, fmt, positions[r:r + 1].clone(), block_size)
        assert torch.equal(alone[0], together[r]), f"row at position {int(positions[r])} depends on its neighbours"
    assert torch.equal(_attend(lib, q, kc, vc, table, fmt, positions, block_size, threads=1), together)
