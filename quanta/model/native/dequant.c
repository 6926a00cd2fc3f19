/* Q4_1 / Q8_0 weights (qmatmul.c's interleaved layout) back to a plain [n, k] matrix.
 *
 * Where the server keeps no reference copy of a weight (--prompt-weights form), each prompt
 * chunk's matmul rebuilds the layer's weight from its form into a scratch matrix and hands it to
 * oneDNN: one pass over n * k values, small beside the chunk's matmul (rows * n * k). Values are
 * d * q + m (Q4_1) or d * q (Q8_0) in float32, stored as float32 or rounded to bf16.
 */
#include <stdint.h>
#include <immintrin.h>

#include "bf16.h"
#include "pool.h"

#define QK 32

struct dense_job {
    int kind, n, k, out_bf16;
    const uint8_t *qs;
    const uint16_t *scales;
    void *out;
};

/* v's lanes 0-3 to dst[at0 ..] and lanes 4-7 to dst[at1 ..], as float32 or rounded to bf16
 * (nearest even; weights are finite). */
static inline void store_halves(void *dst, int bf16, int64_t at0, int64_t at1, __m256 v) {
    if (!bf16) {
        _mm_storeu_ps((float *)dst + at0, _mm256_castps256_ps128(v));
        _mm_storeu_ps((float *)dst + at1, _mm256_extractf128_ps(v, 1));
        return;
    }
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storel_epi64((__m128i *)((uint16_t *)dst + at0), h);
    _mm_storel_epi64((__m128i *)((uint16_t *)dst + at1), _mm_unpackhi_epi64(h, h));
}

/* One 32-byte row of a block: 4 values (at pos .. pos + 3 of the block) of each of the 8
 * columns, q unsigned (Q4_1 nibbles) or signed (Q8_0); d and m hold columns 2p, 2p + 1. */
static inline void block_row(const struct dense_job *j, __m256i q, int q4, const __m256 *d, const __m256 *m,
                             int64_t at, int pos) {
    for (int p = 0; p < 4; p++) {
        __m128i bytes = _mm_loadl_epi64((const __m128i *)((const int8_t *)&q + 8 * p));
        __m256i qi = q4 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
        __m256 v = _mm256_add_ps(_mm256_mul_ps(d[p], _mm256_cvtepi32_ps(qi)), m[p]);
        store_halves(j->out, j->out_bf16, at + 2 * p * (int64_t)j->k + pos, at + (2 * p + 1) * (int64_t)j->k + pos, v);
    }
}

static void dense_part(void *arg, int part, int parts, int thread) {
    (void)thread;
    const struct dense_job *j = arg;
    int blocks = j->k / QK, q4 = j->kind == 4;
    int64_t g0, g1;
    pool_share(j->n / 8, 1, part, parts, &g0, &g1);
    for (int64_t g = g0; g < g1; g++)
        for (int b = 0; b < blocks; b++) {
            const uint8_t *qs = j->qs + (g * blocks + b) * (q4 ? 128 : 256);
            const uint16_t *sc = j->scales + (g * blocks + b) * (q4 ? 16 : 8);
            __m256 d[4], m[4];
            for (int p = 0; p < 4; p++) {
                d[p] = _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(sc[2 * p + 1])), _mm_set1_ps(_cvtsh_ss(sc[2 * p])));
                m[p] = q4 ? _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(sc[9 + 2 * p])), _mm_set1_ps(_cvtsh_ss(sc[8 + 2 * p])))
                          : _mm256_setzero_ps();
            }
            int64_t at = 8 * g * (int64_t)j->k + (int64_t)b * QK;
            for (int i = 0; i < (q4 ? 4 : 8); i++) {
                __m256i row = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
                if (!q4) {
                    block_row(j, row, 0, d, m, at, 4 * i);
                    continue;
                }
                __m256i low = _mm256_and_si256(row, _mm256_set1_epi8(15));
                __m256i high = _mm256_and_si256(_mm256_srli_epi16(row, 4), _mm256_set1_epi8(15));
                block_row(j, low, 1, d, m, at, 4 * i);
                block_row(j, high, 1, d, m, at, 16 + 4 * i);
            }
        }
}

/* out [n, k] (bf16 when out_bf16, else float32) = the weight of a Q4_1 (kind 4) or Q8_0 (kind 8)
 * form in qmatmul.c's layout; the rows are split into chunks for the pool's threads. */
void block_dense(int kind, int n, int k, const void *qs, const uint16_t *scales, void *out, int out_bf16) {
    struct dense_job job = {kind, n, k, out_bf16, qs, scales, out};
    pool_run(dense_part, &job, pool_chunks(n / 8));
}
