/* 4- and 8-bit weight matmuls for a few rows (decode steps), with integer dot products.
 *
 * Weights, [n, k] with n a multiple of 8, in blocks of 32 along k with fp16
 * scales, as GGUF stores them: Q4_1 (w = d * q + m, q in [0, 15]) or Q8_0
 * (w = d * q, q in [-127, 127]). Stored interleaved by groups of 8 columns
 * (as llama.cpp's repacked CPU formats are), so one 32-byte load holds 4
 * consecutive k of each of 8 columns and the dot products fill a vector's
 * lanes one column a lane, with no horizontal sums:
 *   Q4_1: qs[g][b][i][c][j] (bytes; g column group, b block, i, j in 0..3,
 *         c in 0..7): low nibble q[8g + c][32b + 4i + j], high nibble
 *         q[8g + c][32b + 16 + 4i + j]; dm[g][b][0][c] = d, dm[g][b][1][c] = m.
 *   Q8_0: qs[g][b][i][c][j] = q[8g + c][32b + 4i + j] (i in 0..7); d[g][b][c].
 *   Q6_K (w = d * s * (u - 32), u in [0, 63], s an int8 scale per 16 k, d fp16 per 256 k: GGUF's
 *         Q6_K values, held in its 6.5625 bits a weight): 208 bytes a block, the low 4 bits of u
 *         as Q4_1's qs (bytes 0-127), the top 2 bits of the 8 unpacked chunks t (Q4_1's lo[0],
 *         hi[0], lo[1], ...) at bits 2 (t % 4) of bytes 128 + 32 (t / 4) + 4c + j (128-191), the
 *         scales s[h][c] of k 16h .. 16h + 15 (192-207); d[g][b / 8][c].
 *
 * Activations are quantized per row and block of 32 to 15-bit integers,
 * a = round(x / dx), dx = max|x| / 16256, held as two signed bytes
 * a = 128 h + l (h in [-127, 127], l in [-64, 63]); sx = dx * sum(a). The
 * integer dot of q with a is 128 (q . h) + (q . l), two byte dot products
 * (AVX-512 VNNI's dpbusd, or AVX2's maddubs + madd; Q8_0 without VNNI takes a as int16,
 * one madd, q8_wide8). 8-bit activations
 * (llama.cpp's Q8_1) were measured too coarse: they flipped greedy answers
 * that bf16 activations keep (tests/test_quant.py); 15 bits are within
 * ~1e-4 of the float product. A block adds d * dx * (q . a) + m * sx.
 *
 * Source of the block scheme: llama.cpp's Q4_1 / Q8_0 dot products (ggml-cpu).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "pool.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "qmatmul.c needs AVX2, FMA and F16C"
#endif

#define QK 32
#define AMAX 16256.0f /* 127 * 128: h = floor((a + 64) / 128) stays in [-127, 127] */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_ZMM 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI256 1
#endif
/* Rows a tile computes together (each unpacked weight block used for all of them, each row's
 * sums in registers): 8 where AVX-512 has 32 vector registers, else 4. */
#ifdef HAVE_ZMM
#define ROW_TILE 8
#else
#define ROW_TILE 4
#endif

/* 32 int32 in a0..a3 (k order) -> 32 bytes at dst, in order (values in [-128, 127]). packs work
 * within 128-bit lanes, so the packed 4-byte groups come out a0 0-3, a1 0-3, a2 0-3, a3 0-3, a0 4-7,
 * ...; the permute puts them back. */
static inline void pack_bytes(__m256i a0, __m256i a1, __m256i a2, __m256i a3, int8_t *dst) {
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(a0, a1), _mm256_packs_epi32(a2, a3));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)dst, b);
}

/* 16 int32 in a0, a1 -> 16 int16 at dst, in order */
static inline void pack_words(__m256i a0, __m256i a1, int16_t *dst) {
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a0, a1), 0xd8);
    _mm256_storeu_si256((__m256i *)dst, w);
}

/* x [rows, k] (io dtype) -> p [rows][2][k] int8 (h, then l) and xs [rows, k / 32, 2] = (dx, sx);
 * fine = 0: 8-bit activations, h = a, dx = max|x| / 127 (l unused, or with flip l = a ^ 0x80: a + 128
 * as unsigned); wide (with fine): p holds a itself, int16 [rows, k], in the same bytes. a = x * (1 /
 * dx) rounded to nearest even (the vector conversion under the default rounding mode, as lrintf).
 * quantize_for picks wide and flip for a kind. */
