/* Driver for benchmarks/native_kernels.py: attention_decode for ROWS rows (9 heads, 3 KV heads,
 * head_dim 64, as the embedded model) over 30 layers at CTX cached positions each, in paged caches
 * of 32-position blocks (the default --block-size), the rows' blocks interleaved over the pool;
 * each layer has its own cache, so a pass reads them from memory as a decode step does, not from
 * a warm CPU cache. Prints the best of PASSES passes and a hash of the output, so two builds can
 * be checked to agree bit for bit.
 * Usage: attention THREADS CTX KIND(0 float32 | 1 bf16 | 2 fp16 | 3 q8_0) ROWS PASSES. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
int64_t attention_scratch(int rows, int heads, int kv_heads, int dim, int64_t max_len);
void attention_decode(int rows, const void *qkv, int io_bf16, int heads, int kv_heads, int dim,
                      const float *q_norm, const float *k_norm, float eps,
                      const float *cos_table, const float *sin_table, const int64_t *row_table, const int64_t *positions,
                      const int32_t *tables, int64_t table_width, int64_t block_size, void *k_cache,
                      void *v_cache, int cache_kind, int64_t max_len, void *out, float *scratch);
void pool_set_threads(int);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(int argc, char **argv) {
    int threads = atoi(argv[1]), ctx = atoi(argv[2]), kind = atoi(argv[3]), rows = atoi(argv[4]), passes = atoi(argv[5]);
    pool_set_threads(threads);
    int heads = 9, kvh = 3, dim = 64;
    int64_t bs = 32, width = (ctx + bs) / bs, blocks = rows * width;
    int64_t row_units = kind == 3 ? dim / 32 * 34 : dim, elem = kind == 0 ? 4 : kind == 3 ? 1 : 2;
    int64_t cache_bytes = blocks * kvh * bs * row_units * elem;
    unsigned char *k = malloc(cache_bytes), *v = malloc(cache_bytes), *ks[30], *vs[30];
    for (int64_t i = 0; i < cache_bytes; i++) k[i] = v[i] = (unsigned char)rand();
    if (kind == 0) /* finite float32 values in [-0.5, 0.5) */
        for (int64_t i = 0; i < cache_bytes / 4; i++) ((float *)k)[i] = ((float *)v)[i] = rand() / (float)RAND_MAX - 0.5f;
    else if (kind != 3) /* finite 16-bit values below 2 in magnitude: clear the top exponent bit */
        for (int64_t i = 0; i < cache_bytes / 2; i++) ((uint16_t *)k)[i] = ((uint16_t *)v)[i] &= kind == 1 ? 0xbeff : 0xb7ff;
    else /* q8_0: a small fp16 scale per 34-byte group */
        for (int64_t i = 0; i < cache_bytes; i += 34) *(uint16_t *)(k + i) = *(uint16_t *)(v + i) = 0x2000;
    for (int l = 0; l < 30; l++) { /* the same values in every layer's own memory */
        ks[l] = malloc(cache_bytes), vs[l] = malloc(cache_bytes);
        memcpy(ks[l], k, cache_bytes), memcpy(vs[l], v, cache_bytes);
    }
    int32_t *tables = malloc((size_t)blocks * sizeof(int32_t)); /* block r * width + b of row r, interleaved over the pool */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < width; b++) tables[r * width + b] = (int32_t)(b * rows + r);
    float *qkv = malloc((size_t)rows * (heads + 2 * kvh) * dim * 4), *out = malloc((size_t)rows * heads * dim * 4);
    for (int i = 0; i < rows * (heads + 2 * kvh) * dim; i++) qkv[i] = rand() / (float)RAND_MAX - 0.5f;
    float *cos_t = malloc((size_t)(ctx + 1) * dim * 4), *sin_t = malloc((size_t)(ctx + 1) * dim * 4); /* RoPE tables */
    for (int64_t p = 0; p <= ctx; p++)
        for (int i = 0; i < dim; i++) {
            float angle = (float)p / (i % (dim / 2) + 1);
            cos_t[p * dim + i] = cosf(angle), sin_t[p * dim + i] = sinf(angle);
        }
    int64_t *row_table = malloc((size_t)rows * 8), *pos = malloc((size_t)rows * 8);
    for (int r = 0; r < rows; r++) { row_table[r] = r; pos[r] = ctx; }
    float *scratch = malloc(attention_scratch(rows, heads, kvh, dim, ctx + 1) * 4);
    double best = 1e9;
    for (int rep = 0; rep < passes; rep++) {
        double t = now();
        for (int l = 0; l < 30; l++)
            attention_decode(rows, qkv, 0, heads, kvh, dim, NULL, NULL, 0.0f, cos_t, sin_t, row_table, pos, tables, width, bs, ks[l], vs[l], kind, ctx + 1, out, scratch);
        t = now() - t; if (t < best) best = t;
    }
    uint64_t hash = 1469598103934665603u; /* FNV-1a of the output's bytes: two versions agree bit for bit or not */
    for (size_t i = 0; i < (size_t)rows * heads * dim * 4; i++) hash = (hash ^ ((unsigned char *)out)[i]) * 1099511628211u;
    printf("threads=%d ctx=%d kind=%d rows=%d: %.3f ms / 30 layers, output %016llx\n", threads, ctx, kind, rows,
           best * 1e3, (unsigned long long)hash);
}
