"""An embedding table read from a weight form instead of a table of its own.

A model whose head is its embedding (``tie_word_embeddings``) keeps the head's form for logits
anyway (:meth:`quanta.model.llama.LlamaModel.compute_logits`); with ``--prompt-weights form`` the
table itself is dropped and each lookup rebuilds its rows from that form. A model built from a
GGUF's blocks (:mod:`quanta.model.gguf_blocks`) keeps its ``token_embd`` only as a form too. Rows
are rebuilt as the kernels read them: ``d * q`` (q8_0), ``d * q + m`` (q4_1) per block of 32,
``(d * s) * (u - 32)`` (q6_k), or the fp16 value; for a GGUF whose ``token_embd`` is Q8_0, Q4_1 or
Q6_K the form holds the file's own blocks, so the rows are the table's, bit for bit
(``tests/test_prompt_weights.py``, ``tests/test_gguf_repack.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from quanta.model.native.forms import q6_k_rows
from quanta.model.quant import QuantizedWeight

#: forms an embedding can be read from
EMBEDDING_FORMS = ("q8_0", "q4_1", "q6_k", "fp16")


class FormEmbedding(nn.Module):
    """``forward(ids)`` -> ``[T, hidden]`` rows of a ``[vocab, hidden]`` form, in ``dtype``."""

    def __init__(self, form: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        if form.kind not in EMBEDDING_FORMS or (form.kind == "fp16" and not form.c_kernel):
            raise ValueError(f"an embedding is read from a {', '.join(EMBEDDING_FORMS)} form, not {form.kind}")
        self.form, self.dtype = form, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        data, scales = self.form.data, self.form.scales
        if self.form.kind == "fp16":
            return data[ids].to(self.dtype)
        groups, blocks = data.shape[:2]
        group, column = ids // 8, ids % 8
        if self.form.kind == "q6_k":  # [V / 8, B, 208], [V / 8, B / 8, 8]: qmatmul.c's layout
            return q6_k_rows(data[group], scales[group], column).reshape(ids.shape[0], blocks * 32).to(self.dtype)
        if self.form.kind == "q8_0":  # [V / 8, B, 256] int8 (i, c, j), [V / 8, B, 8] fp16 (c)
            q = data.view(groups, blocks, 8, 8, 4)[group, :, :, column, :]  # [T, B, 8 (i), 4 (j)]
            d, m = scales.view(groups, blocks, 8)[group, :, column].float(), None  # [T, B]
        else:  # [V / 8, B, 128] uint8 (i, c, j: low nibbles values i * 4 + j, high ones 16 + i * 4 + j), [V / 8, B, 2, 8]
            cells = data.view(groups, blocks, 4, 8, 4)[group, :, :, column, :]  # [T, B, 4 (i), 4 (j)]
            q = torch.cat([cells & 15, cells >> 4], dim=2)  # [T, B, 8, 4]
            d, m = scales[group, :, 0, column].float(), scales[group, :, 1, column].float()
        rows = q.float() * d[:, :, None, None]
        if m is not None:
            rows = rows + m[:, :, None, None]
        return rows.reshape(ids.shape[0], blocks * 32).to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, rebuilt (a copy, for the rare reader)."""
        return self.form.dense(self.dtype) if self.form.native else self.form.data.to(self.dtype)
