"""GGUF tensors converted block by block into C forms (``quanta/model/native/repack.c``), checked
against the ``gguf`` package's own dequantization.

Raw blocks come from ``gguf.quants.quantize`` where it can quantize the type (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, F16, BF16), else from random bytes with fp16 super-scales of realistic size (Q4_K,
Q5_K, Q6_K). Rows include a tiny one (fp16-subnormal scales) and a zero one. Bounds, per weight:

- exact conversions: bit for bit;
- Q4_K -> q4_1: ``15 e(d sc) + e(dmin m)`` (``e(x) = max(|x| 2^-11, 2^-25)``, the fp16 rounding
  of each sub-block's scale and min) plus 2^-22 |w| for the reference's own float32 rounding;
- requantized -> q8_0: ``d8 / 2`` (round to nearest) plus ``d8 2^-16`` for the reciprocal and
  2^-21 |w|, with ``d8`` itself within fp16 rounding of ``max|w| / 127``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from quanta.model import native
from quanta.model.native import forms, repack

pytestmark = pytest.mark.skipif(not forms.available(), reason="quanta's C kernels do not build on this machine")

T = gguf.GGMLQuantizationType
EXACT = {("Q4_0", "q4_1"), ("Q4_1", "q4_1"), ("Q8_0", "q8_0"), ("Q5_0", "q8_0"), ("Q4_0", "q8_0"), ("F16", "fp16"),
         ("BF16", "fp16"), ("Q6_K", "q6_k")}
REQUANTIZED = {("Q4_1", "q8_0"), ("Q5_1", "q8_0"), ("Q4_K", "q8_0"), ("Q5_K", "q8_0"), ("Q6_K", "q8_0")}
PAIRS = sorted(EXACT | REQUANTIZED | {("Q4_K", "q4_1")})
SHAPES = [(24, 256, True), (16, 512, False)]  # (n, k, permuted rows): 24 is a multiple of 8, not of 16


def weights(n: int, k: int, seed: int) -> np.ndarray:
    """Gaussian rows with an outlier per row, row 3 scaled to 1e-6 (subnormal fp16 scales), row 5 zero."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    w[:, 7] *= 8
    w[3] *= 5e-5
    w[5] = 0
    return w


