/* 4- and 8-bit weight x 8-bit activation matmuls for a few rows (decode steps).
 *
 * Weights, [n, k] with n a multiple of 8, in blocks of 32 along k (the
 * values of GGUF's Q4_1): w = d * q + m, q in [0, 15], one fp16 d and m per
 * block. Stored interleaved by groups of 8 columns (as llama.cpp's repacked
 * CPU formats are), so that one 32-byte load holds 4 consecutive k of each of
 * 8 columns and the dot products fill the 8 lanes of a vector, one column a
 * lane, with no horizontal sums:
 *   qs[g][b][i][c][j] (bytes, g = column group, b = block, i, j in 0..3,
 *   c in 0..7): low nibble q[8g + c][32b + 4i + j], high nibble
 *   q[8g + c][32b + 16 + 4i + j];
 *   dm[g][b][0][c] = d, dm[g][b][1][c] = m (fp16).
 * Activations are quantized per row and block of 32 (llama.cpp's Q8_1):
 * x ~ dx * p, p in [-127, 127], dx = max|x| / 127, sx = dx * sum(p); a
 * block contributes d * dx * sum(q * p) + m * sx, the integer sum taken by
 * AVX-512 VNNI's dpbusd or AVX2's maddubs.
 *
 * Source of the scheme: llama.cpp's Q4_1 x Q8_1 dot product (ggml-cpu).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "qmatmul.c needs AVX2, FMA and F16C"
#endif

#define QK 32

static inline float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Quantize rows x [rows, k] (io dtype) to p [rows, k] int8 and scales xs [rows, k/32, 2] = (dx, sx). */
static void quantize_rows(int rows, int k, const void *x, int io_bf16, int8_t *p, float *xs) {
    float buf[QK];
    for (int r = 0; r < rows; r++) {
        for (int b = 0; b < k / QK; b++) {
            int64_t at = (int64_t)r * k + (int64_t)b * QK;
            if (io_bf16) {
                for (int j = 0; j < QK; j++) buf[j] = bf16_f32(((const uint16_t *)x)[at + j]);
            } else {
                memcpy(buf, (const float *)x + at, sizeof buf);
            }
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(buf[j]));
            float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                int v = (int)lrintf(buf[j] * inv);
                p[at + j] = (int8_t)v;
                sum += v;
            }
            xs[2 * (at / QK)] = dx;
            xs[2 * (at / QK) + 1] = dx * (float)sum;
        }
    }
}

/* sum over 32 k of q * p for 8 columns: w[i] (4 loads of 32 bytes), p the row's block. */
static inline __m256i block_dot(const __m256i *lo, const __m256i *hi, const int8_t *p) {
    int32_t four[8];
    memcpy(four, p, 32);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i s = _mm256_setzero_si256(), t = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        s = _mm256_dpbusd_epi32(s, lo[i], _mm256_set1_epi32(four[i]));
        t = _mm256_dpbusd_epi32(t, hi[i], _mm256_set1_epi32(four[4 + i]));
    }
    return _mm256_add_epi32(s, t);
