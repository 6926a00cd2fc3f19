/* bf16 <-> float32 and row copies between the io dtype and float32, shared by decode.c and qmatmul.c.
 * bf16 values are converted with round-to-nearest-even, as torch does. */
#ifndef QUANTA_BF16_H
#define QUANTA_BF16_H
#include <immintrin.h>
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
/* KV cache elements: float32, bf16 or IEEE fp16 (kind 0, 1, 2). fp16 through F16C (every AVX2 CPU has it),
 * round to nearest even. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

/* dst[0..n) = src[offset ..] as float32, src of cache kind `kind`. */
static inline void load_kv(const void *src, int kind, int64_t offset, int64_t n, float *dst) {
    if (kind != KV_F16) {
        load_row(src, kind == KV_BF16, offset, n, dst);
        return;
    }
    const uint16_t *s = (const uint16_t *)src + offset;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++) dst[i] = _cvtsh_ss(s[i]);
}

/* dst[offset ..] = src[0..n) in cache kind `kind`. */
static inline void store_kv(void *dst, int kind, int64_t offset, int64_t n, const float *src) {
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
#endif
