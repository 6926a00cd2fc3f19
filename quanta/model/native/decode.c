/* Decode-step glue of a Llama-family layer, in C: everything between the
 * matmuls (which stay library kernels called from Python).
 *
 * A decode step has one new token per sequence; in eager PyTorch each layer
 * is ~40 small ops (norms, RoPE, cache writes, batched attention, SwiGLU),
 * each costing a dispatch of several microseconds for a handful of rows.
 * These three functions do that work in three calls per layer, reading and
 * writing raw buffers, and keep the residual stream in float32.
 *
 * Buffers: `io` tensors (matmul inputs and outputs) are bf16 when io_bf16,
 * else float32; the KV cache's elements are float32, bf16, fp16 or q8_0 (cache_kind: KV_F32, KV_BF16,
 * KV_F16, KV_Q8), a pool of blocks laid out [num_blocks, kv_heads, block_size, row] (row: kv_row units a
 * position): a row's position p of KV head g lives in block tables[row_table[r]][p / block_size] at offset
 * p % block_size (struct kv_pages); conversions in bf16.h. Consecutive rows of a sequence share each tile
 * of cache positions (attend_block): a float32 tile is read in place, any other converted once for them.
 *
 * Built with -O3 -march=native -ffast-math (finite values only) by quanta/model/native/__init__.py, so the
 * loops vectorize for the CPU it runs on (AVX2 or AVX-512); attention's dot products are AVX2 + FMA
 * intrinsics (8 positions' scores at once, head_dim a multiple of 8).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "pool.h"

/* x[r] += add[r] (when add is not NULL); out[r] = rmsnorm(x[r]) * weight.
 * x: float32 [rows, dim], updated in place; add, out: io dtype [rows, dim];
 * scratch: float32 [dim]. */
void residual_rms_norm(int rows, int dim, float *x, const void *add, const float *weight, float eps,
                       void *out, int io_bf16, float *scratch) {
    for (int r = 0; r < rows; r++) {
        float *xr = x + (int64_t)r * dim;
        if (add) {
            load_row(add, io_bf16, (int64_t)r * dim, dim, scratch);
            for (int i = 0; i < dim; i++) xr[i] += scratch[i];
        }
        float ss = 0.0f;
        for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) scratch[i] = xr[i] * inv * weight[i];
        store_row(out, io_bf16, (int64_t)r * dim, dim, scratch);
    }
}

/* Rotate-half RoPE of `heads` heads of `dim` in place, by one position's cos_t / sin_t [dim / 2]. */
static void rope(float *x, int heads, int dim, const float *cos_t, const float *sin_t) {
    int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + h * dim;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos_t[i] - b * sin_t[i];
            v[i + half] = b * cos_t[i] + a * sin_t[i];
        }
    }
}

/* Cache positions a tile of attend_block reads at once; tiles start at multiples of it, so with
 * the default --block-size (32) a tile is one block of the pool. */
#define ATT_TILE 32

/* Lane u: the sum of s[u]'s 8 lanes (3 levels of hadd instead of a horizontal sum per vector). */
static inline __m256 hsum8(const __m256 *s) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31));
}

/* Where one row's cache positions are: its block table, the pool's block size, a position's row
 * (kv_row units), a block's units and KV head g's offset within a block (g * block_size * row). */
struct kv_pages {
    const int32_t *table;
    int64_t block_size, row, block_elems, head;
};

static inline struct kv_pages kv_pages(const int32_t *table, int64_t block_size, int kind, int kv_heads, int dim, int g) {
    int64_t row = kv_row(kind, dim);
    return (struct kv_pages){table, block_size, row, kv_heads * block_size * row, g * block_size * row};
}

/* Offset of position `pos` in the pool, in storage units. */
static inline int64_t page_offset(const struct kv_pages *pg, int64_t pos) {
    int64_t block = pg->table[pos / pg->block_size];
    return block * pg->block_elems + pg->head + (pos % pg->block_size) * pg->row;
}

/* The scores of query rows q (nq rows of dim) for the 8 keys keys[0..7] (rows of dim) into
 * out[nq]: one FMA chain per query and key over dim, then hsum8; the keys are loaded once for
 * the nq queries (nq <= SCORE_HEADS). Every score of attention comes from this or score1, so a
 * score's bits do not depend on how many queries shared the keys. */
