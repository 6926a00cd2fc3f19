/* GGUF tensors, block by block, straight into qmatmul.c's forms (no float copy of the tensor).
 *
 * A GGUF tensor [n, k] stores row r at src + r * row_bytes as ggml's blocks along k: 32 values
 * (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or 256 (Q4_K, Q5_K, Q6_K: eight sub-blocks of 32, or sixteen
 * of 16 for Q6_K, under one fp16 super-scale). Each source block becomes one or eight "units"
 * (32 quants with an fp16 d and m) that are written into the interleaved layout of qmatmul.c:
 *   to Q4_1 (w = d * q + m, q in [0, 15]):
 *     Q4_0  exact: q = the nibble, m = -8 d (a power-of-two multiple: exact in fp16).
 *     Q4_1  exact: the block itself.
 *     Q4_K  d' = fp16(d * sc), m' = fp16(-dmin * m) per sub-block: d * sc needs up to 17
 *           significant bits, so rounding it to fp16's 11 moves a weight by at most
 *           15 e(d * sc) + e(dmin * m), e(x) = max(|x| 2^-11, 2^-25) (half an fp16 ulp, or of
 *           the subnormal spacing): the first term under 0.75% of the sub-block's step d * sc
 *           (1/68 of the half step Q4_K's own rounding allows), the second 2^-11 of its min.
 *   to Q8_0 (w = d * q, q in [-127, 127]; a file's Q8_0 -128, which ggml's quantizer does not
 *   write, is kept: qmatmul.c's kernels take it):
 *     Q8_0, Q4_0 (q - 8), Q5_0 (q - 16) exact: the block's own d and integers.
 *     Q4_1, Q5_1, Q4_K, Q5_K, Q6_K requantized per block of 32 from the float32 values ggml's
 *           dequantize gives: d8 = fp16(max|w| / 127), q = round(w / d8) in [-127, 127], so
 *           |w - d8 q| <= d8 / 2 (d8 is moved up one fp16 step where subnormal rounding took it
 *           below max|w| / 127.5, so no value is clamped further than that).
 *   to Q6_K's form (qmatmul.c's kind 6), from Q6_K only, exact: each value's 6-bit u, scale and d
 *     moved into the interleaved layout.
 *   to fp16 [n, k] plain rows: F16 copied, BF16 rounded to nearest even (F16C).
 * rows (or NULL): output row i is source row rows[i]. Work goes by groups of 8 output rows
 * split over the pool (pool.c); a group's bytes depend only on its source rows.
 *
 * Block formats: ggml-common.h's block_q* structs (fp16 scales little-endian).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "pool.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "repack.c needs AVX2, FMA and F16C"
#endif

#define QK 32
#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

enum { T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };
enum { TO_Q4_1 = 4, TO_Q6_K = 6, TO_Q8_0 = 8, TO_F16 = 16 };

/* 32 quants of one output block: Q4_1 packs them as 16 bytes (q[t] | q[t + 16] << 4, GGUF's own
 * nibble order), Q8_0 as 32 signed bytes; d (and m for Q4_1) are fp16 bits. */
struct unit {
    uint16_t d, m;
    uint8_t q[QK];
};

static inline uint16_t half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}
static inline float float_at(const uint8_t *p) { return _cvtsh_ss(half_at(p)); }
static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Sub-block j's 6-bit scale and min from Q4_K / Q5_K's 12 bytes: j < 4 in the low 6 bits of
 * bytes j and j + 4; j >= 4 four bits in byte j + 4 (low: scale, high: min) and two in the top
 * bits of bytes j - 4 (scale) and j (min). */
static inline void k_scale(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* 32 bytes q (signed when sign, else unsigned) as float32: w = d0 q + m for the first 16, d1 q + m
 * for the last 16. */
static inline void put_values(__m256i q, int sign, float d0, float d1, float m, float *w) {
    for (int i = 0; i < 4; i++) {
        __m128i part = i < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
        part = i & 1 ? _mm_srli_si128(part, 8) : part;
        __m256 v = _mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part));
        _mm256_storeu_ps(w + 8 * i, _mm256_fmadd_ps(_mm256_set1_ps(i < 2 ? d0 : d1), v, _mm256_set1_ps(m)));
    }
}

