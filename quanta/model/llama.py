"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2; MoE: Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, dots1) over a slot KV cache.

The forward pass takes every scheduled token of a step flattened into one
``[T]`` vector, so a step may mix sequences with many new tokens (prefill
chunks) and sequences with one (decode). Linear layers run on ``[T, d]`` in one
matmul each; attention is the only per-sequence part and reads its context from
:class:`~quanta.model.attention.AttentionBatch`. MoE layers replace the MLP
with :class:`~quanta.model.moe.MoEBlock`; dense layers are untouched. The block
parts are in :mod:`quanta.model.layers`; Gemma 3 stacks its own blocks on them
(:mod:`quanta.model.gemma`).

Reference: the Hugging Face ``transformers`` Llama/Qwen2/Qwen3 modeling code,
which ``tests/test_model.py`` checks these logits against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quanta.model import gemma
from quanta.model.attention import AttentionBatch
from quanta.model.config import ModelConfig
from quanta.model.form_embedding import FormEmbedding
from quanta.model.layers import MLP, Attention, RMSNorm
from quanta.model.linear import PackedLinear, linear, pack_weight
from quanta.model.moe import ExpertStats, MoEBlock, RoutedExperts, expert_stats
from quanta.model.quant import QuantizedWeight, quantize
from quanta.model.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEBlock(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, batch.decode) if isinstance(self.mlp, MLP) else self.mlp(h))


