/* fp16-weight matmul for a few rows (decode steps): out [rows, n] = x [rows, k] @ w.T, w the
 * plain fp16 weight [n, k] (row-major, nothing packed), widened with F16C and multiplied in
 * float32 with FMA. f32_matmul: the same for a float32 weight (an MoE router).
 *
 * Each output element is the same arithmetic whatever the rows in the call, the tile that
 * computes it and the thread that runs it: 8 lanes along k, lane i summing w[c][kk] * x[r][kk]
 * for kk = i, i + 8, ... in order (one FMA chain; a last partial block of 8 zero-padded), then
 * the 8 lanes added in one fixed tree (hsum256, bf16.h). A tile of R rows by C columns only shares loads:
 * each weight vector serves the tile's rows, each activation vector its columns. Rows go by
 * tiles of up to ROW_TILE (4 in AVX2's 16 vector registers, 8 in AVX-512's 32); the vectors
 * are 256-bit in both builds, so both give the same bits. A call of up to ROW_TILE rows reads
 * the weight once; the output columns are split into chunks for the pool's threads (pool.c).
 *
 * Speed: us a call (median of 51, then of 3 runs alternating with FBGEMM's fp16 GEMM,
 * quantized.linear_dynamic_fp16, in separate processes), fp32 rows in and out, on a 2-core AMD EPYC
 * (Zen 3) VM with avx2 fma f16c and no AVX-512; threads: this pool's, torch's for FBGEMM (the other
 * pool on 1). Each call reads another copy of the weight (96 MB in all, L3 is 32 MB), as a decode
 * step reads its layers' weights:
 *     n x k         rows   1 thread: FBGEMM     C   2 threads: FBGEMM     C
 *     576 x 576       1                74      51               60      40
 *                     4                80      50               63      39
 *                     8               113      76               84      49
 *    1536 x 576       1               142     120              114      88
 *                     4               184     114              115      95
 *                     8               284     183              177     121
 *     576 x 1536      1               164     112              101      80
 *                     4               172     119              116      87
 *                     8               267     206              166     130
 *   49152 x 576       1              4046    3596             2216    2293
 *                     4              4709    3203             2690    2102
 *                     8              9503    5737             5658    3149
 * The VM's memory speed drifts (the LM head's single runs spread by ~20%). One weight called again
 * (in cache) gave 0.91-1.8x FBGEMM's speed, below 1 only at 8 rows of 576 x 1536 (201 against
 * 182 us on one thread, 114 against 112 on two).
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "pool.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "f16matmul.c needs AVX2, FMA and F16C"
#endif

#if defined(__AVX512F__) && defined(__AVX512VL__)
#define ROW_TILE 8
#else
#define ROW_TILE 4
#endif
/* Columns a tile takes (3 weight streams, 3 sums a row; at 4 rows, R x 3 sums, 3 weight vectors and
 * one activation vector fill AVX2's 16 registers). One row in tiles of 2 columns sums too few chains
 * for weights in cache (1536 x 576, one thread: 69 us against 59), in tiles of 4 reads too many
 * streams from memory (LM head, one thread: ~4.4 ms against ~3.6). A call's columns go by such tiles, each
 * through every tile of rows while its weights are in L1. */
#define COLS 3
/* Bytes of weight prefetched ahead of a tile's reads (LM head, 4 rows, one thread: 3.6 ms, 7.5 without). */
#define PREFETCH 32768

struct f16_job {
    int rows, n, k, io_bf16, wf32; /* wf32: float32 weights (f32_matmul), else fp16 */
    const float *x;
    const void *w;
    void *out;
};

/* 8 consecutive weights at element `at` of w, as float32: fp16 widened (WF 0) or float32 (WF 1). */
static inline __attribute__((always_inline)) __m256 load_w8(int WF, const void *w, int64_t at) {
    if (WF) return _mm256_loadu_ps((const float *)w + at);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + at)));
}

/* acc[r][c] += w[c] * x[r] over 8 k: the columns' weights at element at + c ldw of w, the rows'
 * activations at x + r ldx. */
static inline __attribute__((always_inline)) void fma8(int WF, int R, int C, __m256 acc[ROW_TILE][COLS], const void *w,
                                                       int64_t at, int64_t ldw, const float *x, int64_t ldx) {
    __m256 wv[COLS];
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) wv[c] = load_w8(WF, w, at + c * ldw);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        __m256 xv = _mm256_loadu_ps(x + r * ldx);
        __asm__("" : "+x"(xv)); /* one load for the C columns: folded into each FMA it is C loads, the bottleneck */
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
}

