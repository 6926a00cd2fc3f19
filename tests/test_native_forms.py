"""GGUF block forms (q4_1, q8_0) and quanta's C matmul kernels for them.

Packing GGUF-style blocks recovers them exactly (their scales are fp16
values already); the kernels' products equal ``x @ dequantized.T`` up to the
15-bit quantization of the activations (per row and block of 32): observed
relative error ~3e-5 in fp32 (bound 2e-4) and ~0.17% with bf16 in and out (the
output's bf16 rounding; bound 0.5%); with 8-bit activations (the projections'
choice) ~0.55%. The AVX2
kernels (maddubs) and the AVX-512 VNNI ones (dpbusd) give the same sums.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from quanta.model import native
from quanta.model.native import forms
from quanta.model.quant import quantize

pytestmark = pytest.mark.skipif(not forms.available(), reason="quanta's C kernels do not build on this machine")


def gguf_blocks(kind: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A ``[n, k]`` weight of exact Q4_1 (``d * q + m``, q in 0..15 using 0 and 15) or Q8_0
    (``d * q``, q in -127..127 using 127) blocks with fp16 ``d``, ``m``."""
    g = torch.Generator().manual_seed(seed)
    b = k // 32
    d = (torch.rand(n, b, 1, generator=g) * 0.01 + 1e-3).half().float()
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, b, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        m = (-d * 7.5 + torch.randn(n, b, 1, generator=g) * 1e-3).half().float()
        return (d * q + m).reshape(n, k)
    q = torch.randint(-127, 128, (n, b, 32), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_packing_gguf_blocks_recovers_them(kind):
    w = gguf_blocks(kind, 24, 96)
    qw = quantize(w, kind)
    torch.testing.assert_close(qw.dequantize(), w, atol=1e-6, rtol=1e-3)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_shapes_the_kernels_cannot_take_are_refused(kind):
    assert quantize(torch.randn(12, 64), kind, 8) is None  # N not a multiple of 8
    assert quantize(torch.randn(16, 48), kind, 8) is None  # K not a multiple of 32
    assert quantize(torch.randn(16, 64), kind, 8) is not None


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])  # tiles of 4 rows, and a remainder of each size
def test_matmul_equals_the_dequantized_product(kind, dtype, rows):
    w = gguf_blocks(kind, 40, 160, seed=rows)
    qw = quantize(w, kind)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = qw(x)
    assert got.shape == (rows, 40) and got.dtype == dtype
    assert _relative_error(got, x.float() @ w.t()) < (2e-4 if dtype == torch.float32 else 5e-3)


def test_outlier_activations_are_scaled_per_block():
    """One huge activation (as LLM residual streams have) costs precision in its own block only."""
    w = gguf_blocks("q8_0", 16, 256)
    x = torch.randn(1, 256)
    x[0, 5] = 500.0
    got = quantize(w, "q8_0")(x)
    assert _relative_error(got, x @ w.t()) < 2e-4


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_8_bit_activations_are_coarser_but_close(kind, rows):
    """Projections take 8-bit activations (llama.cpp's Q8_1; faster): observed ~0.55%, bound 1.5%."""
    w = gguf_blocks(kind, 48, 256, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(9))
    coarse = _relative_error(quantize(w, kind, fine=False)(x), x @ w.t())
    fine = _relative_error(quantize(w, kind, fine=True)(x), x @ w.t())
    assert fine < 2e-4 < coarse < 0.015


@pytest.fixture(scope="module")
def avx2(tmp_path_factory):
    """The library built for ``-march=haswell`` (256-bit AVX2 code), in a cache of its own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUANTA_CACHE_DIR", str(tmp_path_factory.mktemp("haswell")))
        return native.open_library(native.build("haswell"))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("fine", [True, False])
def test_avx2_and_native_kernels_agree(kind, fine, avx2):
    """Same integer sums (maddubs, int16 madd or dpbusd), so Q8_0's products are the same bits;
    Q4_1's m term is its own FMA chain only where 512-bit tiles exist, so it may differ in the last bits."""
    w = gguf_blocks(kind, 64, 576)
    qw = quantize(w, kind, fine=fine)
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(8))
    got = forms.matmul(kind, x, qw.data, qw.scales, fine, lib=avx2)
    if kind == "q8_0":
        assert torch.equal(got, qw(x))
    torch.testing.assert_close(got, qw(x), atol=1e-4, rtol=1e-4)