static void quantize_rows(int rows, int k, const void *x, int io_bf16, int fine, int wide, int flip, int8_t *p,
                          float *xs) {
    float buf[QK];
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int r = 0; r < rows; r++) {
        int8_t *h = p + (int64_t)r * 2 * k, *l = h + k;
        int16_t *a16 = (int16_t *)p + (int64_t)r * k;
        for (int b = 0; b < k / QK; b++) {
            int64_t at = (int64_t)r * k + (int64_t)b * QK;
            const float *src = (const float *)x + at; /* float32 rows read in place, bf16 ones widened */
            if (io_bf16) {
                load_row(x, 1, at, QK, buf);
                src = buf;
            }
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(src + 8 * i);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            /* the divisions as written, whatever -ffast-math allows (GCC keeps divss builtins): a
             * rewrite such as 1 / (amax / 16256) -> 16256 / amax would move a's rounding */
            float dx = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(amax), _mm_set_ss(fine ? AMAX : 127.0f)));
            float inv = dx > 0.0f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.0f), _mm_set_ss(dx))) : 0.0f;
            __m256i a[4], hi[4], sum = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                a[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
                sum = _mm256_add_epi32(sum, a[i]);
                /* arithmetic shift: floor((a + 64) / 128) */
                hi[i] = fine ? _mm256_srai_epi32(_mm256_add_epi32(a[i], _mm256_set1_epi32(64)), 7) : a[i];
            }
            if (wide) {
                pack_words(a[0], a[1], a16 + b * QK);
                pack_words(a[2], a[3], a16 + b * QK + 16);
            } else {
                pack_bytes(hi[0], hi[1], hi[2], hi[3], h + b * QK);
                if (fine) {
                    __m256i lo[4];
                    for (int i = 0; i < 4; i++) lo[i] = _mm256_sub_epi32(a[i], _mm256_slli_epi32(hi[i], 7));
                    pack_bytes(lo[0], lo[1], lo[2], lo[3], l + b * QK);
                } else if (flip) {
                    /* l holds a with its sign bit flipped (a + 128, unsigned), the form q8_group16's
                     * dpbusd takes, made once here, not once a column pair */
                    __m256i hb = _mm256_loadu_si256((const __m256i *)(h + b * QK));
                    _mm256_storeu_si256((__m256i *)(l + b * QK), _mm256_xor_si256(hb, _mm256_set1_epi8((char)0x80)));
                }
            }
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            xs[2 * (at / QK)] = dx;
            xs[2 * (at / QK) + 1] = dx * (float)_mm_cvtsi128_si32(s4);
        }
    }
}

/* ---- 256-bit: one group of 8 columns ---- */

/* The 4 activation bytes at a, in every int32 lane. */
static inline __m256i bcast4(const int8_t *a) {
    int32_t v;
    memcpy(&v, a, 4);
    return _mm256_set1_epi32(v);
}

static const int ORDER_Q4[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* lo[0], hi[0], lo[1], ...: k 0-3, 16-19, 4-7, ... */

/* Q4_1's u8 weights w[i] (8 chunks of 4 k per column) times one row's 32 activation bytes a
 * (chunk i of w takes a[4 ORDER_Q4[i] ..]): the int32 sum per column lane. */
static inline __attribute__((always_inline)) __m256i dot_u8(const __m256i *w, const int8_t *a) {
#ifdef HAVE_VNNI256
    /* two chains: dpbusd has a latency of several cycles, and 8 in a row stall a one-row call */
    __m256i s = _mm256_setzero_si256(), t = _mm256_setzero_si256();
    for (int i = 0; i < 8; i += 2) {
        s = _mm256_dpbusd_epi32(s, w[i], bcast4(a + 4 * ORDER_Q4[i]));
        t = _mm256_dpbusd_epi32(t, w[i + 1], bcast4(a + 4 * ORDER_Q4[i + 1]));
    }
    return _mm256_add_epi32(s, t);
#else
    /* int16 holds the sum of 8 maddubs pairs: at most 8 * 2 * 15 * 128 = 30,720 */
    __m256i s = _mm256_maddubs_epi16(w[0], bcast4(a));
    for (int i = 1; i < 8; i++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[i], bcast4(a + 4 * ORDER_Q4[i])));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* 128 (w . h) + (w . l) for one row's block, h and l its two activation bytes (F = 0: w . h). */
static inline __attribute__((always_inline)) __m256i dot15(int F, const __m256i *w, const int8_t *h, const int8_t *l) {
    if (!F) return dot_u8(w, h);
    return _mm256_add_epi32(_mm256_slli_epi32(dot_u8(w, h), 7), dot_u8(w, l));
}

/* Q4_1's m term apart from the d term (two FMA chains, not one twice as long) where 512-bit
 * tiles share the rows with these (their sums must match to the bit); in one chain on 256-bit
 * builds, whose 16 vector registers hold 8 weight vectors and the rows' sums. */
#ifdef HAVE_ZMM
#define SPLIT_M 1
#else
#define SPLIT_M 0
#endif

/* Q4_1, 8 columns (group g) of R rows (R <= ROW_TILE): out[r][8g .. 8g + 7]. The row loops unroll
 * (R is a constant), so each row's sums stay in registers. */
static inline __attribute__((always_inline)) void q4_group8(int F, int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                            const uint8_t *qs, const uint16_t *dm, float *out, int ldo) {
    int blocks = k / QK;
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m256 acc[ROW_TILE], accm[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        int64_t gb = g * blocks + b;
        __m256i w[8]; /* lo[0], hi[0], lo[1], hi[1], ... */
        for (int i = 0; i < 4; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + gb * 128 + 32 * i));
            w[2 * i] = _mm256_and_si256(v, nib);
            w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + gb * 16)));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dm + gb * 16 + 8)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *h = p + (int64_t)r * 2 * k + b * QK;
            const float *x = xs + 2 * ((int64_t)r * blocks + b);
            __m256 dot = _mm256_cvtepi32_ps(dot15(F, w, h, h + k));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[0])), dot, acc[r]);
            if (SPLIT_M)
                accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[1]), accm[r]);
            else
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[1]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (int64_t)r * ldo + g * 8, _mm256_add_ps(acc[r], accm[r]));
}

