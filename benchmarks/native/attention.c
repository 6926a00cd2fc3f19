/* Driver for benchmarks/native_kernels.py: attention_decode for 8 rows (9 heads, 3 KV heads,
 * head_dim 64, as the embedded model) over 30 layers at CTX cached positions; best of 20 passes.
 * Usage: attention THREADS CTX BF16(0|1). */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
int64_t attention_scratch(int rows, int heads, int kv_heads, int dim, int64_t max_len);
void attention_decode(int rows, const void *qkv, int io_bf16, int heads, int kv_heads, int dim,
                      const float *inv_freq, const int64_t *slots, const int64_t *positions,
                      void *k_cache, void *v_cache, int cache_bf16, int64_t slot_stride,
                      int64_t head_stride, int64_t max_len, void *out, float *scratch);
void pool_set_threads(int);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(int argc, char **argv) {
    int threads = atoi(argv[1]), ctx = atoi(argv[2]), bf16 = argc > 3 ? atoi(argv[3]) : 0;
    pool_set_threads(threads);
    int rows = 8, heads = 9, kvh = 3, dim = 64; int64_t max_len = 1024;
    int64_t cache_n = (int64_t)rows * kvh * max_len * dim;
    float *k = malloc(cache_n * 4), *v = malloc(cache_n * 4);
    for (int64_t i = 0; i < cache_n; i++) { k[i] = rand() / (float)RAND_MAX - 0.5f; v[i] = k[i]; }
    if (bf16) /* the first cache_n bf16 values: the upper halves of random floats */
        for (int64_t i = 0; i < cache_n; i++) ((uint16_t *)k)[i] = ((uint16_t *)v)[i] = (uint16_t)(*(uint32_t *)&k[i] >> 16);
    float *qkv = malloc(rows * (heads + 2 * kvh) * dim * 4), *out = malloc(rows * heads * dim * 4);
    for (int i = 0; i < rows * (heads + 2 * kvh) * dim; i++) qkv[i] = rand() / (float)RAND_MAX - 0.5f;
    float inv[32]; for (int i = 0; i < 32; i++) inv[i] = 1.0f / (i + 1);
    int64_t slots[8], pos[8]; for (int r = 0; r < 8; r++) { slots[r] = r; pos[r] = ctx; }
    float *scratch = malloc(attention_scratch(rows, heads, kvh, dim, max_len) * 4);
    double best = 1e9;
    for (int rep = 0; rep < 20; rep++) {
        double t = now();
        for (int l = 0; l < 30; l++) attention_decode(rows, qkv, 0, heads, kvh, dim, inv, slots, pos, k, v, bf16, kvh * max_len * dim, max_len * dim, max_len, out, scratch);
        t = now() - t; if (t < best) best = t;
    }
    printf("threads=%d ctx=%d bf16=%d: %.3f ms / 30 layers x 8 rows\n", threads, ctx, bf16, best * 1e3);
}
