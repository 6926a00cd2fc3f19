"""Random-weight GGUFs of real model shapes: ``quanta make-model --shape NAME --out FILE.gguf [--type Q4_K_M]``.

Real sizes, memory and speed need files of real shapes; their weights need not be trained.
A shape (:data:`SHAPES`) is the subset of the model's Hugging Face ``config.json`` that
decides the file, and the file is written as llama.cpp's ``convert_hf_to_gguf.py`` writes
that architecture (``LlamaModel`` / ``Qwen2Model`` / ``Qwen3Model`` / ``Qwen3MoeModel`` and ``TextModel.set_gguf_parameters``;
shapes and tensor lists in :mod:`quanta.tools.model_shapes`):
the same ``general.*`` and ``{arch}.*`` keys (``{arch}.attention.key_length`` only where the
config names ``head_dim``; ``llama.vocab_size`` and ``llama.rope.dimension_count`` for
``llama``), tensors named ``token_embd``, ``blk.N.attn_q`` ..., ``output_norm``, ``output``
(absent for tied embeddings), 1-D tensors and an MoE router (``ffn_gate_inp``) in F32, matrices and
stacked experts (``ffn_{gate,up,down}_exps``, 3-D, with ``{arch}.expert_count``, ``expert_used_count``
and ``expert_feed_forward_length``) in F16, and for a Llama 3.x
``rope_scaling`` of type ``llama3`` the ``rope_freqs.weight`` F32 tensor of per-frequency
factors computed as the converter computes them (:func:`llama3_rope_factors`).

The tokenizer is the embedded SmolLM2 GGUF's (every ``tokenizer.*`` key, chat template
included) with control tokens ``<|reserved_N|>`` appended up to the shape's vocabulary, so
llama.cpp finds as many tokens as embedding rows. A shape whose vocabulary is smaller than
SmolLM2's 49,152 tokens (Mistral 7B's 32,768) cannot be written this way and is not offered.

Weights are normal: projections and biases with std ``1 / sqrt(fan_in)`` (each block adds a
token-specific term of RMS ~1 to the residual stream), the embedding and an untied output
matrix with std 0.02 (transformers' ``initializer_range``: small beside the blocks' terms, so
a tied head does not echo the input token back), block norms ``1 + N(0, NORM_STD)`` (not all
1, so a norm weight read wrongly or not at all changes the output), and the output norm
``LOGIT_STD / (0.02 sqrt(hidden))`` so logits have std :data:`LOGIT_STD` whether the head is
tied or not: the top-1 logit then leads the next by ~``LOGIT_STD / sqrt(2 ln vocab)`` (about 2)
on average. Rounding moves logits in proportion (an 8-bit rounding of activations by ~0.1-0.2),
so some positions stay near ties between two engines (~5% at 8 bits, ~1% at fp16, on the tiny
shapes: ``tests/test_agreement_llama_cpp.py`` counts them). The reserved tokens' rows of the embedding and of
the output matrix are zero (as Llama 3's untrained reserved tokens are near zero): their logits
are 0, some 4 std below the top ones, so generated tokens are the tokenizer's own, not
unprintable control tokens. An MoE router (``ffn_gate_inp``) has std ``ROUTER_LOGIT_STD / sqrt(hidden)``:
router logits of std 4, so a token's top-k experts get unequal weights and the k-th one a small one.
Where two engines' rounding swaps the k-th and the next expert (a routing near tie), the output then
moves little; with router logits of std 1 (near-equal weights) such swaps move a position's logprobs
by several nats (tiny-qwen3moe's Q8_0 file against llama.cpp: max ``|logprob diff|`` 11.7 at std 1,
2.6 at std 4). Each tensor's generator is seeded
from ``--seed`` and the tensor's name, so ``--layers`` keeps the remaining tensors the same.
Tensors are generated and written one at a time (an 8B F16 file is 16 GB; the largest
tensor held is the embedding). ``--type F32`` widens the F16 values; other ``--type`` values write
the F16 file next to ``--out``, run llama.cpp's own ``llama-quantize`` on it (see
:func:`llama_quantize_binary`) and delete it. :func:`write_direct` also writes Q8_0 / Q5_x / Q4_x
files without llama.cpp (every matrix quantized by the ``gguf`` package; the test files of
``tests/test_agreement_llama_cpp.py``), and Q6_K / Q4_K_M files of random K-quant blocks with each
tensor's type as llama-quantize picks it (:mod:`quanta.tools.kquant_blocks`: the same spread as the
float weights and zero reserved rows, but not the F16 file's values; no F16 file is written);
``--direct`` makes make-model write any of :data:`DIRECT_TYPES` that way (a real-size Q4_K_M at ~15 ns a weight).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quanta.tools import gemma_shapes, phi3_shapes
from quanta.tools.model_shapes import (  # noqa: F401  (re-exported: make-model's shapes)
    SHAPES,
    gguf_arch,
    head_dim,
    llama3_rope_factors,
    parameter_count,
    shape_config,
    tensor_plan,
)

#: the llama-cpp-python sdist whose vendored llama.cpp ``benchmarks/peer_llama_cpp.py`` builds
LLAMA_CPP_PYTHON = "0.3.36"

SYNTHETIC_LABEL = "random weights of the {name} shape (quanta make-model --shape {name}); outputs are meaningless"


#: ``--type`` values: F16 and F32 are written directly, the others by ``llama-quantize`` or ``--direct`` (those needing an imatrix left out)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS",
         "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K")

#: types make-model writes itself (:func:`write_direct`; all the others go through ``llama-quantize``)
DIRECT_TYPES = ("F32", "F16", "Q8_0", "Q6_K", "Q5_1", "Q5_0", "Q4_K_M", "Q4_1", "Q4_0")
#: file types whose matrices are random K-quant blocks (:mod:`quanta.tools.kquant_blocks`), tensor types by llama-quantize's rules
K_TYPES = ("Q6_K", "Q4_K_M")


def _file_types() -> dict[str, Any]:
    import gguf

    names = {"F32": "ALL_F32", "F16": "MOSTLY_F16"}
    return {t: gguf.LlamaFileType[names.get(t, f"MOSTLY_{t}")] for t in DIRECT_TYPES}


#: std of the embedding and of an untied output matrix
EMBEDDING_STD = 0.02
#: std of the block norms' weights around 1
NORM_STD = 0.2
#: std of the logits (set by the output norm's weights)
LOGIT_STD = 10.0
#: std of an MoE router's logits (its weights' std over ``1 / sqrt(hidden)``)
ROUTER_LOGIT_STD = 4.0

#: files of at least this many bytes get progress lines
_PROGRESS_BYTES = 1 << 30

Progress = Callable[[str], None]


# ------------------------------------------------------------------ llama.cpp


def peer_cache() -> Path:
    """Where ``benchmarks/peer_llama_cpp.py`` keeps llama.cpp: ``$QUANTA_PEER_CACHE`` or ``~/.cache/quanta/peer``."""
    return Path(os.environ.get("QUANTA_PEER_CACHE", Path.home() / ".cache" / "quanta" / "peer"))


def llama_cpp_source() -> Path:
    """The llama.cpp tree vendored in the llama-cpp-python sdist, under :func:`peer_cache`."""
    return peer_cache() / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def llama_quantize_binary() -> Path:
    """The built ``llama-quantize``.

    Raises:
        FileNotFoundError: not built; the one-line message names the commands that build it.
    """
    binary = llama_cpp_source() / "build" / "bin" / "llama-quantize"
    if binary.exists():
        return binary
    build = f"cmake --build {binary.parents[1]} --target llama-quantize -j{os.cpu_count() or 2}"
    fetch = "" if binary.parents[1].is_dir() else "python benchmarks/peer_llama_cpp.py (fetches and configures llama.cpp), then "
    raise FileNotFoundError(f"{binary} is not built; run: {fetch}{build}")


# ------------------------------------------------------------------ writing


def _add_metadata(writer: Any, name: str, cfg: dict, file_type: Any) -> None:
    """``general.*``, ``{arch}.*`` and ``tokenizer.*`` keys in the converter's order."""
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(phi3_shapes.general_name(name))
    writer.add_description(SYNTHETIC_LABEL.format(name=name))
    writer.add_size_label(_size_label(cfg))
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_experts"):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if "head_dim" in cfg:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_file_type(file_type)
    if gguf_arch(cfg) == "gemma3":
        gemma_shapes.add_metadata(writer, cfg)
    if gguf_arch(cfg) == "phi3":
        phi3_shapes.add_metadata(writer, cfg, head_dim(cfg))
    if cfg.get("num_experts"):  # Qwen2MoeModel adds it after the common keys
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if gguf_arch(cfg) == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim(cfg))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub_type in padded_tokenizer(cfg["vocab_size"]):
        writer.add_key_value(key, value, vtype, sub_type)


