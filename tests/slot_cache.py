"""A paged KV cache addressed by slot, for tests that drive the model directly.

Slot ``s`` of ``slots`` owns blocks ``i * slots + s``: every block table is
scattered through the pool, so a kernel that read positions as if they were
contiguous would read another slot's blocks. The pool starts filled with NaN:
a read of any position not written first poisons the output (a q8_0 pool: bytes
0xFF, whose fp16 scale is NaN).
"""

from __future__ import annotations

import torch

from quanta.model.attention import KVCache, SeqSlice, blocks_for


class SlotCache(KVCache):
    """``slots`` sequences of up to ``max_len`` positions in blocks of ``block_size``."""

    def __init__(self, num_layers: int, slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype | str, block_size: int = 16) -> None:
        self.slots, self.per_slot = slots, blocks_for(max_len, block_size)
        super().__init__(num_layers, slots * self.per_slot, num_kv_heads, block_size, head_dim, dtype)
        for t in self.k + self.v:
            t.fill_(255 if t.dtype == torch.uint8 else float("nan"))

    def blocks(self, slot: int) -> list[int]:
        """The block table of ``slot``."""
        return [i * self.slots + slot for i in range(self.per_slot)]

    def seq(self, slot: int, start: int, num_new: int) -> SeqSlice:
        """``num_new`` tokens of ``slot`` from position ``start``."""
        return SeqSlice(self.blocks(slot), start, num_new)


def logits_in_chunks(model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids``, one sequence computed in successive chunks of ``chunks`` tokens."""
    from quanta.model.attention import AttentionBatch

    cfg = model.config
    kv = SlotCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 128, cfg.head_dim, torch.float32)
    out, start = [], 0
    for n in chunks:
        out.append(model.compute_logits(model(ids[start:start + n], AttentionBatch([kv.seq(0, start, n)], kv))))
        start += n
    return torch.cat(out)