/* 16 bytes of nibbles as 32 bytes: the low nibbles (values 0..15), then the high ones (16..31). */
static inline __m256i nibbles(const uint8_t *qs) {
    __m128i v = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

/* Bit t of qh as 16 in byte t: Q5_0 / Q5_1's fifth bits (bit t of value t). */
static inline __m256i fifth_bits(uint32_t qh) {
    const __m256i byte_of = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), byte_of), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

/* ---- exact units: Q4_1 targets ---- */

static void q4_0_to_q4_1(const uint8_t *b, struct unit *u) { /* d (2), qs (16) */
    u->d = half_at(b);
    u->m = _cvtss_sh(-8.0f * _cvtsh_ss(u->d), RNE);
    memcpy(u->q, b + 2, 16);
}

static void q4_1_to_q4_1(const uint8_t *b, struct unit *u) { /* d, m, qs (16) */
    u->d = half_at(b);
    u->m = half_at(b + 2);
    memcpy(u->q, b + 4, 16);
}

/* d, dmin, scales (12), qs (128): sub-blocks 2p and 2p + 1 are the low and high nibbles of qs[32p ..].
 * The eight d * sc and dmin * m are exact in float32 (17 bits at most), rounded to fp16 together. */
static void q4_k_to_q4_1(const uint8_t *b, struct unit *u) {
    int sc[8], mn[8];
    for (int j = 0; j < 8; j++) k_scale(b + 4, j, &sc[j], &mn[j]);
    __m256 d = _mm256_set1_ps(float_at(b)), dmin = _mm256_set1_ps(float_at(b + 2));
    __m256 dj = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)sc)));
    __m256 mj = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)mn))));
    uint16_t dh[8], mh[8];
    _mm_storeu_si128((__m128i *)dh, _mm256_cvtps_ph(dj, RNE));
    _mm_storeu_si128((__m128i *)mh, _mm256_cvtps_ph(mj, RNE));
    const __m128i low = _mm_set1_epi8(15), high = _mm_set1_epi8((char)0xf0);
    for (int p = 0; p < 4; p++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(b + 16 + 32 * p)), c = _mm_loadu_si128((const __m128i *)(b + 32 + 32 * p));
        __m128i even = _mm_or_si128(_mm_and_si128(a, low), _mm_and_si128(_mm_slli_epi16(c, 4), high));
        __m128i odd = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low), _mm_and_si128(c, high));
        _mm_storeu_si128((__m128i *)u[2 * p].q, even);
        _mm_storeu_si128((__m128i *)u[2 * p + 1].q, odd);
        u[2 * p].d = dh[2 * p], u[2 * p].m = mh[2 * p];
        u[2 * p + 1].d = dh[2 * p + 1], u[2 * p + 1].m = mh[2 * p + 1];
    }
}

/* ---- exact units: Q8_0 targets ---- */

static void q8_0_to_q8_0(const uint8_t *b, struct unit *u) { /* d, qs (32 int8) */
    u->d = half_at(b);
    memcpy(u->q, b + 2, QK);
}

static void q4_0_to_q8_0(const uint8_t *b, struct unit *u) { /* d, qs (16) */
    u->d = half_at(b);
    _mm256_storeu_si256((__m256i *)u->q, _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8)));
}

static void q5_0_to_q8_0(const uint8_t *b, struct unit *u) { /* d, qh (4), qs (16) */
    u->d = half_at(b);
    __m256i q = _mm256_or_si256(nibbles(b + 6), fifth_bits(u32_at(b + 2)));
    _mm256_storeu_si256((__m256i *)u->q, _mm256_sub_epi8(q, _mm256_set1_epi8(16)));
}

/* ---- float values (requantized to Q8_0), as ggml's dequantize_row_* computes them ---- */

static void q4_1_values(const uint8_t *b, float *w) { /* d, m, qs (16) */
    put_values(nibbles(b + 4), 0, float_at(b), float_at(b), float_at(b + 2), w);
}

static void q5_1_values(const uint8_t *b, float *w) { /* d, m, qh (4), qs (16) */
    put_values(_mm256_or_si256(nibbles(b + 8), fifth_bits(u32_at(b + 4))), 0, float_at(b), float_at(b), float_at(b + 2), w);
}

/* Q4_K (hb NULL) or Q5_K: d, dmin, scales (12), [qh (32): bit j of byte l is sub-block j's
 * fifth bit of value l], qs (128); w = d sc q - dmin m. */