def k_quant_bytes(ggml_type: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K blocks: random quants and 6-bit (int8 for Q6_K) scales, fp16 d
    (and dmin) in [1e-5, 1e-3], and 1e-7 (subnormal) in row 3."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[T[ggml_type]][1]
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scale = rng.uniform(1e-5, 1e-3, (n, k // 256, 2))
    scale[3] = 1e-7
    halves = scale.astype(np.float16).view(np.uint8)  # [n, b, 4]: d, then dmin
    if ggml_type == "Q6_K":
        blocks[..., 208:210] = halves[..., :2]
    else:
        blocks[..., :4] = halves
    return blocks.reshape(n, -1)


def raw_tensor(ggml_type: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    if ggml_type in ("Q4_K", "Q5_K", "Q6_K"):
        return k_quant_bytes(ggml_type, n, k, seed)
    return np.ascontiguousarray(gguf.quants.quantize(weights(n, k, seed), T[ggml_type])).view(np.uint8)


def reference(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, T[ggml_type]).astype(np.float32)


def converted(raw: np.ndarray, ggml_type: str, n: int, k: int, kind: str, rows: np.ndarray | None) -> torch.Tensor:
    """The float32 [n, k] weight the converted form holds."""
    data, scales = repack.to_form(raw, ggml_type, n, k, kind, rows)
    return data.float() if kind == "fp16" else forms.dequantize(kind, data, scales)


def row_map(n: int, permuted: bool) -> np.ndarray | None:
    return np.random.default_rng(n).permutation(n).astype(np.int32) if permuted else None


def fp16_error(x: np.ndarray) -> np.ndarray:
    """Most that rounding x to fp16 (nearest) moves it: half an ulp, or of the subnormal spacing."""
    return np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)


def q4_k_bound(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    blocks = raw.reshape(-1, 144)
    d, dmin = (blocks[:, at:at + 2].copy().view(np.float16).astype(np.float64) for at in (0, 2))
    sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    bound = 15 * fp16_error(d * sc) + fp16_error(dmin * mn)  # [blocks, 8]
    return np.repeat(bound.reshape(n, k // 32), 32, axis=1)


def check_requantized(got: torch.Tensor, want: np.ndarray, raw_scales: torch.Tensor) -> None:
    n, k = want.shape
    d8 = raw_scales.float().permute(0, 2, 1).reshape(n, k // 32).double().numpy()  # [G, B, c] -> [N, B]
    amax = np.abs(want.astype(np.float64)).reshape(n, k // 32, 32).max(axis=-1)
    assert np.all(np.abs(d8 - amax / 127) <= amax / 127 * 2.0**-10 + 2.0**-23)
    err = np.abs(got.double().numpy() - want)
    bound = np.repeat(d8 * (0.5 + 2.0**-16), 32, axis=1) + np.abs(want) * 2.0**-21
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)}"


@pytest.mark.parametrize("n,k,permuted", SHAPES)
@pytest.mark.parametrize("ggml_type,kind", PAIRS)
def test_conversion_matches_gguf_dequantize(ggml_type, kind, n, k, permuted):
    raw, rows = raw_tensor(ggml_type, n, k), row_map(n, permuted)
    order = np.arange(n) if rows is None else rows
    want = reference(raw, ggml_type)[order]
    if (ggml_type, kind) in EXACT:
        got = converted(raw, ggml_type, n, k, kind, rows)
        want_t = torch.from_numpy(want).half().float() if kind == "fp16" else torch.from_numpy(want)
        assert torch.equal(got, want_t)
    elif (ggml_type, kind) in REQUANTIZED:
        data, scales = repack.to_form(raw, ggml_type, n, k, kind, rows)
        check_requantized(forms.dequantize(kind, data, scales), want, scales)
    else:  # Q4_K -> q4_1
        err = np.abs(converted(raw, ggml_type, n, k, kind, rows).double().numpy() - want)
        bound = q4_k_bound(raw, n, k)[order] + np.abs(want) * 2.0**-22
        assert np.all(err <= bound)
        assert err.max() > 0  # the scales' fp16 rounding shows: the bound is not vacuous


@pytest.mark.parametrize("ggml_type,kind", [("Q4_0", "q4_1"), ("Q5_1", "q8_0")])
def test_k_not_a_multiple_of_256(ggml_type, kind):
    """Blocks of 32 go 8 at a time; a row of 11 blocks ends with a batch of 3."""
    n, k = 8, 352
    raw = raw_tensor(ggml_type, n, k)
    data, scales = repack.to_form(raw, ggml_type, n, k, kind)
    got, want = forms.dequantize(kind, data, scales), reference(raw, ggml_type)
    if kind == "q4_1":
        assert torch.equal(got, torch.from_numpy(want))
    else:
        check_requantized(got, want, scales)


def test_row_map_moves_whole_rows():
    n, k = 16, 256
    raw = raw_tensor("Q4_K", n, k)
    rows = np.array([5, 0, 1, 2, 3, 4, 6, 7, 15, 14, 13, 12, 11, 10, 9, 8], dtype=np.int32)
    plain, mapped = (converted(raw, "Q4_K", n, k, "q4_1", r) for r in (None, rows))
    assert torch.equal(mapped, plain[torch.from_numpy(rows).long()])
    assert not torch.equal(mapped, plain)


@pytest.mark.parametrize("ggml_type,kind", [("Q4_K", "q4_1"), ("Q6_K", "q8_0"), ("Q6_K", "q6_k"), ("F16", "fp16")])
def test_parts_written_in_place_equal_their_concatenation(ggml_type, kind):
    """Fused projections: each part converted into its row slice of one form equals the parts
    converted alone and concatenated; a slice of the wrong size is refused."""
    k, sizes = 256, (16, 8, 24)
    raws = [raw_tensor(ggml_type, n, k, seed=i) for i, n in enumerate(sizes)]
    alone = [repack.to_form(raw, ggml_type, n, k, kind) for raw, n in zip(raws, sizes)]
    data, scales = repack.empty_form(kind, sum(sizes), k)
    step, start = (1 if kind == "fp16" else 8), 0
    for raw, n in zip(raws, sizes):
        part = slice(start // step, (start + n) // step)
        repack.to_form(raw, ggml_type, n, k, kind, out=(data[part], scales if kind == "fp16" else scales[part]))
        start += n
    assert torch.equal(data, torch.cat([a[0] for a in alone]))
    assert torch.equal(scales, alone[0][1] if kind == "fp16" else torch.cat([a[1] for a in alone]))
    with pytest.raises(ValueError, match="out must be"):
        repack.to_form(raws[0], ggml_type, sizes[0], k, kind, out=(data[: 1], scales[: 1]))


@pytest.mark.parametrize("ggml_type,kind", [("Q8_0", "q8_0"), ("Q4_1", "q4_1")])
def test_matmul_equals_packed_dequantized(ggml_type, kind):
    """forms.pack of the dequantized tensor recovers these blocks (but the quants of the tiny row's
    blocks whose d rounded to 0 in the file), so the kernel gives the same bits."""
    n, k = 24, 512
    raw = raw_tensor(ggml_type, n, k)
    data, scales = repack.to_form(raw, ggml_type, n, k, kind)
    packed = forms.pack(torch.from_numpy(reference(raw, ggml_type)), kind)
    assert torch.equal(scales, packed[1])
    assert torch.equal(data[1:], packed[0][1:])  # groups 1, 2: no tiny row
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    assert torch.equal(forms.matmul(kind, x, data, scales), forms.matmul(kind, x, *packed))


@pytest.mark.parametrize("ggml_type,kind", sorted(p for p in EXACT if p[1] != "fp16"))
def test_kernel_reads_the_layout(ggml_type, kind):
    """The C matmul on the converted form is x @ W.T of the file's weights (15-bit activations: 2e-4)."""
    n, k = 24, 256
    raw = raw_tensor(ggml_type, n, k)
    data, scales = repack.to_form(raw, ggml_type, n, k, kind)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    want = x.double() @ torch.from_numpy(reference(raw, ggml_type)).double().T
    err = (forms.matmul(kind, x, data, scales).double() - want).abs().max()
    assert err <= 2e-4 * want.abs().max()


def test_q6_k_with_8_bit_activations_reads_the_layout():
    """The 8-bit activations experts take (fine=False): within llama.cpp's Q8 rounding of the product."""
    n, k = 24, 512
    raw = raw_tensor("Q6_K", n, k)
    data, scales = repack.to_form(raw, "Q6_K", n, k, "q6_k")
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    want = x.double() @ torch.from_numpy(reference(raw, "Q6_K")).double().T
    err = (forms.matmul("q6_k", x, data, scales, fine=False).double() - want).abs().max()
    assert 1e-5 * want.abs().max() < err <= 2e-2 * want.abs().max()  # the 8-bit rounding shows, and no more


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fine", [True, False])
def test_q6_k_computes_a_row_the_same_in_any_call(dtype, fine):
    """Each row's bits do not depend on the rows beside it (1 to 13: every tile size and tail) or on
    the pool's threads; nor, for routed experts, on the other experts' rows in the call."""
    n, k = 264, 512
    data, scales = repack.to_form(raw_tensor("Q6_K", n, k), "Q6_K", n, k, "q6_k")
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    lib = native.load()
    before = lib.pool_threads()
    try:
        lib.pool_set_threads(1)
        alone = torch.cat([forms.matmul("q6_k", x[i:i + 1], data, scales, fine) for i in range(13)])
        lib.pool_set_threads(2)
        for rows in (2, 3, 5, 8, 13):
            assert torch.equal(torch.cat([forms.matmul("q6_k", x[i:i + rows], data, scales, fine)
                                          for i in range(0, 13, rows)]), alone)
        experts = forms.matmul_experts("q6_k", x, data, scales, fine, 88, [(2, 4), (0, 6), (1, 3)])
    finally:
        lib.pool_set_threads(before)
    per_expert = [forms.matmul("q6_k", x[a:b], data[11 * e:11 * (e + 1)], scales[11 * e:11 * (e + 1)], fine)
                  for e, a, b in ((2, 0, 4), (0, 4, 10), (1, 10, 13))]
    assert torch.equal(experts, torch.cat(per_expert))


def test_q6_k_embedding_rows_are_the_forms_rows():
    from quanta.model.form_embedding import FormEmbedding
    from quanta.model.quant import QuantizedWeight

    n, k = 40, 256
    data, scales = repack.to_form(raw_tensor("Q6_K", n, k), "Q6_K", n, k, "q6_k")
    table = FormEmbedding(QuantizedWeight("q6_k", data, scales), torch.float32)
    ids = torch.tensor([0, 39, 7, 8, 8, 21])
    assert torch.equal(table(ids), forms.dequantize("q6_k", data, scales)[ids])


@pytest.mark.parametrize("ggml_type,kind", [("Q4_K", "q4_1"), ("Q6_K", "q8_0"), ("Q6_K", "q6_k"), ("BF16", "fp16")])
def test_same_bytes_on_one_and_two_threads(ggml_type, kind):
    n, k = 264, 256  # 33 groups: more than pool_chunks' 32
    raw, rows = raw_tensor(ggml_type, n, k), row_map(n, True)
    lib = native.load()
    before = lib.pool_threads()
    try:
        results = []
        for threads in (1, 2):
            lib.pool_set_threads(threads)
            results.append(repack.to_form(raw, ggml_type, n, k, kind, rows))
    finally:
        lib.pool_set_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_type_ids_and_natural_kinds():
    for name in repack.SUPPORTED:
        assert repack._TYPES[name] == T[name].value
        assert repack._BLOCKS[name] == gguf.GGML_QUANT_SIZES[T[name]]
    kinds = {t: repack.natural_kind(t) for t in ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16", "BF16")}
    assert kinds == {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q4_K": "q4_1", "Q5_0": "q8_0", "Q5_1": "q8_0", "Q5_K": "q8_0",
                     "Q6_K": "q6_k", "Q8_0": "q8_0", "F16": "fp16", "BF16": "fp16"}
    assert repack.natural_kind("Q2_K") is None and repack.natural_kind("F32") is None


@pytest.mark.parametrize("ggml_type,n,k,kind,size,rows,message", [
    ("Q2_K", 8, 256, "q8_0", 8 * 84, None, "no conversion"),
    ("Q5_0", 8, 32, "q4_1", 8 * 22, None, "converts to q8_0"),
    ("Q8_0", 12, 32, "q8_0", 12 * 34, None, "multiple of 8"),
    ("Q4_K", 8, 128, "q4_1", 8 * 72, None, "multiple of 256"),
    ("Q8_0", 8, 32, "q8_0", 8 * 34 - 1, None, "takes 272 bytes"),
    ("Q8_0", 8, 32, "q8_0", 8 * 34, [0, 1, 2, 3, 4, 5, 6, 8], "row map"),
])
def test_rejects_what_it_cannot_convert(ggml_type, n, k, kind, size, rows, message):
    with pytest.raises(ValueError, match=message):
        repack.to_form(bytes(size), ggml_type, n, k, kind, None if rows is None else np.array(rows))


def test_fp16_takes_any_shape_and_bytes_like():
    raw = np.arange(5 * 11, dtype=np.float16) / 7
    data, scales = repack.to_form(raw.tobytes(), "F16", 5, 11, "fp16", np.array([4, 3, 2, 1, 0]))
    assert torch.equal(data, torch.from_numpy(raw.reshape(5, 11)[::-1].copy())) and scales.numel() == 0
    bf16 = torch.randn(5, 11).bfloat16()  # 11: one vector of 8, then 3 one by one
    data, _ = repack.to_form(bf16.view(torch.uint16).numpy(), "BF16", 5, 11, "fp16")
    assert torch.equal(data, bf16.half())