#if defined(__AVX512VL__)
#define SCORE_HEADS 3 /* 24 accumulators: AVX-512 has 32 vector registers */
#else
#define SCORE_HEADS 1 /* AVX2 has 16 */
#endif
static inline __attribute__((always_inline)) void score8(const float *q, int nq, int dim, const float *const *keys,
                                                         __m256 *out) {
    __m256 s[SCORE_HEADS][8];
    for (int h = 0; h < nq; h++)
        for (int e = 0; e < 8; e++) s[h][e] = _mm256_setzero_ps();
    for (int c = 0; c < dim; c += 8) {
        __m256 qc[SCORE_HEADS];
        for (int h = 0; h < nq; h++) qc[h] = _mm256_loadu_ps(q + h * dim + c);
        for (int e = 0; e < 8; e++) {
            __m256 k = _mm256_loadu_ps(keys[e] + c);
            for (int h = 0; h < nq; h++) s[h][e] = _mm256_fmadd_ps(qc[h], k, s[h][e]);
        }
    }
    for (int h = 0; h < nq; h++) out[h] = hsum8(s[h]);
}

static inline __attribute__((always_inline)) float score1(const float *q, int dim, const float *key) {
    __m256 s = _mm256_setzero_ps();
    for (int c = 0; c < dim; c += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(key + c), s);
    return hsum256(s);
}

/* score8 for query rows q_0 .. q_{group - 1}, SCORE_HEADS at a time: out[j] at scores + j * ld. */
static inline __attribute__((always_inline)) void group_score8(const float *q, int group, int dim,
                                                               const float *const *keys, float *scores, int64_t ld) {
    __m256 out[SCORE_HEADS];
    int j = 0;
    for (; j + SCORE_HEADS <= group; j += SCORE_HEADS) {
        score8(q + j * dim, SCORE_HEADS, dim, keys, out);
        for (int h = 0; h < SCORE_HEADS; h++) _mm256_storeu_ps(scores + (j + h) * ld, out[h]);
    }
    for (; j < group; j++) {
        score8(q + j * dim, 1, dim, keys, out);
        _mm256_storeu_ps(scores + j * ld, out[0]);
    }
}

/* Heads tile_values sums together, and the 8-float vectors of each head's output it holds in
 * registers: 3 x 8 accumulators of AVX-512's 32 registers, 3 x 4 of AVX2's 16. */
#define VALUE_HEADS 3
#if defined(__AVX512VL__)
#define VALUE_VECS 8
#else
#define VALUE_VECS 4
#endif

/* out_h[0..dim) += sum_{u < n} p[h][u] vals[u] for nh heads (nh <= VALUE_HEADS; p row stride `ld`;
 * out_h = out + h (dim + 2)), 8 * VALUE_VECS output elements at a time in registers: each value
 * vector is loaded once for the nh heads, and every element is summed position by position in
 * order, so its bits do not depend on nh. */