/* Q8_0's |w| (a) times activation bytes x carrying w's sign: int32 sums per column lane. (Without
 * VNNI only the 8-bit activations come here: the 15-bit ones take q8_wide8.) */
static inline __attribute__((always_inline)) __m256i dot_s8(const __m256i *a, const int8_t *qs, const int8_t *x) {
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 8; i += 2) {
        __m256i v0 = _mm256_sign_epi8(bcast4(x + 4 * i), _mm256_loadu_si256((const __m256i *)(qs + 32 * i)));
        __m256i v1 = _mm256_sign_epi8(bcast4(x + 4 * i + 4), _mm256_loadu_si256((const __m256i *)(qs + 32 * i + 32)));
#ifdef HAVE_VNNI256
        s = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s, a[i], v0), a[i + 1], v1);
#else
        const __m256i ones = _mm256_set1_epi16(1);
        __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a[i], v0), ones);
        s = _mm256_add_epi32(s, _mm256_add_epi32(p0, _mm256_madd_epi16(_mm256_maddubs_epi16(a[i + 1], v1), ones)));
#endif
    }
    return s;
}

/* Q8_0, 8 columns: signed weights as |w| times activations carrying w's sign. */
static inline __attribute__((always_inline)) void q8_group8(int F, int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                            const int8_t *qs, const uint16_t *dd, float *out, int ldo) {
    int blocks = k / QK;
    __m256 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        int64_t gb = g * blocks + b;
        const int8_t *wb = qs + gb * 256;
        __m256i a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(wb + 32 * i)));
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + gb * 8)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *h = p + (int64_t)r * 2 * k + b * QK;
            __m256i sh = dot_s8(a, wb, h);
            __m256 dot = _mm256_cvtepi32_ps(F ? _mm256_add_epi32(_mm256_slli_epi32(sh, 7), dot_s8(a, wb, h + k)) : sh);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[2 * ((int64_t)r * blocks + b)])), dot, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (int64_t)r * ldo + g * 8, acc[r]);
}

/* Q6_K's 8 unpacked u chunks w times one row's 32 activation bytes a: the int32 sums per column of
 * k 0-15 (s[0]: chunks 0, 2, 4, 6) and k 16-31 (s[1]). maddubs pairs are at most 2 * 63 * 128, so
 * two of them add in int16; VNNI's dpbusd gives the same integers. */
static inline __attribute__((always_inline)) void dot_q6(const __m256i *w, const int8_t *a, __m256i *s) {
#ifdef HAVE_VNNI256
    for (int half = 0; half < 2; half++) {
        __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[half], bcast4(a + 4 * ORDER_Q4[half]));
        for (int i = half + 2; i < 8; i += 2) t = _mm256_dpbusd_epi32(t, w[i], bcast4(a + 4 * ORDER_Q4[i]));
        s[half] = t;
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i m[8];
    for (int i = 0; i < 8; i++) m[i] = _mm256_maddubs_epi16(w[i], bcast4(a + 4 * ORDER_Q4[i]));
    for (int half = 0; half < 2; half++)
        s[half] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(m[half], m[half + 2]), ones),
                                   _mm256_madd_epi16(_mm256_add_epi16(m[half + 4], m[half + 6]), ones));
#endif
}

/* Q6_K, 8 columns of R rows: per half block, the integer sum of u a less 32 times the activations'
 * sum (offs: 32 sum(a) per row, block and half), as float, times its scale s; then d dx. */