def _product(lib, kind: str, x: torch.Tensor, w) -> torch.Tensor:
    return forms.matmul(kind, x, *w, lib=lib)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("fine", [True, False])
@pytest.mark.parametrize("build", ["native", "haswell"])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(kind, fine, build, avx2):
    """Batch invariance: a row multiplied in a tile of 4, of 3 or alone (256- or 512-bit tiles,
    one or two FMA chains) gets the same bits, so a request's greedy tokens do not depend on
    what else is in its decode step. 5 column groups: an odd one left to the 256-bit tile."""
    lib = native.load() if build == "native" else avx2
    w = forms.pack(gguf_blocks(kind, 40, 96), kind)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(3))
    batch = forms.matmul(kind, x, *w, fine, lib=lib)
    for r in range(7):
        assert torch.equal(batch[r:r + 1], forms.matmul(kind, x[r:r + 1], *w, fine, lib=lib)), r


@pytest.fixture
def two_threads():
    lib = native.load()
    before = lib.pool_threads()
    lib.pool_set_threads(2)
    yield lib
    lib.pool_set_threads(before)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n", [8, 24, 40, 1024])  # fewer column groups than threads x 2, odd pairs, many
def test_two_threads_give_the_one_thread_product(kind, n, two_threads):
    lib = two_threads
    w = forms.pack(gguf_blocks(kind, n, 64), kind)
    x = torch.randn(5, 64)
    split = _product(lib, kind, x, w)
    lib.pool_set_threads(1)
    whole = _product(lib, kind, x, w)
    assert torch.equal(split, whole)


def test_concurrent_callers_each_get_their_own_product(two_threads):
    """A caller that finds the pool busy runs its whole job itself (pool.c): no mixed-up outputs."""
    lib = two_threads
    jobs = [(forms.pack(gguf_blocks("q4_1", 64, 96, seed), "q4_1"), torch.randn(3, 96)) for seed in range(4)]
    want = [forms.dequantize("q4_1", *w) for w, _ in jobs]
    errors: list[float] = []

    def work(i: int) -> None:
        w, x = jobs[i]
        for _ in range(200):
            errors.append(_relative_error(_product(lib, "q4_1", x, w), x @ want[i].T))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(errors) == 200 * len(jobs) and max(errors) < 0.02


def _child_product(queue, x: torch.Tensor, w) -> None:
    queue.put(_product(native.load(), "q8_0", x, w).tolist())  # plain lists; only quanta's kernels: torch's OpenMP pool is not fork-safe


def test_a_forked_child_starts_its_own_worker(two_threads):
    """fork() copies the pool's state but not its worker thread; the child must not wait on it."""
    w, x = forms.pack(gguf_blocks("q8_0", 64, 64), "q8_0"), torch.randn(2, 64)
    want = _product(two_threads, "q8_0", x, w)  # the parent's worker is running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_product, args=(queue, x, w))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=10)
    assert child.exitcode == 0 and got == want.tolist()


# --------------------------------------------------------------------------- fp16 weights (f16matmul.c)

CALL_SIZES = (*range(1, 18), 31, 64, 129)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 128), (101, 100)])  # 101 columns: 2 past the 3-column tiles; K = 100: 4 past 8
def test_fp16_kernel_matches_float64_and_computes_a_row_the_same_in_any_call(dtype, shape, two_threads):
    """Float32 products and sums of the fp16 weight: within ~1e-6 of float64 (bf16 out: its
    rounding, 2^-8); and a row's bits do not depend on the call's rows or the pool's threads."""
    lib = two_threads
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 0.05).half()
    x = torch.randn(200, shape[1], generator=torch.Generator().manual_seed(6)).to(dtype)
    whole = forms.f16_matmul(x, w)
    want = x.double() @ w.double().t()
    assert whole.dtype == dtype and ((whole.double() - want).abs() / want.abs().max()).max() < (1e-6 if dtype == torch.float32 else 2**-8)
    differ = []
    for threads in (1, 2):
        lib.pool_set_threads(threads)
        differ += [(threads, m) for m in CALL_SIZES if not torch.equal(forms.f16_matmul(x[-m:], w), whole[-m:])]
    assert differ == []


def test_fp16_kernel_gives_the_avx2_builds_bits(avx2):
    """256-bit vectors in every build: 8-row tiles (AVX-512) sum a row as 4-row ones (AVX2) do."""
    w = (torch.randn(48, 256, generator=torch.Generator().manual_seed(2)) * 0.05).half()
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(forms.f16_matmul(x, w, lib=avx2), forms.f16_matmul(x, w))