def _size_label(cfg: dict) -> str:
    """``general.size_label`` as the converter derives it from the tensors: the weight count, or for
    stacked experts ``{experts}x{weights outside them + one expert's}`` (``128x1.8B``)."""
    import math

    import gguf

    sizes = [(name, shape) for name, shape, kind, _ in tensor_plan(cfg) if kind != "rope"]
    stacked = [shape for name, shape in sizes if "_exps." in name]
    total, in_experts = sum(math.prod(s) for _, s in sizes), sum(math.prod(s) for s in stacked)
    count = stacked[0][0] if stacked else 0
    return gguf.size_label(total, total - in_experts, sum(math.prod(s[1:]) for s in stacked), count)


#: control tokens a padded vocabulary reserves (as Llama 3's 256 ``<|reserved_special_token_N|>``)
RESERVED_CONTROL = 256


def padded_tokenizer(vocab_size: int) -> list[tuple[str, Any, Any, Any]]:
    """``(key, value, type, array item type)`` of every ``tokenizer.*`` key of the embedded SmolLM2
    GGUF, its token list and token types padded to ``vocab_size`` as a real vocabulary of that size
    is: at most :data:`RESERVED_CONTROL` ``<|reserved_N|>`` CONTROL tokens (Llama 3 reserves 256),
    then ``<pad_N>`` NORMAL tokens that no merge produces (tens of thousands of control tokens
    would make every per-token-type pass, the grammar engine's vocabulary among them, unlike
    a real file's).

    Raises:
        ValueError: ``vocab_size`` is below the embedded tokenizer's.
    """
    import gguf

    out = []
    for key, value, vtype, sub_type in _embedded_tokenizer():
        if key == "tokenizer.ggml.tokens":
            if vocab_size < len(value):
                raise ValueError(f"vocab {vocab_size} is smaller than the embedded tokenizer's {len(value)} tokens")
            known, pad = set(value), vocab_size - len(value)
            control = min(pad, RESERVED_CONTROL)
            extra = [f"<|reserved_{i}|>" for i in range(control)] + [f"<pad_{i}>" for i in range(pad - control)]
            if known.intersection(extra):
                raise ValueError("the embedded tokenizer already has <|reserved_N|> or <pad_N> tokens")
            value = value + extra
        elif key == "tokenizer.ggml.token_type":
            pad = vocab_size - len(value)
            control = min(pad, RESERVED_CONTROL)
            value = value + [gguf.TokenType.CONTROL] * control + [gguf.TokenType.NORMAL] * (pad - control)
        out.append((key, value, vtype, sub_type))
    return out