static void k_values(const uint8_t *b, const uint8_t *hb, const uint8_t *qs, float *w) {
    float d = float_at(b), dmin = float_at(b + 2);
    const __m256i low = _mm256_set1_epi8(15), five = _mm256_set1_epi8(16);
    __m256i qh = hb ? _mm256_loadu_si256((const __m256i *)hb) : _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale(b + 4, j, &sc, &mn);
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
        q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, low);
        if (hb) { /* bit j of each byte to bit 4 */
            __m256i h = j < 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
            q = _mm256_or_si256(q, _mm256_and_si256(h, five));
        }
        put_values(q, 0, d * (float)sc, d * (float)sc, -(dmin * (float)mn), w + QK * j);
    }
}
static void q4_k_values(const uint8_t *b, float *w) { k_values(b, NULL, b + 16, w); }
static void q5_k_values(const uint8_t *b, float *w) { k_values(b, b + 16, b + 48, w); }

/* ql (128), qh (64), scales (16 int8, one per 16 values), d. Value v = 128 h + 32 s + l: its 6-bit
 * code u is the low nibble (s < 2) or high nibble (s >= 2) of ql[64 h + 32 (s & 1) + l] with bits
 * 2s, 2s + 1 of qh[32 h + l] on top; the value is d * scales[v / 16] * (u - 32). */
static inline void q6_k_codes(const uint8_t *b, uint8_t *u) {
    const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        for (int s = 0; s < 4; s++) {
            __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (s & 1)));
            __m256i q = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4), low);
            __m256i hi = s < 3 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - 2 * s)) : _mm256_srli_epi16(qh, 2);
            _mm256_storeu_si256((__m256i *)(u + 128 * h + 32 * s), _mm256_or_si256(q, _mm256_and_si256(hi, top)));
        }
    }
}

static void q6_k_values(const uint8_t *b, float *w) {
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = float_at(b + 208);
    uint8_t u[256];
    q6_k_codes(b, u);
    for (int v0 = 0; v0 < 256; v0 += 32) {
        __m256i q = _mm256_sub_epi8(_mm256_loadu_si256((const __m256i *)(u + v0)), _mm256_set1_epi8(32));
        put_values(q, 1, d * (float)sc[v0 / 16], d * (float)sc[v0 / 16 + 1], 0.0f, w + v0);
    }
}

/* ---- requantization to Q8_0 ---- */

/* max |w| of 32 float values. */
static inline float block_amax(const float *w) {
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(w + 8 * i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* 32 float values times inv, rounded (nearest even) and clamped to [-127, 127], as int8. */
static inline void block_q8(const float *w, float inv, uint8_t *q) {
    __m256 s = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i v[4];
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(w + 8 * i), s), RNE);
        v[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    /* the packs work within 128-bit lanes: their dwords come out as w[0..3], w[8..11], w[16..19],
     * w[24..27], w[4..7], ...; the permute puts them back in w's order */
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* nb (<= 8) blocks of 32 float values -> Q8_0, the blocks' scales computed together:
 * d8 = fp16(max|w| / 127), moved up one fp16 step where subnormal rounding left it below
 * max|w| / 127.5 (so no value is clamped by more than d8 / 2); q = round(w / d8). */
static void requantize(const float *w, int nb, struct unit *u) {
    float amax[8] = {0}, inv[8];
    for (int b = 0; b < nb; b++) amax[b] = block_amax(w + QK * b);
    __m256 a = _mm256_loadu_ps(amax);
    __m128i h = _mm256_cvtps_ph(_mm256_div_ps(a, _mm256_set1_ps(127.0f)), RNE);
    __m256i low = _mm256_castps_si256(_mm256_cmp_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(127.5f)), a, _CMP_LT_OQ));
    h = _mm_sub_epi16(h, _mm_packs_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1))); /* -1 where low */
    __m256 d = _mm256_cvtph_ps(h), live = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ);
    _mm256_storeu_ps(inv, _mm256_and_ps(live, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_max_ps(d, _mm256_set1_ps(1e-30f)))));
    uint16_t dh[8];
    _mm_storeu_si128((__m128i *)dh, h);
    for (int b = 0; b < nb; b++) {
        u[b].d = dh[b];
        block_q8(w + QK * b, inv[b], u[b].q);
    }
}

typedef void (*unit_fn)(const uint8_t *block, struct unit *u);
typedef void (*values_fn)(const uint8_t *block, float *w);