static inline __attribute__((always_inline)) void heads_values(const float *p, int64_t ld, int nh, int dim,
                                                               const float *const *vals, int64_t n, float *out) {
    for (int c0 = 0; c0 < dim; c0 += 8 * VALUE_VECS) {
        int nv = dim - c0 >= 8 * VALUE_VECS ? VALUE_VECS : (dim - c0) / 8;
        __m256 acc[VALUE_HEADS][VALUE_VECS];
        for (int h = 0; h < nh; h++)
            for (int v = 0; v < nv; v++) acc[h][v] = _mm256_loadu_ps(out + h * (dim + 2) + c0 + 8 * v);
        for (int64_t u = 0; u < n; u++) {
            __m256 pu[VALUE_HEADS];
            for (int h = 0; h < nh; h++) pu[h] = _mm256_set1_ps(p[h * ld + u]);
            for (int v = 0; v < nv; v++) {
                __m256 x = _mm256_loadu_ps(vals[u] + c0 + 8 * v);
                for (int h = 0; h < nh; h++) acc[h][v] = _mm256_fmadd_ps(pu[h], x, acc[h][v]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int v = 0; v < nv; v++) _mm256_storeu_ps(out + h * (dim + 2) + c0 + 8 * v, acc[h][v]);
    }
}

/* out_j[0..dim) += sum_{u < n} p[j][u] vals[u] for each of the group's heads (p row stride `ld`;
 * vals: n rows of dim; out_j = out + j (dim + 2)), VALUE_HEADS heads at a time (heads_values). */
static inline __attribute__((always_inline)) void tile_values(const float *p, int64_t ld, int group, int dim,
                                                              const float *const *vals, int64_t n, float *out) {
    int j = 0;
    for (; j + VALUE_HEADS <= group; j += VALUE_HEADS)
        heads_values(p + j * ld, ld, VALUE_HEADS, dim, vals, n, out + j * (dim + 2));
    for (; j < group; j++) heads_values(p + j * ld, ld, 1, dim, vals, n, out + j * (dim + 2));
}

/* Each of the group's score rows (scores [group, len]) -> e^(s - top) in place; out[j] (float32
 * [dim + 2]) = (0, top, sum). */
static inline __attribute__((always_inline)) void softmax_part(float *scores, int group, int64_t len, int dim, float *out) {
    for (int j = 0; j < group; j++) {
        float *sj = scores + j * len, top = -3.402823466e38f, total = 0.0f; /* finite: built with -ffast-math */
        for (int64_t t = 0; t < len; t++) top = sj[t] > top ? sj[t] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) {
            sj[t] = expf(sj[t] - top);
            total += sj[t];
        }
        float *oj = out + j * (dim + 2);
        memset(oj, 0, (size_t)dim * sizeof(float));
        oj[dim] = top;
        oj[dim + 1] = total;
    }
}

/* Prompt rows of one sequence attended together (attend_block): each tile of a float32 cache is
 * read once for up to this many rows. */
#define ATT_BLOCK 16

/* Attention splits every row's cache positions into ATT_PARTS parts, whatever the threads:
 * each part's (sum, top, total) is merged in part order, so a row's output depends on its
 * query, its position and the cache alone, never on the rows beside it or on how many threads
 * ran (one thread runs both parts). */
#define ATT_PARTS 2

/* The most positions one part of a row holds when no row attends past max_len positions. */
static inline int64_t part_len(int64_t max_len) { return (max_len + ATT_PARTS - 1) / ATT_PARTS; }

/* float32 scratch of one part of attention_part: a tile of converted cache rows (and the 8 before
 * it), then the scores of up to ATT_BLOCK rows, every head, part_len(max_len) each. */
static inline int64_t part_scratch(int dim, int heads, int64_t max_len) {
    return (int64_t)(ATT_TILE + 8) * dim + (int64_t)ATT_BLOCK * heads * part_len(max_len);
}

struct attention_job {
    int rows, heads, kv_heads, dim, cache_kind;
    const float *q; /* [rows, heads * dim], rotated and scaled */
    const int64_t *row_table, *positions; /* per row: its block table's index in tables, its position */
    const int32_t *tables;                /* [sequences, table_width] block ids */
    int64_t table_width, block_size;
    const void *k_cache, *v_cache;
    int64_t max_len;
    float *work;     /* per thread: [part_scratch] */
    float *partials; /* [ATT_PARTS, rows, heads, dim + 2] */
};

/* Where row r's KV head g writes its share `part`: partials [ATT_PARTS, rows, heads, dim + 2]. */
static inline float *partial_out(const struct attention_job *j, int part, int r, int g) {
    return j->partials + (((int64_t)part * j->rows + r) * j->heads + g * (j->heads / j->kv_heads)) * (j->dim + 2);
}

/* The scores of one row (q: [group, dim]; the key of position u at keys[u - base]; s: [group,
 * t1 - t0]) that the tile [a, b) (within [t0, t1)) completes, computed the same whatever tiles and
 * rows share the keys: its groups of 8 from t0 that end in (a, b] (one may start up to 7 before a),
 * then its positions from the last full group on one by one. */
static inline __attribute__((always_inline)) void span_scores(const float *q, int group, int dim, const float *const *keys,
                                                              int64_t base, int64_t t0, int64_t t1, int64_t a, int64_t b,
                                                              float *s) {
    int64_t len = t1 - t0, full = t0 + len / 8 * 8, first = t0 + (a - t0) / 8 * 8;
    first = first + 8 <= a ? first + 8 : first; /* the first group that ends after a */
    for (int64_t u = first; u + 8 <= b && u < full; u += 8) group_score8(q, group, dim, keys + (u - base), s + u - t0, len);
    for (int64_t u = a > full ? a : full; u < b; u++)
        for (int jj = 0; jj < group; jj++) s[jj * len + u - t0] = score1(q + jj * dim, dim, keys[u - base]);
}

/* Rows r0 .. r0 + R - 1 (one sequence, consecutive positions; R <= ATT_BLOCK), share `part`,
 * every KV head: each row's arithmetic is that of the row alone (its keys in groups of 8 from its
 * share's start, the same softmax, values summed position by position in order), so the same bits
 * whatever R is (a decode row is R = 1); but each ATT_TILE of keys, then of values, is read once
 * for the R rows while it is in cache: a float32 cache in place, any other kind converted into
 * the tile. The KV heads take turns within a tile, so the tile's blocks are read whole (a block
 * holds every head's rows), not once per head a third at a time.
 * work: part_scratch (the converted tile, then the rows' scores). */
static inline __attribute__((always_inline)) void attend_block(const struct attention_job *j, int r0, int R, int part,
                                                               int dim, float *work) {
    int group = j->heads / j->kv_heads;
    int64_t t0[ATT_BLOCK], t1[ATT_BLOCK], lo = INT64_MAX, hi = 0, span = part_len(j->max_len), stride = j->heads * span;
    int misaligned = 0; /* a row's groups of 8 (from t0) may cross tiles */
    for (int i = 0; i < R; i++) {
        pool_share(j->positions[r0 + i] + 1, 1, part, ATT_PARTS, &t0[i], &t1[i]);
        lo = t0[i] < lo ? t0[i] : lo;
        hi = t1[i] > hi ? t1[i] : hi;
        misaligned |= t0[i] % 8 != 0;
    }
    const int32_t *table = j->tables + j->row_table[r0] * j->table_width;
    const float *rows[ATT_TILE + 8];
    float *tile = work, *scores = work + (ATT_TILE + 8) * dim; /* row i, KV head g: scores + i stride + g group span */
    for (int pass = 0; pass < 2; pass++) { /* keys, then values */
        const void *cache = pass ? j->v_cache : j->k_cache;
        for (int64_t t = lo, next; t < hi; t = next) { /* the tile [t, next) */
            next = (t / ATT_TILE + 1) * ATT_TILE < hi ? (t / ATT_TILE + 1) * ATT_TILE : hi;
            /* the keys pass also reads the 8 positions before the tile for a group crossing into it */
            int64_t back = misaligned && pass == 0 ? (t - lo < 8 ? t - lo : 8) : 0, n = next - t + back;
            for (int g = 0; g < j->kv_heads; g++) {
                struct kv_pages pg = kv_pages(table, j->block_size, j->cache_kind, j->kv_heads, dim, g);
                for (int64_t u = 0; u < n;) { /* a block's positions are consecutive rows: one lookup a block */
                    int64_t at = page_offset(&pg, t - back + u), run = pg.block_size - (t - back + u) % pg.block_size;
                    for (int64_t end = u + (run < n - u ? run : n - u); u < end; u++, at += pg.row) {
                        if (j->cache_kind == KV_F32) {
                            rows[u] = (const float *)cache + at;
                        } else {
                            load_kv(cache, j->cache_kind, at, dim, tile + u * dim);
                            rows[u] = tile + u * dim;
                        }
                    }
                }
                for (int i = 0; i < R; i++) {
                    int64_t a = t > t0[i] ? t : t0[i], b = next < t1[i] ? next : t1[i];
                    const float *q = j->q + ((int64_t)(r0 + i) * j->heads + g * group) * dim;
                    float *s_ig = scores + i * stride + g * group * span;
                    if (a >= b) continue;
                    if (pass == 0)
                        span_scores(q, group, dim, rows, t - back, t0[i], t1[i], a, b, s_ig);
                    else
                        tile_values(s_ig + (a - t0[i]), t1[i] - t0[i], group, dim, rows + (a - t + back), b - a,
                                    partial_out(j, part, r0 + i, g));
                }
            }
        }
        for (int i = 0; pass == 0 && i < R; i++)
            for (int g = 0; g < j->kv_heads; g++)
                softmax_part(scores + i * stride + g * group * span, group, t1[i] - t0[i], dim,
                             partial_out(j, part, r0 + i, g));
    }
}

/* How many rows from r attend together: the following rows of r's sequence at the following
 * positions (up to ATT_BLOCK). */
static int block_rows(const struct attention_job *j, int r) {
    int n = 1;
    while (n < ATT_BLOCK && r + n < j->rows && j->row_table[r + n] == j->row_table[r] &&
           j->positions[r + n] == j->positions[r] + n)
        n++;
    return n;
}

/* Part `part` of every row, rows by blocks (attend_block), in thread `thread`'s scratch. */
static void attention_part(void *arg, int part, int parts, int thread) {
    (void)parts; /* ATT_PARTS */
    const struct attention_job *j = arg;
    float *work = j->work + (int64_t)thread * part_scratch(j->dim, j->heads, j->max_len);
    for (int r = 0, n; r < j->rows; r += n) {
        n = block_rows(j, r);
        if (j->dim == 64) /* the common head sizes as constants, so the row loops unroll */
            attend_block(j, r, n, part, 64, work);
        else if (j->dim == 128)
            attend_block(j, r, n, part, 128, work);
        else
            attend_block(j, r, n, part, j->dim, work);
    }
}

/* Float32 scratch attention_decode and attention_rows need (elements). */
int64_t attention_scratch(int rows, int heads, int kv_heads, int dim, int64_t max_len) {
    int width = (heads + 2 * kv_heads) * dim;
    return (int64_t)rows * heads * dim + width + POOL_MAX_THREADS * part_scratch(dim, heads, max_len) +
           (int64_t)ATT_PARTS * rows * heads * (dim + 2);
}

/* Attend rows whose queries qs (float32 [rows, heads * dim], rotated and scaled) are in place
 * and whose keys/values are in the cache, over positions 0..positions[r]; out: io [rows, heads * dim].
 * acc: float32 [dim]; work: [POOL_MAX_THREADS * part_scratch]; partials: [ATT_PARTS, rows, heads, dim + 2]. */
static void attend_rows(int rows, const float *qs, int heads, int kv_heads, int dim, const int64_t *row_table,
                        const int64_t *positions, const int32_t *tables, int64_t table_width, int64_t block_size,
                        const void *k_cache, const void *v_cache, int cache_kind, int64_t max_len, void *out,
                        int io_bf16, float *acc, float *work, float *partials) {
    struct attention_job job = {rows, heads, kv_heads, dim, cache_kind, qs, row_table, positions, tables, table_width,
                                block_size, k_cache, v_cache, max_len, work, partials};
    pool_run(attention_part, &job, ATT_PARTS);
    for (int64_t rh = 0; rh < (int64_t)rows * heads; rh++) {
        float top = -3.402823466e38f, total = 0.0f;
        for (int p = 0; p < ATT_PARTS; p++) {
            const float *o = partials + ((int64_t)p * rows * heads + rh) * (dim + 2);
            top = o[dim + 1] > 0.0f && o[dim] > top ? o[dim] : top;
        }
        memset(acc, 0, (size_t)dim * sizeof(float));
        for (int p = 0; p < ATT_PARTS; p++) {
            const float *o = partials + ((int64_t)p * rows * heads + rh) * (dim + 2);
            float w = o[dim + 1] > 0.0f ? expf(o[dim] - top) : 0.0f;
            total += w * o[dim + 1];
            for (int i = 0; i < dim; i++) acc[i] += w * o[i];
        }
        float inv = 1.0f / total;
        for (int i = 0; i < dim; i++) acc[i] *= inv;
        store_row(out, io_bf16, rh * dim, dim, acc);
    }
}

/* x[h] = rmsnorm(x[h]) * weight for each of `heads` heads of `dim` (Qwen3's per-head q/k norms). */
static void head_rms_norm(float *x, int heads, int dim, const float *weight, float eps) {
    for (int h = 0; h < heads; h++) {
        float *v = x + (int64_t)h * dim, ss = 0.0f;
        for (int i = 0; i < dim; i++) ss += v[i] * v[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) v[i] = v[i] * inv * weight[i];
    }
}

/* One decode token per row: each q and k head RMS-normed by q_norm / k_norm (float32 [dim]; NULL:
 * none), RoPE on q and k, write k and v into the cache at position positions[r]
 * of block table row_table[r] (tables: int32 [sequences, table_width]), then attend over positions
 * 0..positions[r] (attend_rows); max_len: the longest row's positions.
 * qkv: io [rows, (heads + 2 kv_heads) * dim] (q, then k, then v);
 * cos_table / sin_table: float32 [> every positions[r], dim], row p for position p (the model's
 * RotaryEmbedding tables, scaling and attention factor in them); out: io [rows, heads * dim];
 * scratch: float32 [attention_scratch(rows, heads, kv_heads, dim, max_len)]. */
void attention_decode(int rows, const void *qkv, int io_bf16, int heads, int kv_heads, int dim,
                      const float *q_norm, const float *k_norm, float eps, const float *cos_table, const float *sin_table, const int64_t *row_table, const int64_t *positions,
                      const int32_t *tables, int64_t table_width, int64_t block_size, void *k_cache,
                      void *v_cache, int cache_kind, int64_t max_len, void *out, float *scratch) {
    int width = (heads + 2 * kv_heads) * dim;
    float *qs = scratch, *row = qs + (int64_t)rows * heads * dim;
    float *work = row + width, *partials = work + POOL_MAX_THREADS * part_scratch(dim, heads, max_len);
    float scale = 1.0f / sqrtf((float)dim);
    for (int r = 0; r < rows; r++) {
        int64_t pos = positions[r];
        load_row(qkv, io_bf16, (int64_t)r * width, width, row);
        if (q_norm) {
            head_rms_norm(row, heads, dim, q_norm, eps);
            head_rms_norm(row + (int64_t)heads * dim, kv_heads, dim, k_norm, eps);
        }
        rope(row, heads + kv_heads, dim, cos_table + pos * dim, sin_table + pos * dim);
        float *q = row, *k = row + heads * dim, *v = k + kv_heads * dim;
        for (int g = 0; g < kv_heads; g++) {
            struct kv_pages pg = kv_pages(tables + row_table[r] * table_width, block_size, cache_kind, kv_heads, dim, g);
            int64_t at = page_offset(&pg, pos);
            store_kv(k_cache, cache_kind, at, dim, k + g * dim);
            store_kv(v_cache, cache_kind, at, dim, v + g * dim);
        }
        float *qr = qs + (int64_t)r * heads * dim;
        for (int i = 0; i < heads * dim; i++) qr[i] = q[i] * scale;
    }
    attend_rows(rows, qs, heads, kv_heads, dim, row_table, positions, tables, table_width, block_size, k_cache,
                v_cache, cache_kind, max_len, out, io_bf16, row, work, partials);
}

/* Prompt rows: attend rows whose rotated queries q (io [rows, heads * dim]) and keys/values
 * (already in the cache) are given, over positions 0..positions[r]: the attention of
 * attention_decode, row for row, so a prompt position's output does not depend on the chunk
 * that holds it. scratch: float32 [attention_scratch(rows, heads, kv_heads, dim, max_len)]. */
void attention_rows(int rows, const void *q, int io_bf16, int heads, int kv_heads, int dim, const int64_t *row_table,
                    const int64_t *positions, const int32_t *tables, int64_t table_width, int64_t block_size,
                    const void *k_cache, const void *v_cache, int cache_kind, int64_t max_len, void *out,
                    float *scratch) {
    int width = (heads + 2 * kv_heads) * dim;
    float *qs = scratch, *acc = qs + (int64_t)rows * heads * dim;
    float *work = acc + width, *partials = work + POOL_MAX_THREADS * part_scratch(dim, heads, max_len);
    float scale = 1.0f / sqrtf((float)dim);
    load_row(q, io_bf16, 0, (int64_t)rows * heads * dim, qs);
    for (int64_t i = 0; i < (int64_t)rows * heads * dim; i++) qs[i] *= scale;
    attend_rows(rows, qs, heads, kv_heads, dim, row_table, positions, tables, table_width, block_size, k_cache,
                v_cache, cache_kind, max_len, out, io_bf16, acc, work, partials);
}

/* rows rows of dim float32 values (src) into cache kind `kind` at dst, contiguous: the rows a decode
 * step stores, for prompt rows written from Python. */
void kv_store_rows(int64_t rows, int dim, const float *src, int kind, void *dst) {
    int64_t row = kv_row(kind, dim);
    for (int64_t r = 0; r < rows; r++) store_kv(dst, kind, r * row, dim, src + r * dim);
}

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:]; io [rows, 2 inter] -> io [rows, inter].
 * scratch: float32 [2 inter]. */
void silu_mul(int rows, int inter, const void *gate_up, int io_bf16, void *out, float *scratch) {
    for (int r = 0; r < rows; r++) {
        load_row(gate_up, io_bf16, (int64_t)r * 2 * inter, 2 * inter, scratch);
#pragma omp simd
        for (int i = 0; i < inter; i++) {
            float g = scratch[i];
            scratch[i] = g / (1.0f + expf(-g)) * scratch[inter + i];
        }
        store_row(out, io_bf16, (int64_t)r * inter, inter, scratch);
    }
}