/* Rows [r0, r0 + R) by columns [c0, c0 + C) of the output. */
static inline __attribute__((always_inline)) void tile(int WF, const struct f16_job *j, int R, int C, int r0, int c0) {
    int k = j->k, k8 = k & ~7, size = WF ? 4 : 2;
    const float *x = j->x + (int64_t)r0 * k;
    const char *w = (const char *)j->w + (int64_t)c0 * k * size;
    __m256 acc[ROW_TILE][COLS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const char *ahead = w + PREFETCH; /* the tile's C k weights are contiguous: at kk, kk / k of them are read */
#pragma GCC unroll 2
    for (int kk = 0; kk < k8; kk += 8) {
        _mm_prefetch(ahead + size * C * kk, _MM_HINT_T0);
        fma8(WF, R, C, acc, w, kk, k, x + kk, k);
    }
    if (k8 < k) { /* the last k, zero-padded to 8 */
        float wt[COLS][8] = {{0}}; /* column c's weights at byte 8 c size: fp16 ones fill half of each row */
        float xt[ROW_TILE][8] = {{0}};
        for (int c = 0; c < C; c++) memcpy((char *)wt + (int64_t)c * 8 * size, w + ((int64_t)c * k + k8) * size, (size_t)(k - k8) * size);
        for (int r = 0; r < R; r++) memcpy(xt[r], x + (int64_t)r * k + k8, (size_t)(k - k8) * sizeof(float));
        fma8(WF, R, C, acc, wt, 0, 8, xt[0], 8);
    }
    for (int r = 0; r < R; r++) {
        float s[COLS];
        for (int c = 0; c < C; c++) s[c] = hsum256(acc[r][c]);
        store_row(j->out, j->io_bf16, (int64_t)(r0 + r) * j->n + c0, C, s);
    }
}

/* Rows [r0, r0 + R) by columns [c, c + m): one tile, or m < COLS (the last columns) single ones. */
static inline __attribute__((always_inline)) void block(const struct f16_job *j, int R, int r0, int c, int m) {
    if (m == COLS) {
        j->wf32 ? tile(1, j, R, COLS, r0, c) : tile(0, j, R, COLS, r0, c);
        return;
    }
    for (int i = 0; i < m; i++) j->wf32 ? tile(1, j, R, 1, r0, c + i) : tile(0, j, R, 1, r0, c + i);
}

/* Columns a pass over the rows takes (16 tiles: 48 x k fp16 weights, 192 KiB at k = 2,048, held in
 * L2 while each row tile's activations, in L1, meet all of them). One tile a pass read a prompt's
 * activations from L3 once every 3 columns (1,000 rows x 2,048: 8 MB, 5,461 times for a 16,384-column
 * projection). A decode call (one row tile) reads the same tiles in the same order either way. */
#define COL_BLOCK (16 * COLS)

/* The job's columns of share `part`: COL_BLOCK at a time, every row tile through the block's
 * COLS-column tiles in turn. */
static void f16_part(void *arg, int part, int parts, int thread) {
    (void)thread;
    const struct f16_job *j = arg;
    int64_t c0, c1;
    pool_share(j->n, COLS, part, parts, &c0, &c1);
    for (int64_t b = c0; b < c1; b += COL_BLOCK) {
        int64_t b1 = c1 - b < COL_BLOCK ? c1 : b + COL_BLOCK;
        for (int r0 = 0; r0 < j->rows; r0 += ROW_TILE) {
            for (int64_t c = b; c < b1; c += COLS) {
                int m = b1 - c < COLS ? (int)(b1 - c) : COLS;
#define ROWS_CASE(R) \
    case R: block(j, R, r0, (int)c, m); break;
                switch (j->rows - r0 < ROW_TILE ? j->rows - r0 : ROW_TILE) { /* constants, so the tile loops unroll */
                    ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
#if ROW_TILE == 8
                    ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#endif
                }
            }
        }
    }
}

/* out [rows, n] = x [rows, k] @ w.T, w fp16 [n, k]; x and out bf16 when io_bf16, else float32.
 * xf: float32 scratch [rows, k] that bf16 rows are widened into (unused for float32). */
void f16_matmul(int rows, int n, int k, const void *x, int io_bf16, const uint16_t *w, void *out, float *xf) {
    if (io_bf16) load_row(x, 1, 0, (int64_t)rows * k, xf);
    struct f16_job job = {rows, n, k, io_bf16, 0, io_bf16 ? xf : (const float *)x, w, out};
    pool_run(f16_part, &job, pool_chunks((n + COLS - 1) / COLS));
}

/* f16_matmul with float32 weights w [n, k]: the same tiles and sums (a small float32 matrix, such
 * as an MoE router, computed row by row the same in a call of any size). */
void f32_matmul(int rows, int n, int k, const void *x, int io_bf16, const float *w, void *out, float *xf) {
    if (io_bf16) load_row(x, 1, 0, (int64_t)rows * k, xf);
    struct f16_job job = {rows, n, k, io_bf16, 1, io_bf16 ? xf : (const float *)x, w, out};
    pool_run(f16_part, &job, pool_chunks((n + COLS - 1) / COLS));
}