#else
    /* 8 maddubs pairs sum to at most 8 * 2 * 15 * 127 = 30,480: int16 holds it */
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[i], _mm256_set1_epi32(four[i])));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[i], _mm256_set1_epi32(four[4 + i])));
    }
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* 8 columns (group g) of R rows (R <= 4): out[r][8g .. 8g + 7]. */
static inline __attribute__((always_inline)) void group8(int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                         const uint8_t *qs, const uint16_t *dm, float *out, int ldo) {
    int blocks = k / QK;
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m256 acc[4], accm[4];  /* the d and m terms apart: two FMA chains, not one twice as long */
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        int64_t gb = g * blocks + b;
        const uint8_t *w = qs + gb * 128;
        __m256i lo[4], hi[4];
        for (int i = 0; i < 4; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * i));
            lo[i] = _mm256_and_si256(v, nib);
            hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + gb * 16)));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + gb * 16 + 8)));
        for (int r = 0; r < R; r++) {
            const float *x = xs + 2 * ((int64_t)r * blocks + b);
            __m256 dot = _mm256_cvtepi32_ps(block_dot(lo, hi, p + (int64_t)r * k + b * QK));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[0])), dot, acc[r]);
            accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[1]), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (int64_t)r * ldo + g * 8, _mm256_add_ps(acc[r], accm[r]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_ZMM 1
/* Two adjacent groups (16 columns) in 512-bit vectors: half the instructions of group8. */
static inline __attribute__((always_inline)) void group16(int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                          const uint8_t *qs, const uint16_t *dm, float *out, int ldo) {
    int blocks = k / QK;
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512 acc[4], accm[4];
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        int64_t gb0 = g * blocks + b, gb1 = (g + 1) * blocks + b;
        const uint8_t *w0 = qs + gb0 * 128, *w1 = qs + gb1 * 128;
        __m512i lo[4], hi[4];
        for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w0 + 32 * i))),
                                           _mm256_loadu_si256((const __m256i *)(w1 + 32 * i)), 1);
            lo[i] = _mm512_and_si512(v, nib);
            hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        }
        __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + gb0 * 16)))),
                                      _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + gb1 * 16))), 1);
        __m512 m = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + gb0 * 16 + 8)))),
                                      _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + gb1 * 16 + 8))), 1);
        for (int r = 0; r < R; r++) {
            int32_t four[8];
            memcpy(four, p + (int64_t)r * k + b * QK, 32);
            __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                s = _mm512_dpbusd_epi32(s, lo[i], _mm512_set1_epi32(four[i]));
                t = _mm512_dpbusd_epi32(t, hi[i], _mm512_set1_epi32(four[4 + i]));
            }
            const float *x = xs + 2 * ((int64_t)r * blocks + b);
            __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s, t));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[0])), dot, acc[r]);
            accm[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[1]), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (int64_t)r * ldo + g * 8, _mm512_add_ps(acc[r], accm[r]));
}
#endif

static inline __attribute__((always_inline)) void row_tile(int R, int n, int k, const int8_t *p, const float *xs,
                                                           const uint8_t *qs, const uint16_t *dm, float *out, int ldo) {
    int64_t g = 0;
#ifdef HAVE_ZMM
    for (; g + 1 < n / 8; g += 2) group16(R, g, k, p, xs, qs, dm, out, ldo);
#endif
    for (; g < n / 8; g++) group8(R, g, k, p, xs, qs, dm, out, ldo);
}

/* sum over 32 k of w * p for 8 columns of 8-bit weights w[0..7] (signed), as
 * |w| * (p with w's sign): the unsigned x signed product the instructions take. */
static inline __m256i block_dot8(const __m256i *w, const int8_t *p) {
    int32_t four[8];
    memcpy(four, p, 32);
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) {
        __m256i a = _mm256_abs_epi8(w[i]), sp = _mm256_sign_epi8(_mm256_set1_epi32(four[i]), w[i]);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        s = _mm256_dpbusd_epi32(s, a, sp);
#else
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(a, sp), _mm256_set1_epi16(1)));
#endif
    }
    return s;
}

/* Q8_0 weights (w = d * q, q in [-127, 127], fp16 d per block of 32), 8 columns interleaved:
 * qs[g][b][i][c][j] = q[8g + c][32b + 4i + j] (i in 0..7), d[g][b][c]. */
static inline __attribute__((always_inline)) void group8_q8(int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                            const int8_t *qs, const uint16_t *dd, float *out, int ldo) {
    int blocks = k / QK;
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        int64_t gb = g * blocks + b;
        __m256i w[8];
        for (int i = 0; i < 8; i++) w[i] = _mm256_loadu_si256((const __m256i *)(qs + gb * 256 + 32 * i));
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + gb * 8)));
        for (int r = 0; r < R; r++) {
            __m256 dot = _mm256_cvtepi32_ps(block_dot8(w, p + (int64_t)r * k + b * QK));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[2 * ((int64_t)r * blocks + b)])), dot, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (int64_t)r * ldo + g * 8, acc[r]);
}