def tokenizer_size() -> int:
    """Tokens of the embedded tokenizer (49,152 for SmolLM2), before the reserved ones."""
    return len(dict((k, v) for k, v, *_ in _embedded_tokenizer())["tokenizer.ggml.tokens"])


@functools.cache
def _embedded_tokenizer() -> tuple[tuple[str, Any, Any, Any], ...]:
    """``(key, value, type, array item type)`` of the embedded GGUF's ``tokenizer.*`` keys (read once)."""
    from quanta.model.gguf_header import GGUFHeader
    from quanta.model.loader import embedded_model_path

    fields = GGUFHeader(embedded_model_path()).fields
    return tuple((key, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
                 for key, f in fields.items() if key.startswith("tokenizer."))


def _progress_printer(total: int, verb: str, progress: Progress) -> Callable[[int], None]:
    """A callback taking the amount done so far that calls ``progress`` once per ~10% of ``total``."""
    state = {"next": 1}

    def done(amount: int) -> None:
        while state["next"] <= 10 and amount * 10 >= state["next"] * total:
            progress(f"make-model: {verb} {state['next'] * 10}%")
            state["next"] += 1

    return done


def write_f16(name: str, out: str | Path, seed: int = 0, layers: int | None = None, progress: Progress = print) -> Path:
    """Write shape ``name`` with random F16 weights to ``out`` (:func:`write_direct` with ``F16``)."""
    return write_direct(name, out, "F16", seed, layers, progress)


def write_direct(name: str, out: str | Path, qtype: str = "F16", seed: int = 0, layers: int | None = None,
                 progress: Progress = print) -> Path:
    """Write shape ``name`` with random weights to ``out``, every matrix in ``qtype`` (one of
    :data:`DIRECT_TYPES`), one tensor at a time (a partial file is removed). The matrices' values
    are the F16 file's: kept (``F16``), widened (``F32``) or quantized by the ``gguf`` package (its
    numpy port of ggml's reference quantizers); for :data:`K_TYPES` the Q4_K / Q6_K matrices are random
    blocks of the same spread instead. A file depends on the shape, ``seed``, ``layers`` and ``qtype`` only.

    Raises:
        ValueError: unknown shape or type, a vocabulary below the embedded tokenizer's, or a K-quant
            file needing a type not written here (Q5_K).
    """
    import gguf
    import numpy as np
    import torch

    if qtype not in DIRECT_TYPES:
        raise ValueError(f"{qtype} is not written directly; choose one of: {', '.join(DIRECT_TYPES)}")
    cfg, out = shape_config(name, layers), Path(out)
    plan = [(tensor_name, shape, kind, dtype, _matrix_type(qtype, tensor_name, shape, dtype, cfg))
            for tensor_name, shape, kind, dtype in tensor_plan(cfg)]
    plan = [(*row, _stored_bytes(row[1], row[3], row[4])) for row in plan]
    writer = gguf.GGUFWriter(out, gguf_arch(cfg))
    _add_metadata(writer, name, cfg, _file_types()[qtype])
    for tensor_name, shape, _, dtype, ggml_type, nbytes in plan:
        typed = ggml_type is not None  # a weight matrix (or stacked experts): stored in its file type
        writer.add_tensor_info(tensor_name, shape, np.dtype(np.float32) if typed else dtype, nbytes, ggml_type)
    total = sum(nbytes for *_, nbytes in plan)
    report = _progress_printer(total, "wrote", progress) if total >= _PROGRESS_BYTES else lambda _: None
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        written = 0
        for tensor_name, shape, kind, dtype, ggml_type, nbytes in plan:
            if ggml_type is not None and ggml_type.name in ("Q4_K", "Q6_K"):
                values = _random_blocks(tensor_name, shape, kind, ggml_type.name, cfg, seed)
            else:
                values = _random_tensor(tensor_name, shape, kind, getattr(torch, dtype.name), cfg, seed, torch)
            if ggml_type is not None and ggml_type.name not in ("F16", "Q4_K", "Q6_K"):
                values = gguf.quants.quantize(values.astype(np.float32), ggml_type)
            writer.write_tensor_data(values)
            written += nbytes
            report(written)
        writer.close()
    except BaseException:
        writer.close()
        out.unlink(missing_ok=True)
        raise
    return out


def _matrix_type(qtype: str, name: str, shape: tuple[int, ...], dtype: Any, cfg: dict) -> Any:
    """The ggml type of tensor ``name`` in a ``qtype`` file: None for a float32 one (vector, router), else
    ``qtype``'s, or for :data:`K_TYPES` the tensor's type as llama-quantize picks it."""
    import gguf

    if dtype.itemsize == 4:
        return None
    from quanta.tools import kquant_blocks  # numpy: imported only where a file is written

    return gguf.GGMLQuantizationType[kquant_blocks.tensor_type(qtype, name, shape, cfg) if qtype in K_TYPES else qtype]


def _stored_bytes(shape: tuple[int, ...], dtype: Any, ggml_type: Any) -> int:
    """Bytes of a tensor in the file: a float32 one (vector, router) in float32, a float16 one in ``ggml_type``."""
    import math

    import gguf

    if ggml_type is None:
        return math.prod(shape) * dtype.itemsize
    return math.prod(gguf.quants.quant_shape_to_byte_shape(shape, ggml_type))


def _random_tensor(name: str, shape: tuple[int, ...], kind: str, dtype: Any, cfg: dict, seed: int, torch: Any) -> Any:
    """One tensor's values as a numpy array of torch dtype ``dtype`` (:func:`tensor_plan`'s); see the module docstring."""
    if name.startswith("rope_factors_"):  # phi3's LongRoPE factors
        return phi3_shapes.rope_factor_values(cfg, name)
    if kind == "rope":
        return llama3_rope_factors(cfg)
    if kind == "output_norm":
        return torch.full(shape, LOGIT_STD / (EMBEDDING_STD * cfg["hidden_size"] ** 0.5), dtype=dtype).numpy()
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))  # torch's CPU generator keeps 32 seed bits
    if kind == "norm":
        return torch.empty(shape, dtype=dtype).normal_(1.0, NORM_STD, generator=gen).numpy()
    if kind in ("embedding", "output"):  # the reserved tokens' rows stay zero
        values = torch.zeros(shape, dtype=dtype)
        values[:tokenizer_size()].normal_(0.0, EMBEDDING_STD, generator=gen)
        return values.numpy()
    if kind == "router":
        return torch.empty(shape, dtype=dtype).normal_(0.0, ROUTER_LOGIT_STD * shape[-1] ** -0.5, generator=gen).numpy()
    return torch.empty(shape, dtype=dtype).normal_(0.0, _matrix_std(kind, shape, cfg), generator=gen).numpy()