struct source {
    int type, values, bytes;
    unit_fn to_q4_1, to_q8_0; /* exact conversions (NULL: none) */
    values_fn values_of;      /* float values, requantized for Q8_0 where to_q8_0 is NULL */
};

static const struct source SOURCES[] = {
    {T_Q4_0, 32, 18, q4_0_to_q4_1, q4_0_to_q8_0, NULL},
    {T_Q4_1, 32, 20, q4_1_to_q4_1, NULL, q4_1_values},
    {T_Q5_0, 32, 22, NULL, q5_0_to_q8_0, NULL},
    {T_Q5_1, 32, 24, NULL, NULL, q5_1_values},
    {T_Q8_0, 32, 34, NULL, q8_0_to_q8_0, NULL},
    {T_Q4_K, 256, 144, q4_k_to_q4_1, NULL, q4_k_values},
    {T_Q5_K, 256, 176, NULL, NULL, q5_k_values},
    {T_Q6_K, 256, 210, NULL, NULL, q6_k_values},
};

struct repack_job {
    const struct source *s;
    int to, bf16;
    int64_t n, k, row_bytes;
    const uint8_t *src;
    const int32_t *rows;
    uint8_t *data;
    uint16_t *scales;
};

static inline const uint8_t *source_row(const struct repack_job *j, int64_t r) {
    return j->src + (j->rows ? (int64_t)j->rows[r] : r) * j->row_bytes;
}

/* Unit u as column c of output block b of group g: 4 bytes per 32-byte row of the block
 * (qmatmul.c's qs[g][b][i][c][j]), d (and m) at [g][b][c] (and [g][b][1][c]). */
static inline void store_unit(const struct repack_job *j, int64_t g, int64_t b, int c, const struct unit *u) {
    int64_t at = g * (j->k / QK) + b;
    if (j->to == TO_Q4_1) {
        uint8_t *qs = j->data + at * 128 + 4 * c;
        for (int i = 0; i < 4; i++) memcpy(qs + 32 * i, u->q + 4 * i, 4);
        j->scales[at * 16 + c] = u->d;
        j->scales[at * 16 + 8 + c] = u->m;
    } else {
        uint8_t *qs = j->data + at * 256 + 4 * c;
        for (int i = 0; i < 8; i++) memcpy(qs + 32 * i, u->q + 4 * i, 4);
        j->scales[at * 8 + c] = u->d;
    }
}

/* Output row 8 g + c of a Q4_1 / Q8_0 form, 256 values (8 output blocks) at a time. */
static void form_row(const struct repack_job *j, int64_t g, int c) {
    const struct source *s = j->s;
    const uint8_t *row = source_row(j, 8 * g + c);
    unit_fn exact = j->to == TO_Q4_1 ? s->to_q4_1 : s->to_q8_0;
    int per = s->values / QK;
    int64_t blocks = j->k / s->values, step = 8 / per;
    struct unit u[8];
    float w[256];
    for (int64_t sb = 0; sb < blocks; sb += step) {
        int batch = blocks - sb < step ? (int)(blocks - sb) : (int)step;
        for (int i = 0; i < batch; i++) {
            if (exact) exact(row + (sb + i) * s->bytes, u + i * per);
            else s->values_of(row + (sb + i) * s->bytes, w + i * s->values);
        }
        if (!exact) requantize(w, batch * per, u);
        for (int p = 0; p < batch * per; p++) store_unit(j, g, sb * per + p, c, u + p);
    }
}

/* Output row 8 g + c of a Q6_K form (qmatmul.c's layout), one Q6_K block (8 output blocks) at a time. */
static void q6_form_row(const struct repack_job *j, int64_t g, int c) {
    const uint8_t *row = source_row(j, 8 * g + c);
    int64_t supers = j->k / 256;
    uint8_t u[256];
    for (int64_t sb = 0; sb < supers; sb++) {
        const uint8_t *b = row + sb * 210;
        q6_k_codes(b, u);
        j->scales[(g * supers + sb) * 8 + c] = half_at(b + 208);
        for (int bb = 0; bb < 8; bb++) {
            uint8_t *out = j->data + (g * (j->k / QK) + sb * 8 + bb) * 208;
            const uint8_t *q = u + 32 * bb;
            for (int i = 0; i < 4; i++) /* the low 4 bits as Q4_1's nibbles: k 4i + t low, 16 + 4i + t high */
                for (int t = 0; t < 4; t++) out[32 * i + 4 * c + t] = (uint8_t)((q[4 * i + t] & 15) | (q[16 + 4 * i + t] & 15) << 4);
            for (int half = 0; half < 2; half++) /* unpacked chunks 4 half + 0..3: k 8 half + t, 16 + .., 4 + .., 20 + .. */
                for (int t = 0; t < 4; t++) {
                    const uint8_t *at = q + 8 * half + t;
                    out[128 + 32 * half + 4 * c + t] = (uint8_t)(at[0] >> 4 | (at[16] >> 4) << 2 | (at[4] >> 4) << 4 | (at[20] >> 4) << 6);
                }
            out[192 + c] = b[192 + 2 * bb];
            out[200 + c] = b[192 + 2 * bb + 1];
        }
    }
}