static inline __attribute__((always_inline)) void q6_group8(int F, int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                            const int32_t *offs, const uint8_t *qs, const uint16_t *dd,
                                                            float *out, int ldo) {
    int blocks = k / QK;
    const __m256i nib = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
    __m256 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *wb = qs + (g * blocks + b) * 208;
        __m256i w[8], hb[2];
        hb[0] = _mm256_loadu_si256((const __m256i *)(wb + 128));
        hb[1] = _mm256_loadu_si256((const __m256i *)(wb + 160));
        for (int i = 0; i < 4; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 32 * i));
            w[2 * i] = _mm256_and_si256(v, nib);
            w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        for (int t = 0; t < 8; t++) { /* bits 2 (t % 4), + 1 of hb[t / 4] to bits 4, 5 */
            __m256i h = hb[t / 4];
            int at = t % 4;
            h = at < 2 ? _mm256_slli_epi16(h, 4 - 2 * at) : at == 2 ? h : _mm256_srli_epi16(h, 2);
            w[t] = _mm256_or_si256(w[t], _mm256_and_si256(h, top));
        }
        __m128i sc = _mm_loadu_si128((const __m128i *)(wb + 192));
        __m256 s0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc));
        __m256 s1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)));
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + (g * (blocks / 8) + b / 8) * 8)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *h = p + (int64_t)r * 2 * k + b * QK;
            const int32_t *o = offs + 2 * ((int64_t)r * blocks + b);
            __m256i sh[2], sl[2];
            dot_q6(w, h, sh);
            if (F) {
                dot_q6(w, h + k, sl);
                for (int half = 0; half < 2; half++) sh[half] = _mm256_add_epi32(_mm256_slli_epi32(sh[half], 7), sl[half]);
            }
            __m256 t0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(sh[0], _mm256_set1_epi32(o[0])));
            __m256 t1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(sh[1], _mm256_set1_epi32(o[1])));
            __m256 dot = _mm256_fmadd_ps(s0, t0, _mm256_mul_ps(s1, t1));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[2 * ((int64_t)r * blocks + b)])), dot, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (int64_t)r * ldo + g * 8, acc[r]);
}

/* 32 times the sum of each row's activations (h, or 128 h + l when fine) over every half block:
 * offs [rows, k / 32, 2], Q6_K's -32 offset. */
static void half_sums(int rows, int k, int fine, const int8_t *p, int32_t *offs) {
    for (int r = 0; r < rows; r++) {
        const int8_t *h = p + (int64_t)r * 2 * k, *l = h + k;
        for (int q = 0; q < k / 16; q++) {
            int32_t sum = 0;
            for (int i = 0; i < 16; i++) sum += fine ? 128 * h[16 * q + i] + l[16 * q + i] : h[16 * q + i];
            offs[(int64_t)r * (k / 16) + q] = 32 * sum;
        }
    }
}

/* Without VNNI, Q8_0 times 15-bit activations as int16 products (madd: 16 a call, summed in
 * pairs to int32) instead of two byte passes (h, then l: sign, maddubs and madd each); the same
 * integer sums, so the same bits. One 32-byte chunk of 4 k for 8 columns widens to two int16
 * vectors (columns 0-3, 4-7); hadd of their sums gives the lanes in the order `perm` (columns
 * 0 1 4 5 2 3 6 7), which the scales take on the way in and the sums undo on the way out. */
#if !defined(HAVE_VNNI256)
#define WIDE_Q8 1
static inline __attribute__((always_inline)) void q8_wide8(int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                           const int8_t *qs, const uint16_t *dd, float *out, int ldo) {
    int blocks = k / QK;
    const __m256i perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    const int16_t *a16 = (const int16_t *)p;
    __m256 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        int64_t gb = g * blocks + b;
        const int8_t *wb = qs + gb * 256;
        __m256i lo[ROW_TILE], hi[ROW_TILE];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 32 * i));
            __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                int64_t a4;
                memcpy(&a4, a16 + (int64_t)r * k + b * QK + 4 * i, 8);
                __m256i a = _mm256_set1_epi64x(a4);
                lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(w0, a));
                hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(w1, a));
            }
        }
        __m256 d = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + gb * 8))), perm);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256 dot = _mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[r], hi[r]));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[2 * ((int64_t)r * blocks + b)])), dot, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (int64_t)r * ldo + g * 8, _mm256_permutevar8x32_ps(acc[r], perm));
}
#else
#define WIDE_Q8 0
#endif

/* ---- 512-bit: two adjacent groups (16 columns) a vector, half the instructions ---- */
#ifdef HAVE_ZMM
static inline __m512i load_pair(const void *a, const void *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* The 4 activation bytes at a in every int32 lane, broadcast from memory (a load alone): a set1 of an
 * int32 copied out of the row, which GCC merged with its neighbour into one 8-byte load, went through
 * a general register, two vector uops a broadcast, as many as the dpbusd it fed. */
static inline __m512i bcast16(const int8_t *a) {
    return _mm512_broadcastd_epi32(_mm_loadu_si32(a));
}

static inline __m512 scales_pair(const uint16_t *a, const uint16_t *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)), 1);
}