def _matrix_std(kind: str, shape: tuple[int, ...], cfg: dict) -> float:
    """Std of a projection's (``weight``) or a bias's values; see the module docstring."""
    if kind in ("embedding", "output"):
        return EMBEDDING_STD
    return shape[-1] ** -0.5 if kind == "weight" else cfg["hidden_size"] ** -0.5


def _random_blocks(name: str, shape: tuple[int, ...], kind: str, block_type: str, cfg: dict, seed: int) -> Any:
    """Matrix ``name`` as random ``block_type`` blocks with :func:`_random_tensor`'s std and zero rows."""
    import numpy as np

    rng = np.random.default_rng(zlib.crc32(f"{seed}:{name}".encode()))
    zero_from = tokenizer_size() if kind in ("embedding", "output") else None
    from quanta.tools import kquant_blocks  # numpy: imported only where a file is written

    return kquant_blocks.random_blocks(block_type, shape, _matrix_std(kind, shape, cfg), rng, zero_from)


def quantize(src: str | Path, out: str | Path, qtype: str, progress: Progress = print) -> None:
    """``llama-quantize src out qtype`` on all cores; for a big ``src`` a progress line per ~10% of its tensors.

    Raises:
        FileNotFoundError: ``llama-quantize`` is not built.
        RuntimeError: it failed (the message carries its last output line).
    """
    cmd = [str(llama_quantize_binary()), str(src), str(out), qtype, str(os.cpu_count() or 2)]
    tail: deque[str] = deque(maxlen=20)
    report: Callable[[int], None] | None = None if Path(src).stat().st_size >= _PROGRESS_BYTES else lambda _: None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            # tensor lines read "[  12/ 292]  blk.0.attn_q.weight - ..."
            if line.startswith("[") and "/" in line.split("]", 1)[0]:
                done, total = (int(v) for v in line[1:].split("]", 1)[0].split("/"))
                report = report or _progress_printer(total, f"quantized ({qtype})", progress)
                report(done)
    if proc.returncode != 0:
        Path(out).unlink(missing_ok=True)
        last = next((t for t in reversed(tail) if t.strip()), "")
        raise RuntimeError(f"llama-quantize exited with {proc.returncode}: {last}")


