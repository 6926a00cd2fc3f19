/* bf16 <-> float32 and row copies between the io dtype and float32, shared by decode.c and qmatmul.c.
 * bf16 values are converted with round-to-nearest-even, as torch does. Also the KV cache's element
 * kinds and the horizontal sum of one 8-float vector (hsum256, decode.c and f16matmul.c). */
#ifndef QUANTA_BF16_H
#define QUANTA_BF16_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* dst[0..n) = src[offset ..] as float32 (src bf16 when bf16, else float32). */
static inline void load_row(const void *src, int bf16, int64_t offset, int64_t n, float *dst) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
    }
}

/* dst[offset ..] = src[0..n) in dst's dtype (bf16 when bf16, else float32). */
static inline void store_row(void *dst, int bf16, int64_t offset, int64_t n, const float *src) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst + offset;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)dst + offset, src, (size_t)n * sizeof(float));
    }
}
/* KV cache elements: float32, bf16, IEEE fp16 (kind 0, 1, 2), or q8_0 (kind 3): a position's row of dim
 * values is dim / 32 groups of 34 bytes, an fp16 scale d then 32 int8 q, value = d * q (llama.cpp's
 * block_q8_0). fp16 through F16C (every AVX2 CPU has it), round to nearest even. Offsets count the
 * cache's storage units: elements, or bytes for q8_0 (kv_row). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_Q8 = 3 };
#define Q8_GROUP 32
#define Q8_BYTES 34

/* Storage units of one position's row of dim values in cache kind `kind`. */
static inline int64_t kv_row(int kind, int dim) { return kind == KV_Q8 ? (int64_t)dim / Q8_GROUP * Q8_BYTES : dim; }

static inline void load_f16(const uint16_t *s, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++) dst[i] = _cvtsh_ss(s[i]);
}

/* A q8_0 row (n a multiple of 32) as float32: d * q, exact (an int8 times an fp16 value fits float32). */
static inline void load_q8(const uint8_t *s, int64_t n, float *dst) {
    for (int64_t g = 0; g < n; g += Q8_GROUP, s += Q8_BYTES) {
        uint16_t h;
        memcpy(&h, s, 2);
        __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
        for (int i = 0; i < Q8_GROUP; i += 8) {
            __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + 2 + i)));
            _mm256_storeu_ps(dst + g + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
        }
    }
}

/* A row (n a multiple of 32) as q8_0: per group d = fp16(amax / 127), q = round_half_even(x / d) clamped
 * to [-127, 127], 0 where d is 0. Division by intrinsics (never turned into a reciprocal by -ffast-math),
 * so the bytes equal quanta.model.attention.quantize_q8's. */
static inline void store_q8(uint8_t *d8, int64_t n, const float *src) {
    for (int64_t g = 0; g < n; g += Q8_GROUP, d8 += Q8_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < Q8_GROUP; i++) amax = fabsf(src[g + i]) > amax ? fabsf(src[g + i]) : amax;
        uint16_t h = _cvtss_sh(_mm_cvtss_f32(_mm_div_ss(_mm_set_ss(amax), _mm_set_ss(127.0f))), _MM_FROUND_TO_NEAREST_INT);
        memcpy(d8, &h, 2);
        __m256 d = _mm256_set1_ps(_cvtsh_ss(h)), lim = _mm256_set1_ps(127.0f);
        int zero = _cvtsh_ss(h) == 0.0f;
        for (int i = 0; i < Q8_GROUP; i += 8) {
            __m256 x = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src + g + i), d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            x = _mm256_max_ps(_mm256_min_ps(x, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
            int32_t q[8];
            _mm256_storeu_si256((__m256i *)q, _mm256_cvtps_epi32(x));
            for (int k = 0; k < 8; k++) d8[2 + i + k] = zero ? 0 : (uint8_t)(int8_t)q[k];
        }
    }
}

/* dst[0..n) = the row at src[offset ..] as float32, src of cache kind `kind`. */
static inline void load_kv(const void *src, int kind, int64_t offset, int64_t n, float *dst) {
    if (kind == KV_F16)
        load_f16((const uint16_t *)src + offset, n, dst);
    else if (kind == KV_Q8)
        load_q8((const uint8_t *)src + offset, n, dst);
    else
        load_row(src, kind == KV_BF16, offset, n, dst);
}

/* The row at dst[offset ..] = src[0..n) in cache kind `kind`. */
static inline void store_kv(void *dst, int kind, int64_t offset, int64_t n, const float *src) {
    if (kind == KV_Q8) {
        store_q8((uint8_t *)dst + offset, n, src);
        return;
    }
    if (kind != KV_F16) {
        store_row(dst, kind == KV_BF16, offset, n, src);
        return;
    }
    uint16_t *d = (uint16_t *)dst + offset;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

/* v's lanes added in one fixed tree: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)). */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif
