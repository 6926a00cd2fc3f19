"""An embedding table read from a tied LM head's q8_0 form instead of a table of its own.

A model whose head is its embedding (``tie_word_embeddings``) keeps the head's q8_0 form for
logits anyway (:meth:`quanta.model.llama.LlamaModel.compute_logits`); with
``--prompt-weights form`` the table itself is dropped and each lookup rebuilds its rows from that
form (``d * q`` per block of 32). For a GGUF whose ``token_embd`` is Q8_0 the form holds the file's
own blocks, so the rows are the table's, bit for bit (``tests/test_prompt_weights.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from quanta.model.quant import QuantizedWeight


class FormEmbedding(nn.Module):
    """``forward(ids)`` -> ``[T, hidden]`` rows of a q8_0 ``[vocab, hidden]`` form, in ``dtype``."""

    def __init__(self, form: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        if form.kind != "q8_0":
            raise ValueError(f"an embedding is read from a q8_0 form, not {form.kind}")
        self.form, self.dtype = form, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        data, scales = self.form.data, self.form.scales  # [V / 8, B, 256] int8 (i, c, j), [V / 8, B, 8] fp16 (c)
        groups, blocks = data.shape[:2]
        group, column = ids // 8, ids % 8
        q = data.view(groups, blocks, 8, 8, 4)[group, :, :, column, :]  # [T, B, 8 (i), 4 (j)]
        d = scales.view(groups, blocks, 8)[group, :, column].float()  # [T, B]
        return (q.float() * d[:, :, None, None]).reshape(ids.shape[0], blocks * 32).to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, rebuilt (a copy, for the rare reader)."""
        return self.form.dense(self.dtype)