static inline __attribute__((always_inline)) void q4_group16(int F, int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                             const uint8_t *qs, const uint16_t *dm, float *out, int ldo) {
    int blocks = k / QK;
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512 acc[ROW_TILE], accm[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        int64_t gb0 = g * blocks + b, gb1 = (g + 1) * blocks + b;
        __m512i w[8];
        for (int i = 0; i < 4; i++) {
            __m512i v = load_pair(qs + gb0 * 128 + 32 * i, qs + gb1 * 128 + 32 * i);
            w[2 * i] = _mm512_and_si512(v, nib);
            w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        }
        __m512 d = scales_pair(dm + gb0 * 16, dm + gb1 * 16), m = scales_pair(dm + gb0 * 16 + 8, dm + gb1 * 16 + 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *hh = p + (int64_t)r * 2 * k + b * QK, *ll = hh + k;
            __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512(), sh2 = sh, sl2 = sl;
            for (int i = 0; i < 8; i += 2) { /* two chains per sum (dpbusd latency) */
                sh = _mm512_dpbusd_epi32(sh, w[i], bcast16(hh + 4 * ORDER_Q4[i]));
                sh2 = _mm512_dpbusd_epi32(sh2, w[i + 1], bcast16(hh + 4 * ORDER_Q4[i + 1]));
                if (!F) continue;
                sl = _mm512_dpbusd_epi32(sl, w[i], bcast16(ll + 4 * ORDER_Q4[i]));
                sl2 = _mm512_dpbusd_epi32(sl2, w[i + 1], bcast16(ll + 4 * ORDER_Q4[i + 1]));
            }
            sh = _mm512_add_epi32(sh, sh2);
            sl = _mm512_add_epi32(sl, sl2);
            const float *x = xs + 2 * ((int64_t)r * blocks + b);
            __m512 dot = _mm512_cvtepi32_ps(F ? _mm512_add_epi32(_mm512_slli_epi32(sh, 7), sl) : sh);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[0])), dot, acc[r]);
            accm[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[1]), accm[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (int64_t)r * ldo + g * 8, _mm512_add_ps(acc[r], accm[r]));
}

/* Q8_0, 16 columns: dpbusd takes the activations unsigned, offset by 128 (a byte's sign bit
 * flipped), against the signed weights; the offset's share, 128 times each column's block sum
 * (one dpbusd of ones a chunk, shared by the rows), is subtracted in int32. The integer sums, and
 * so the bits, are those of the signed product. */
static inline __attribute__((always_inline)) void q8_group16(int F, int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                             const int8_t *qs, const uint16_t *dd, float *out, int ldo) {
    int blocks = k / QK;
    const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        int64_t gb0 = g * blocks + b, gb1 = (g + 1) * blocks + b;
        __m512i w[8], sum = _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) {
            w[i] = load_pair(qs + gb0 * 256 + 32 * i, qs + gb1 * 256 + 32 * i);
            sum = _mm512_dpbusd_epi32(sum, ones, w[i]);
        }
        /* the offset's share: 128 sum for h alone; with l, 128 (128 sum) + 128 sum = 16512 sum */
        __m512i offset = _mm512_mullo_epi32(sum, _mm512_set1_epi32(F ? 16512 : 128));
        __m512 d = scales_pair(dd + gb0 * 8, dd + gb1 * 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *hh = p + (int64_t)r * 2 * k + b * QK, *ll = hh + k;
            __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) {
                if (!F) { /* ll: hh flipped (quantize_rows) */
                    sh = _mm512_dpbusd_epi32(sh, bcast16(ll + 4 * i), w[i]);
                    continue;
                }
                sh = _mm512_dpbusd_epi32(sh, _mm512_xor_si512(bcast16(hh + 4 * i), flip), w[i]);
                sl = _mm512_dpbusd_epi32(sl, _mm512_xor_si512(bcast16(ll + 4 * i), flip), w[i]);
            }
            __m512i total = F ? _mm512_add_epi32(_mm512_slli_epi32(sh, 7), sl) : sh;
            __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(total, offset));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xs[2 * ((int64_t)r * blocks + b)])), dot, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (int64_t)r * ldo + g * 8, acc[r]);
}

/* Q6_K's dot_q6 for two groups (16 columns) a vector: the same integer sums. */
static inline __attribute__((always_inline)) void dot_q6_16(const __m512i *w, const int8_t *a, __m512i *s) {
    for (int half = 0; half < 2; half++) {
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[half], bcast16(a + 4 * ORDER_Q4[half]));
        for (int i = half + 2; i < 8; i += 2) t = _mm512_dpbusd_epi32(t, w[i], bcast16(a + 4 * ORDER_Q4[i]));
        s[half] = t;
    }
}