def make_gguf(name: str, out: str | Path, qtype: str = "F16", seed: int = 0, layers: int | None = None,
              progress: Progress = print, direct: bool = False) -> Path:
    """Shape ``name`` as a ``qtype`` GGUF at ``out`` (F16 / F32, or with ``direct`` any of :data:`DIRECT_TYPES`,
    written directly; other types through an F16 file beside ``out`` and ``llama-quantize``, the F16 file
    removed afterwards).

    Raises:
        ValueError: unknown shape or type, ``direct`` with a type not written directly, ``out`` exists, or a bad layer count.
        FileNotFoundError: a quantized type and ``llama-quantize`` is not built (checked first).
        RuntimeError: ``llama-quantize`` failed.
    """
    out, qtype = Path(out), qtype.upper()
    if qtype not in TYPES:
        raise ValueError(f"unknown --type {qtype!r}; choose one of: {', '.join(TYPES)}")
    if out.exists():
        raise ValueError(f"{out} exists; remove it or choose another --out")
    shape_config(name, layers)
    if direct and qtype not in DIRECT_TYPES:
        raise ValueError(f"--direct writes {', '.join(DIRECT_TYPES)}, not {qtype}")
    if direct or qtype in ("F16", "F32"):
        return write_direct(name, out, qtype, seed, layers, progress)
    llama_quantize_binary()
    f16 = out.with_name(f".{out.stem}.f16-{os.getpid()}.gguf")
    try:
        write_f16(name, f16, seed, layers, progress)
        quantize(f16, out, qtype, progress)
    finally:
        f16.unlink(missing_ok=True)
    return out