class LlamaModel(nn.Module):
    """Decoder stack plus LM head.

    Use :meth:`forward` for hidden states of all scheduled tokens and
    :meth:`compute_logits` on the rows that need a next-token distribution
    (one per sampling sequence), so prefill never pays for a ``[T, vocab]``
    projection.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        block = gemma.GemmaDecoderLayer if gemma.is_gemma(cfg) else DecoderLayer
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_hidden_layers))
        #: Gemma's embedding multiplier (None: none) and its sliding layers' RoPE (built at first use)
        self.embed_scale = gemma.embedding_scale(cfg)
        self._local_rope = None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else PackedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg)
        self._tied_head_packed: torch.Tensor | None = None
        self._tied_head_form: QuantizedWeight | None = None
        #: what :meth:`quantize_weights` did, e.g. ``{"q4_1": 120, "q8_0": 1}`` (linears per form)
        self.quantized: dict[str, int] = {}
        #: the forms :meth:`quantize_weights` attached to (projections, lm_head)
        self.weight_forms: tuple[str | None, str | None] = (None, None)
        self.moe_blocks = [m for m in self.modules() if isinstance(m, MoEBlock)]
        self._last_num_tokens = 0
        #: runs all-decode steps when set (:meth:`enable_native_decode`)
        self.native = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """Run the decoder on flattened tokens.

        Args:
            input_ids: ``[T]`` int64 token ids of every scheduled token, grouped
                by sequence in ``batch.seqs`` order.
            batch: per-sequence context (slot, cached length, new tokens), the
                KV cache the new keys/values are written to, and the rows' role:
                a decode batch (generated tokens) runs the C glue where enabled
                and the weights' decode forms, a prompt batch the reference.
            between_layers: called after each decoder block of a prompt batch;
                an exception it raises ends the forward there (the engine's way
                to stop a long prefill whose requests were all cancelled).

        Returns:
            ``[T, hidden_size]`` final-normed hidden states.
        """
        self._last_num_tokens = input_ids.shape[0]
        if self.native is not None and batch.decode:
            return self.native.forward(input_ids, batch)
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        batch.rope_tables = self.rope.tables(batch.positions, batch.max_position, x.dtype)
        if self.config.sliding_layers and self.config.rope_local_base_freq is not None:
            self._local_rope = self._local_rope or gemma.local_rope(self.config)
            batch.local_rope_tables = self._local_rope.tables(batch.positions, batch.max_position, x.dtype)
        for layer in self.layers:
            x = layer(x, batch)
            if between_layers is not None:
                between_layers()
        return self.norm(x)

    def enable_native_decode(self) -> str:
        """Run all-decode steps with the C glue of :mod:`quanta.model.native_decode`.

        Call after :meth:`pack_weights` and :meth:`quantize_weights`. Returns
        ``native`` or ``torch (<why not>)`` for the startup line; never raises.
        The C kernels' thread count is ``self.native.tuner``'s.
        """
        from quanta.model.native import NativeUnavailable
        from quanta.model.native_decode import NativeDecoder

        if gemma.is_gemma(self.config):
            self.native = None
            return "torch (the C decode glue has no Gemma blocks: four norms, GELU, sliding windows)"
        try:
            self.native = NativeDecoder(self)
        except (ValueError, NativeUnavailable) as e:
            self.native = None
            return f"torch ({e})"
        return "native"

    def expert_stats(self) -> ExpertStats | None:
        """Expert activity of the last :meth:`forward`, averaged over MoE layers (None if dense)."""
        return expert_stats(self.moe_blocks, self._last_num_tokens)

    @property
    def lm_head_form(self) -> QuantizedWeight | None:
        """The LM head's weight form (:meth:`quantize_weights`), tied or not."""
        return self.lm_head.form if self.lm_head is not None else self._tied_head_form

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32 logits.

        Every sampled row, a prompt's last or a generated token, goes through the
        head's form when it has one (else the reference): the head's kernel does not
        depend on the role or on the rows beside it."""
        form = self.lm_head_form
        if form is not None and form.native:
            hidden = hidden.float()  # exact; the C kernel then writes float32 logits, not bf16-rounded ones
        if self.lm_head is not None:
            logits = self.lm_head(hidden, True).float()
        else:
            weight = None if form is not None else self.embed_tokens.weight  # a form: the table is never read
            logits = linear(hidden, weight, None, self._tied_head_packed, form, True).float()
        return gemma.softcap(logits, self.config.final_logit_softcapping)

    def pack_weights(self) -> int:
        """Pre-pack bf16 projection weights for oneDNN (see :mod:`quanta.model.linear`).

        Call after loading and dtype conversion. Returns how many were packed
        (0 where oneDNN cannot pack).
        """
        count = sum(m.pack() for m in self.modules() if isinstance(m, (PackedLinear, RoutedExperts)))
        if self.lm_head is None:
            self._tied_head_packed = pack_weight(self.embed_tokens.weight.detach())
            count += self._tied_head_packed is not None
        return count

    def drop_plain_weights(self) -> int:
        """Free what the kernels no longer read: each packed projection's plain weight
        (:meth:`PackedLinear.drop_plain_weight`), and a tied head's packed copy once the head has
        a form (every logit row goes through the form, :meth:`compute_logits`). Call after
        :meth:`pack_weights` and :meth:`quantize_weights`. Returns how many tensors were freed."""
        freed = sum(m.drop_plain_weight() for m in self.modules() if isinstance(m, PackedLinear))
        if self._tied_head_form is not None and self._tied_head_packed is not None:
            self._tied_head_packed = None
            freed += 1
        return freed

    def drop_reference_weights(self) -> int:
        """Free the reference weight of every projection a C form holds
        (:meth:`PackedLinear.drop_reference`): prompt rows then multiply by the weight rebuilt
        from the form (``--prompt-weights form``). A tied head's q8_0 form also replaces the
        embedding table (:class:`~quanta.model.form_embedding.FormEmbedding`). Call after
        :meth:`quantize_weights`. Returns how many projections were freed."""
        freed = sum(m.drop_reference() for m in self.modules() if isinstance(m, PackedLinear))
        form = self._tied_head_form
        if freed and form is not None and form.kind == "q8_0" and isinstance(self.embed_tokens, nn.Embedding):
            self.embed_tokens = FormEmbedding(form, self.dtype)
        return freed

    @property
    def dtype(self) -> torch.dtype:
        """The dtype activations and reference weights are computed in."""
        emb = self.embed_tokens
        return emb.dtype if isinstance(emb, FormEmbedding) else emb.weight.dtype

    def quantize_weights(self, projection: str | None, lm_head: str | None, fine_projections: bool = False) -> dict[str, int]:
        """Attach the decode form of the projections and of the LM head (see :mod:`quanta.model.quant`).

        Args:
            projection: the form (``int8``, ``int4``, ``fp16``, ``q4_1``, ``q8_0``)
                for the attention and dense-MLP projections; MoE experts keep
                the reference path. None: the reference only.
            lm_head: the same for the LM head (tied or not).
            fine_projections: q4_1 / q8_0 projections take 15-bit activations
                (the LM head always does); default 8-bit, as llama.cpp, ~1.4x
                faster a decode step (``benchmarks/quant_kernels.py``).

        Returns:
            linears given each form (a shape a kernel cannot take keeps its reference only).
        """
        counts: dict[str, int] = {}

        def attach(weight: torch.Tensor, kind: str | None, fine: bool) -> QuantizedWeight | None:
            form = quantize(weight, kind, fine) if kind else None
            if form is not None:
                counts[form.kind] = counts.get(form.kind, 0) + 1
            return form

        for layer in self.layers:
            linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            if isinstance(layer.mlp, MLP):
                linears += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
            for lin in linears:
                lin.form = attach(lin.weight, projection, fine_projections)
        if self.lm_head is not None:
            self.lm_head.form = attach(self.lm_head.weight, lm_head, True)
        else:
            self._tied_head_form = attach(self.embed_tokens.weight, lm_head, True)
        self.quantized, self.weight_forms = counts, (projection, lm_head)
        if self.native is not None:
            self.native.forget_plans()
        return counts

    def weight_count(self) -> int:
        """Weights the model represents: its parameters (a meta or deleted one not counted) and the
        ``N x K`` of each C form held without a parameter (a model built from a GGUF's blocks)."""
        total = sum(p.numel() for p in self.parameters() if not p.is_meta)
        forms = [f for m in self.modules() for f in (getattr(m, "form", None), *getattr(m, "forms", ()))
                 if isinstance(f, QuantizedWeight) and "weight" not in getattr(m, "_parameters", {})]
        return total + sum(f.shape[0] * f.shape[1] for f in forms)

    def weight_bytes(self) -> int:
        """Bytes of every weight the model holds: parameters, packed copies and forms."""
        seen: set[int] = set()

        def size(t: torch.Tensor | None) -> int:
            if t is None or t.is_meta or id(t) in seen:
                return 0
            seen.add(id(t))
            return t.numel() * t.element_size()
        total = sum(size(p) for p in self.parameters())
        for m in self.modules():
            for form in (getattr(m, "form", None), *getattr(m, "forms", ())):  # forms: routed experts'
                if isinstance(form, QuantizedWeight):
                    total += size(form.data) + size(form.scales)
            total += size(getattr(m, "packed", None)) if isinstance(m, PackedLinear) else 0
        tied = self._tied_head_form
        return total + size(self._tied_head_packed) + (size(tied.data) + size(tied.scales) if tied is not None else 0)

    def describe_kernels(self) -> str:
        """One line naming each part's decode form and the reference, e.g.
        ``projections=q4_1 lm_head=q8_0 reference=float32-onednn-packed``, or for a model built from
        a GGUF's blocks ``projections=q4_1:48,q8_0:16 lm_head=q8_0 from-blocks`` (linears per form)."""
        if self.weight_forms[0] == "blocks":
            counts = dict(self.quantized)
            counts[self.weight_forms[1]] -= 1  # the head's
            parts = ",".join(f"{k}:{v}" for k, v in sorted(counts.items()) if v)
            return f"projections={parts} lm_head={self.weight_forms[1]} from-blocks"
        def form(kind: str | None) -> str:
            return kind if kind and self.quantized.get(kind) else "reference"
        linears = [m for m in self.modules() if isinstance(m, PackedLinear)]
        packed = self._tied_head_packed is not None or any(m.packed is not None for m in linears)
        dtype = str(self.dtype).removeprefix("torch.")
        ref = f"{dtype}-onednn-packed" if packed else f"{dtype}-F.linear"
        if linears and all(m.packed is None and "weight" not in m._parameters for m in linears):
            ref = f"{dtype}-rebuilt-from-form"
        return f"projections={form(self.weight_forms[0])} lm_head={form(self.weight_forms[1])} reference={ref}"

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face checkpoints, fusing q/k/v and gate/up.

        MoE layers take the loader's canonical names (``mlp.gate.weight``,
        ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
        ``[E, H, I]``, ``mlp.shared_expert.{gate,up,down}_proj.weight``).

        Raises:
            KeyError: a tensor the architecture needs is missing.
            RuntimeError: a tensor has the wrong shape.
        """
        own = {}
        for name, tensor in state.items():
            own[name.removeprefix("model.")] = tensor
        fused = {}
        for i in range(self.config.num_hidden_layers):
            attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            fused[attn + "qkv_proj.weight"] = torch.cat([own.pop(attn + f"{p}_proj.weight") for p in "qkv"])
            if self.config.attention_bias:
                fused[attn + "qkv_proj.bias"] = torch.cat([own.pop(attn + f"{p}_proj.bias") for p in "qkv"])
            if self.config.is_moe_layer(i):
                mlp += "shared_expert."
                if mlp + "gate_proj.weight" not in own:
                    continue
            fused[mlp + "gate_up_proj.weight"] = torch.cat([own.pop(mlp + "gate_proj.weight"), own.pop(mlp + "up_proj.weight")])
        own.update(fused)
        if self.lm_head is None:
            own.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(own, strict=False)
        if missing:
            raise KeyError(f"checkpoint lacks tensors: {', '.join(missing[:5])}")
        if unexpected:
            raise KeyError(f"checkpoint has unexpected tensors: {', '.join(unexpected[:5])}")