/* Q6_K, 16 columns (groups g, g + 1) of R rows: q6_group8's steps lane for lane, so its bits. */
static inline __attribute__((always_inline)) void q6_group16(int F, int R, int64_t g, int k, const int8_t *p, const float *xs,
                                                             const int32_t *offs, const uint8_t *qs, const uint16_t *dd,
                                                             float *out, int ldo) {
    int blocks = k / QK;
    const __m512i nib = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    __m512 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *w0 = qs + (g * blocks + b) * 208, *w1 = qs + ((g + 1) * blocks + b) * 208;
        __m512i w[8], hb[2];
        hb[0] = load_pair(w0 + 128, w1 + 128);
        hb[1] = load_pair(w0 + 160, w1 + 160);
        for (int i = 0; i < 4; i++) {
            __m512i v = load_pair(w0 + 32 * i, w1 + 32 * i);
            w[2 * i] = _mm512_and_si512(v, nib);
            w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        }
        for (int t = 0; t < 8; t++) { /* bits 2 (t % 4), + 1 of hb[t / 4] to bits 4, 5 */
            __m512i h = hb[t / 4];
            int at = t % 4;
            h = at < 2 ? _mm512_slli_epi16(h, 4 - 2 * at) : at == 2 ? h : _mm512_srli_epi16(h, 2);
            w[t] = _mm512_or_si512(w[t], _mm512_and_si512(h, top));
        }
        __m128i sc0 = _mm_loadu_si128((const __m128i *)(w0 + 192)), sc1 = _mm_loadu_si128((const __m128i *)(w1 + 192));
        __m512 s0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(sc0, sc1)));
        __m512 s1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(sc0, sc1)));
        __m512 d = scales_pair(dd + (g * (blocks / 8) + b / 8) * 8, dd + ((g + 1) * (blocks / 8) + b / 8) * 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *h = p + (int64_t)r * 2 * k + b * QK;
            const int32_t *o = offs + 2 * ((int64_t)r * blocks + b);
            __m512i sh[2], sl[2];
            dot_q6_16(w, h, sh);
            if (F) {
                dot_q6_16(w, h + k, sl);
                for (int half = 0; half < 2; half++) sh[half] = _mm512_add_epi32(_mm512_slli_epi32(sh[half], 7), sl[half]);
            }
            __m512 t0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(sh[0], _mm512_set1_epi32(o[0])));
            __m512 t1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(sh[1], _mm512_set1_epi32(o[1])));
            __m512 dot = _mm512_fmadd_ps(s0, t0, _mm512_mul_ps(s1, t1));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xs[2 * ((int64_t)r * blocks + b)])), dot, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (int64_t)r * ldo + g * 8, acc[r]);
}
#endif

/* ---- drivers ---- */

/* column groups [g0, g1) (g0 even) of R rows */
static inline __attribute__((always_inline)) void q4_rows(int F, int R, int64_t g0, int64_t g1, int k, const int8_t *p,
                                                          const float *xs, const uint8_t *qs, const uint16_t *dm, float *out,
                                                          int ldo) {
    int64_t g = g0;
#ifdef HAVE_ZMM
    /* 512-bit only from 3 rows: at 1-2 rows the two interleaved streams of a group pair read cold
     * weights slower (whole decode steps, bf16: 12.9-14.9 vs 9.2-9.5 ms at one row, 17-21 vs
     * 19-24 ms at 4; benchmarks/quant_kernels.py with QUANTA_NATIVE_MARCH=haswell for 256-bit) */
    if (R >= 3)
        for (; g + 1 < g1; g += 2) q4_group16(F, R, g, k, p, xs, qs, dm, out, ldo);
#endif
    for (; g < g1; g++) q4_group8(F, R, g, k, p, xs, qs, dm, out, ldo);
}

/* column groups [g0, g1) (g0 even) of R rows */
static inline __attribute__((always_inline)) void q8_rows(int F, int R, int64_t g0, int64_t g1, int k, const int8_t *p,
                                                          const float *xs, const int8_t *qs, const uint16_t *dd, float *out,
                                                          int ldo) {
    int64_t g = g0;
#ifdef HAVE_ZMM
    /* 512-bit only from 3 rows: at 1-2 rows the two interleaved streams of a group pair read cold
     * weights slower (whole decode steps, bf16: 12.9-14.9 vs 9.2-9.5 ms at one row, 17-21 vs
     * 19-24 ms at 4; benchmarks/quant_kernels.py with QUANTA_NATIVE_MARCH=haswell for 256-bit) */
    if (R >= 3)
        for (; g + 1 < g1; g += 2) q8_group16(F, R, g, k, p, xs, qs, dd, out, ldo);
#endif
#if WIDE_Q8
    if (F) {
        for (; g < g1; g++) q8_wide8(R, g, k, p, xs, qs, dd, out, ldo);
        return;
    }
#endif
    for (; g < g1; g++) q8_group8(F, R, g, k, p, xs, qs, dd, out, ldo);
}