# ------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """``make-model``'s ``--type``, ``--layers`` and ``--direct`` (``--shape`` is added beside ``--preset``)."""
    parser.add_argument("--type", type=str.upper, choices=TYPES, metavar="TYPE",
                        help="with --shape: weight type, F16 and F32 written directly, the others by llama-quantize (or --direct): "
                        "%(choices)s (default F16)")
    parser.add_argument("--layers", type=int, help="with --shape: decoder blocks, instead of the shape's own count")
    parser.add_argument("--direct", action="store_true",
                        help=f"with --shape: write --type without llama-quantize ({', '.join(DIRECT_TYPES)}; Q4_K_M and Q6_K as "
                        "random K-quant blocks in llama-quantize's tensor types, no F16 file)")


def main(args: argparse.Namespace) -> int:
    """Run ``make-model --shape``; returns the exit code."""
    start = time.monotonic()
    qtype = args.type or "F16"
    try:
        out = make_gguf(args.shape, args.out, qtype, args.seed, args.layers, lambda line: print(line, flush=True),
                        getattr(args, "direct", False))
    except RuntimeError as exc:
        print(f"quanta make-model: error: {exc}", file=sys.stderr)
        return 1
    cfg = shape_config(args.shape, args.layers)
    print(f"wrote {out}: shape {args.shape}, {cfg['num_hidden_layers']} layers, {parameter_count(cfg) / 1e9:.2f} B parameters, "
          f"{qtype}, {out.stat().st_size / 1e9:.2f} GB in {time.monotonic() - start:.0f} s (random weights: outputs are meaningless)")
    return 0