static void form_part(void *arg, int part, int parts, int thread) {
    (void)thread;
    const struct repack_job *j = arg;
    int64_t g0, g1;
    pool_share(j->n / 8, 1, part, parts, &g0, &g1);
    for (int64_t g = g0; g < g1; g++)
        for (int c = 0; c < 8; c++) {
            if (j->to == TO_Q6_K) q6_form_row(j, g, c);
            else form_row(j, g, c);
        }
}

/* fp16 row from an F16 (copied) or BF16 (widened to float32, rounded to fp16) row. */
static void f16_row(const uint8_t *src, int bf16, int64_t k, uint16_t *out) {
    if (!bf16) {
        memcpy(out, src, (size_t)k * 2);
        return;
    }
    const uint16_t *b = (const uint16_t *)src;
    int64_t t = 0;
    for (; t + 8 <= k; t += 8) {
        __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + t))), 16);
        _mm_storeu_si128((__m128i *)(out + t), _mm256_cvtps_ph(_mm256_castsi256_ps(wide), RNE));
    }
    for (; t < k; t++) out[t] = _cvtss_sh(bf16_to_f32(b[t]), RNE);
}

static void f16_part(void *arg, int part, int parts, int thread) {
    (void)thread;
    const struct repack_job *j = arg;
    int64_t r0, r1;
    pool_share(j->n, 8, part, parts, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) f16_row(source_row(j, r), j->bf16, j->k, (uint16_t *)j->data + r * j->k);
}

/* The [n, k] GGUF tensor at src (ggml type src_type) in form dst_kind: 4 (Q4_1: data [n / 8,
 * k / 32, 128], scales fp16 [n / 8, k / 32, 2, 8]), 8 (Q8_0: [n / 8, k / 32, 256] and [n / 8,
 * k / 32, 8]), 6 (Q6_K from Q6_K: [n / 8, k / 32, 208] and [n / 8, k / 256, 8]) or 16 (fp16
 * [n, k] in data; scales unused). rows: NULL, or the source row of each
 * output row. Returns 0, or -1 for a pair with no conversion here (the caller checks shapes:
 * n % 8 and k % 32 for the block forms, k a multiple of the source's block). */
int gguf_repack(int src_type, int dst_kind, int64_t n, int64_t k, const uint8_t *src, const int32_t *rows, void *data,
                uint16_t *scales) {
    struct repack_job job = {NULL, dst_kind, src_type == T_BF16, n, k, 0, src, rows, data, scales};
    if (dst_kind == TO_F16) {
        if (src_type != T_F16 && src_type != T_BF16) return -1;
        job.row_bytes = 2 * k;
        pool_run(f16_part, &job, pool_chunks((n + 7) / 8));
        return 0;
    }
    for (size_t i = 0; i < sizeof SOURCES / sizeof SOURCES[0]; i++)
        if (SOURCES[i].type == src_type) job.s = &SOURCES[i];
    if (dst_kind == TO_Q6_K) {
        if (src_type != T_Q6_K || k % 256) return -1;
        job.row_bytes = k / 256 * 210;
        pool_run(form_part, &job, pool_chunks(n / 8));
        return 0;
    }
    if (!job.s || (dst_kind != TO_Q4_1 && dst_kind != TO_Q8_0)) return -1;
    if (dst_kind == TO_Q4_1 ? !job.s->to_q4_1 : !job.s->to_q8_0 && !job.s->values_of) return -1;
    job.row_bytes = k / job.s->values * job.s->bytes;
    pool_run(form_part, &job, pool_chunks(n / 8));
    return 0;
}