/* column groups [g0, g1) (g0 even) of R rows */
static inline __attribute__((always_inline)) void q6_rows(int F, int R, int64_t g0, int64_t g1, int k, const int8_t *p,
                                                          const float *xs, const int32_t *offs, const uint8_t *qs,
                                                          const uint16_t *dd, float *out, int ldo) {
    int64_t g = g0;
#ifdef HAVE_ZMM
    if (R >= 3) /* as q4_rows */
        for (; g + 1 < g1; g += 2) q6_group16(F, R, g, k, p, xs, offs, qs, dd, out, ldo);
#endif
    for (; g < g1; g++) q6_group8(F, R, g, k, p, xs, offs, qs, dd, out, ldo);
}

/* quantize_rows for a kind's tiles: Q8_0's 15-bit activations as int16 where no VNNI (q8_wide8), its
 * 8-bit ones also flipped to unsigned where the 512-bit tile (q8_group16) reads them. */
static void quantize_for(int kind, int fine, int rows, int k, const void *x, int io_bf16, int8_t *p, float *xs) {
#ifdef HAVE_ZMM
    int flip = kind == 8 && !fine;
#else
    int flip = 0;
#endif
    quantize_rows(rows, k, x, io_bf16, fine, kind == 8 && fine && WIDE_Q8, flip, p, xs);
}

/* Rows of float sums a thread's share of acc holds: one row tile's. */
#define ACC_ROWS(rows) ((rows) < ROW_TILE ? (rows) : ROW_TILE)

/* Floats of block_matmul's acc for bf16 output of rows x n: each pool thread's ACC_ROWS rows. */
int64_t block_sums_scratch(int rows, int n) {
    return (int64_t)POOL_MAX_THREADS * ACC_ROWS(rows) * n;
}

struct matmul_job {
    int kind, fine, rows, n, k, io_bf16;
    const int8_t *p;
    const float *xs;
    const int32_t *offs; /* Q6_K: half_sums */
    const void *qs;
    const uint16_t *scales;
    void *out;
    float *acc;
};

/* The job's column groups of share `part`: every row, ROW_TILE at a time, each weight block unpacked once for them. */
static void matmul_part(void *arg, int part, int parts, int thread) {
    const struct matmul_job *j = arg;
    int n = j->n, k = j->k, blocks = k / QK;
    int64_t g0, g1;
    pool_share(n / 8, 2, part, parts, &g0, &g1); /* pairs of groups: the 512-bit tiles take two */
    if (g0 >= g1) return;
    const void *qs = j->qs;
    const uint16_t *scales = j->scales;
    /* bf16 output: a row tile's float sums in this thread's own ROW_TILE rows of acc, converted
     * while in cache (not a [rows, n] float buffer: fresh pages at every prompt call); float32
     * output takes the sums directly */
    float *tile_sums = j->io_bf16 ? j->acc + (int64_t)thread * ACC_ROWS(j->rows) * n : NULL;
    for (int r0 = 0; r0 < j->rows; r0 += ROW_TILE) {
        int R = j->rows - r0 < ROW_TILE ? j->rows - r0 : ROW_TILE;
        const int8_t *pr = j->p + (int64_t)r0 * 2 * k;
        const float *xr = j->xs + (int64_t)r0 * blocks * 2;
        const int32_t *offs = j->offs ? j->offs + (int64_t)r0 * blocks * 2 : NULL;
        float *o = tile_sums ? tile_sums : (float *)j->out + (int64_t)r0 * n;
#define ROWS_CASE(kind, F, R, rows) \
    case kind * 100 + F * 10 + R: rows(F, R, g0, g1, k, pr, xr, qs, scales, o, n); break;
#define ROWS_CASES(kind, F, rows) \
    ROWS_CASE(kind, F, 1, rows) ROWS_CASE(kind, F, 2, rows) ROWS_CASE(kind, F, 3, rows) ROWS_CASE(kind, F, 4, rows) \
    ROWS_CASE(kind, F, 5, rows) ROWS_CASE(kind, F, 6, rows) ROWS_CASE(kind, F, 7, rows) ROWS_CASE(kind, F, 8, rows)
        switch (j->kind * 100 + (j->fine ? 10 : 0) + R) { /* constants, so the tile loops unroll */
            ROWS_CASES(4, 0, q4_rows)
            ROWS_CASES(4, 1, q4_rows)
            ROWS_CASES(8, 0, q8_rows)
            ROWS_CASES(8, 1, q8_rows)
#undef ROWS_CASE
#define ROWS_CASE(kind, F, R, rows) \
    case kind * 100 + F * 10 + R: rows(F, R, g0, g1, k, pr, xr, offs, qs, scales, o, n); break;
            ROWS_CASES(6, 0, q6_rows)
            ROWS_CASES(6, 1, q6_rows)
        }
        if (tile_sums)
            for (int r = 0; r < R; r++)
                store_row(j->out, 1, (int64_t)(r0 + r) * n + g0 * 8, (g1 - g0) * 8, tile_sums + (int64_t)r * n + g0 * 8);
    }
}