#ifdef HAVE_ZMM
/* Two adjacent Q8_0 groups (16 columns) in 512-bit vectors. */
static inline __attribute__((always_inline)) void group16_q8(int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                             const int8_t *qs, const uint16_t *dd, float *out, int ldo) {
    int blocks = k / QK;
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        int64_t gb0 = g * blocks + b, gb1 = (g + 1) * blocks + b;
        __m512i w[8], a[8];
        for (int i = 0; i < 8; i++) {
            w[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(qs + gb0 * 256 + 32 * i))),
                                      _mm256_loadu_si256((const __m256i *)(qs + gb1 * 256 + 32 * i)), 1);
            a[i] = _mm512_abs_epi8(w[i]);
        }
        __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + gb0 * 8)))),
                                      _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + gb1 * 8))), 1);
        for (int r = 0; r < R; r++) {
            int32_t four[8];
            memcpy(four, p + (int64_t)r * k + b * QK, 32);
            __m512i s = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) {
                /* p with w's sign, zero where w is zero: AVX-512 has no sign_epi8 */
                __m512i pv = _mm512_set1_epi32(four[i]);
                __mmask64 neg = _mm512_movepi8_mask(w[i]);
                __m512i sp = _mm512_mask_sub_epi8(pv, neg, _mm512_setzero_si512(), pv);
                s = _mm512_dpbusd_epi32(s, a[i], sp);
            }
            __m512 dot = _mm512_cvtepi32_ps(s);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xs[2 * ((int64_t)r * blocks + b)])), dot, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (int64_t)r * ldo + g * 8, acc[r]);
}
#endif

static inline __attribute__((always_inline)) void row_tile_q8(int R, int n, int k, const int8_t *p, const float *xs,
                                                              const int8_t *qs, const uint16_t *dd, float *out, int ldo) {
    int64_t g = 0;
#ifdef HAVE_ZMM
    for (; g + 1 < n / 8; g += 2) group16_q8(R, g, k, p, xs, qs, dd, out, ldo);
#endif
    for (; g < n / 8; g++) group8_q8(R, g, k, p, xs, qs, dd, out, ldo);
}

static void finish(int64_t total, const float *acc, void *out, int io_bf16) {
    if (io_bf16) {
        for (int64_t i = 0; i < total; i++) ((uint16_t *)out)[i] = f32_bf16(acc[i]);
    } else {
        memcpy(out, acc, (size_t)total * sizeof(float));
    }
}

/* As q4_matmul, for Q8_0 weights (qs int8 [n / 8, k / 32, 256], d fp16 [n / 8, k / 32, 8]). */
void q8_matmul(int rows, int n, int k, const void *x, int io_bf16, const int8_t *qs, const uint16_t *dd,
               void *out, int8_t *p, float *xs, float *acc) {
    quantize_rows(rows, k, x, io_bf16, p, xs);
    int blocks = k / QK;
    for (int r0 = 0; r0 < rows; r0 += 4) {
        int R = rows - r0 < 4 ? rows - r0 : 4;
        const int8_t *pr = p + (int64_t)r0 * k;
        const float *xr = xs + (int64_t)r0 * blocks * 2;
        float *o = acc + (int64_t)r0 * n;
        switch (R) {
            case 1: row_tile_q8(1, n, k, pr, xr, qs, dd, o, n); break;
            case 2: row_tile_q8(2, n, k, pr, xr, qs, dd, o, n); break;
            case 3: row_tile_q8(3, n, k, pr, xr, qs, dd, o, n); break;
            default: row_tile_q8(4, n, k, pr, xr, qs, dd, o, n); break;
        }
    }
    finish((int64_t)rows * n, acc, out, io_bf16);
}

/* out [rows, n] = x [rows, k] @ w.T (n a multiple of 8, k of 32), x and out in the io dtype (bf16 when io_bf16, else float32).
 * p: int8 scratch [rows, k]; xs: float32 scratch [rows, k / 32, 2]; acc: float32 scratch [rows, n]. */
void q4_matmul(int rows, int n, int k, const void *x, int io_bf16, const uint8_t *qs, const uint16_t *dm,
               void *out, int8_t *p, float *xs, float *acc) {
    quantize_rows(rows, k, x, io_bf16, p, xs);
    int blocks = k / QK;
    for (int r0 = 0; r0 < rows; r0 += 4) {
        int R = rows - r0 < 4 ? rows - r0 : 4;
        const int8_t *pr = p + (int64_t)r0 * k;
        const float *xr = xs + (int64_t)r0 * blocks * 2;
        float *o = acc + (int64_t)r0 * n;
        switch (R) {  /* constant row counts, so the tile loops unroll */
            case 1: row_tile(1, n, k, pr, xr, qs, dm, o, n); break;
            case 2: row_tile(2, n, k, pr, xr, qs, dm, o, n); break;
            case 3: row_tile(3, n, k, pr, xr, qs, dm, o, n); break;
            default: row_tile(4, n, k, pr, xr, qs, dm, o, n); break;
        }
    }
    finish((int64_t)rows * n, acc, out, io_bf16);
}