/* Q6_K's half-block offsets for `rows` quantized rows (NULL for the other kinds); free() it. */
static int32_t *q6_offsets(int kind, int rows, int k, int fine, const int8_t *p) {
    if (kind != 6) return NULL;
    int32_t *offs = malloc(sizeof(int32_t) * ((size_t)rows * (k / 16) + 1));
    if (offs) half_sums(rows, k, fine, p, offs);
    return offs;
}

/* A [n, k] weight of `kind` as block_matmul reads it (layouts below): its codes' bytes, and its fp16
 * scales counted in halves (Q6_K: 8 per 8 blocks of 32). */
static int64_t form_qs_bytes(int kind, int n, int k) {
    return (int64_t)(n / 8) * (k / QK) * (kind == 4 ? 128 : kind == 6 ? 208 : 256);
}

static int64_t form_scale_halves(int kind, int n, int k) {
    return (int64_t)(n / 8) * (k / QK) * (kind == 4 ? 16 : kind == 6 ? 1 : 8);
}

/* out [rows, n] = x [rows, k] @ w.T (n a multiple of 8, k of 32), x and out in the io dtype
 * (bf16 when io_bf16, else float32), for Q4_1 (kind 4: qs uint8 [n / 8, k / 32, 128], scales
 * fp16 [n / 8, k / 32, 2, 8]), Q8_0 (kind 8: qs int8 [n / 8, k / 32, 256], scales fp16
 * [n / 8, k / 32, 8]) or Q6_K (kind 6, k a multiple of 256: qs uint8 [n / 8, k / 32, 208],
 * scales fp16 [n / 8, k / 256, 8]) weights. Scratch: p int8 [rows, 2, k]; xs float32 [rows, k / 32, 2];
 * acc float32 [block_sums_scratch(rows, n)] (unused for float32 output, which takes the sums directly). fine: 15-bit activations, else 8-bit. The output columns are split
 * into chunks for the pool's threads (pool.c). Returns 0, or -1 where memory ran out. */
int block_matmul(int kind, int fine, int rows, int n, int k, const void *x, int io_bf16, const void *qs,
                 const uint16_t *scales, void *out, int8_t *p, float *xs, float *acc) {
    quantize_for(kind, fine, rows, k, x, io_bf16, p, xs);
    int32_t *offs = q6_offsets(kind, rows, k, fine, p);
    if (kind == 6 && !offs) return -1;
    struct matmul_job job = {kind, fine, rows, n, k, io_bf16, p, xs, offs, qs, scales, out, acc};
    int64_t bytes = form_qs_bytes(kind, n, k) + 2 * form_scale_halves(kind, n, k);
    pool_run(matmul_part, &job, pool_chunks_sized((n / 8 + 1) / 2, bytes)); /* pool_share above: pairs of groups */
    free(offs);
    return 0;
}

/* Routed experts: groups of consecutive rows of x, group g times expert experts[g]'s [n, k] weight,
 * every expert's weight one after another in qs / scales as block_matmul lays out one (an MoE
 * layer's experts in one form). The rows are quantized once, then each group runs as block_matmul
 * would run it alone (the same tiles, so the same bits row for row), with no call from Python per
 * expert. out [sum(rows), n]; scratch as block_matmul's for sum(rows) rows. Returns as block_matmul. */
int block_matmul_experts(int kind, int fine, int groups, const int32_t *rows, const int32_t *experts, int n, int k,
                         const void *x, int io_bf16, const void *qs, const uint16_t *scales, void *out, int8_t *p,
                         float *xs, float *acc) {
    int total = 0;
    for (int g = 0; g < groups; g++) total += rows[g];
    quantize_for(kind, fine, total, k, x, io_bf16, p, xs);
    int32_t *offs = q6_offsets(kind, total, k, fine, p);
    if (kind == 6 && !offs) return -1;
    int64_t qs_bytes = form_qs_bytes(kind, n, k), scale_halves = form_scale_halves(kind, n, k);
    int64_t r0 = 0;
    for (int g = 0; g < groups; g++) {
        struct matmul_job job = {kind, fine, rows[g], n, k, io_bf16, p + r0 * 2 * k, xs + r0 * (k / QK) * 2,
                                 offs ? offs + r0 * (k / 16) : NULL, (const char *)qs + experts[g] * qs_bytes,
                                 scales + experts[g] * scale_halves, (char *)out + r0 * n * (io_bf16 ? 2 : 4),
                                 acc};
        pool_run(matmul_part, &job, pool_chunks((n / 8 + 1) / 2));
        r0 += rows[g];
    }
    free(offs);
    return 0;
}
