/* Driver for benchmarks/native_kernels.py's prompt table.
 *
 * `prompt THREADS KIND ROWS N K`: block_matmul of ROWS rows (8-bit activations, float32 in and out)
 * against an N x K matrix of random KIND (4: q4_1, 8: q8_0) blocks; prints the best of 5 passes as
 * "ms" and the multiply-adds a second it reached ("GMAC/s").
 * `prompt THREADS peak`: the ceiling of the AVX2 integer dot product on this core, THREADS
 * threads each running the inner step of a q4_1 tile row (8 maddubs, 7 int16 adds and one madd
 * for 8 columns x 32 k = 256 multiply-adds) on 8 independent accumulators, no loads: prints the
 * multiply-adds a second that instruction mix allows ("GMAC/s").
 * `prompt THREADS vnni` (AVX-512 VNNI only): the same for the 512-bit q4_1 tile's row step, 8 dpbusd
 * (16 columns x 32 k = 512 multiply-adds) on 8 independent accumulators; `prompt THREADS vnni-scaled`:
 * with the block's float epilogue each step (an int32 add, the conversion, d x dx, two FMAs: the
 * scaled sum and the min's term), as the tile issues them. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int block_matmul(int kind, int fine, int rows, int n, int k, const void *x, int io_bf16, const void *qs,
                  const uint16_t *scales, void *out, int8_t *p, float *xs, float *acc);
void pool_set_threads(int);

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

#define PEAK_STEPS 50000000L

static void *peak_thread(void *arg) {
    __m256i w[8], s[8], a = _mm256_set1_epi8(3);
    for (int j = 0; j < 8; j++) { w[j] = _mm256_set1_epi8((char)(j + 1)); s[j] = _mm256_setzero_si256(); }
    for (long i = 0; i < PEAK_STEPS; i++) {
        for (int j = 0; j < 8; j++) {
            __m256i t = _mm256_maddubs_epi16(w[0], a);
            for (int c = 1; c < 8; c++) t = _mm256_add_epi16(t, _mm256_maddubs_epi16(w[c], a));
            s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
            a = _mm256_xor_si256(a, w[j]); /* keeps the compiler from hoisting the products */
        }
    }
    __m256i sum = s[0];
    for (int j = 1; j < 8; j++) sum = _mm256_add_epi32(sum, s[j]);
    *(int *)arg = _mm256_extract_epi32(sum, 0);
    return NULL;
}

/* `threads` threads of `step`, each `macs` multiply-adds: prints the rate they reached. */
static int ceiling(void *(*step)(void *), int threads, double macs) {
    pthread_t tid[2];
    int sink[2];
    double t = now();
    for (int i = 0; i < threads; i++) pthread_create(&tid[i], NULL, step, &sink[i]);
    for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
    t = now() - t;
    printf("peak (sink %d): %.1f GMAC/s\n", sink[0] & 1, threads * macs / t / 1e9);
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
static int scaled;

static void *vnni_thread(void *arg) {
    __m512i w[8], s[8], a = _mm512_set1_epi8(3);
    __m512 acc[8], accm[8], d = _mm512_set1_ps(1e-3f), m = _mm512_set1_ps(2e-3f);
    for (int j = 0; j < 8; j++) {
        w[j] = _mm512_set1_epi8((char)(j + 1));
        s[j] = _mm512_setzero_si512();
        acc[j] = accm[j] = _mm512_setzero_ps();
    }
    for (long i = 0; i < PEAK_STEPS / 2; i++) {
        for (int j = 0; j < 8; j++) {
            __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], a), t2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], a);
            for (int c = 2; c < 8; c += 2) {
                t = _mm512_dpbusd_epi32(t, w[c], a);
                t2 = _mm512_dpbusd_epi32(t2, w[c + 1], a);
            }
            if (scaled) {
                __m512 x = _mm512_set1_ps((float)j);
                acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(d, x), _mm512_cvtepi32_ps(_mm512_add_epi32(t, t2)), acc[j]);
                accm[j] = _mm512_fmadd_ps(m, x, accm[j]);
            } else {
                s[j] = _mm512_add_epi32(s[j], _mm512_add_epi32(t, t2));
            }
            a = _mm512_xor_si512(a, w[j]); /* keeps the compiler from hoisting the products */
        }
    }
    __m512i sum = s[0];
    __m512 f = _mm512_add_ps(acc[0], accm[0]);
    for (int j = 1; j < 8; j++) {
        sum = _mm512_add_epi32(sum, s[j]);
        f = _mm512_add_ps(f, _mm512_add_ps(acc[j], accm[j]));
    }
    *(int *)arg = _mm512_reduce_add_epi32(sum) + (int)_mm512_reduce_add_ps(f);
    return NULL;
}

#endif

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (argc > 2 && strcmp(argv[2], "peak") == 0) return ceiling(peak_thread, threads < 2 ? 1 : 2, PEAK_STEPS * 8.0 * 256);
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    if (argc > 2 && strncmp(argv[2], "vnni", 4) == 0) {
        scaled = strcmp(argv[2], "vnni-scaled") == 0;
        return ceiling(vnni_thread, threads < 2 ? 1 : 2, (PEAK_STEPS / 2) * 8.0 * 512);
    }
#endif
    if (argc < 6) { fprintf(stderr, "usage: prompt THREADS KIND ROWS N K | prompt THREADS peak\n"); return 2; }
    int kind = atoi(argv[2]), rows = atoi(argv[3]), n = atoi(argv[4]), k = atoi(argv[5]);
    pool_set_threads(threads);
    srand(1);
    size_t nb = (size_t)n * k / (kind == 4 ? 2 : 1), ns = (size_t)n * (k / 32) * (kind == 4 ? 2 : 1);
    uint8_t *qs = aligned_alloc(64, nb);
    uint16_t *sc = aligned_alloc(64, ns * 2);
    for (size_t i = 0; i < nb; i++) qs[i] = (uint8_t)rand();
    for (size_t i = 0; i < ns; i++) sc[i] = 0x2000 + (rand() & 0xff);
    float *x = malloc((size_t)rows * k * 4), *out = malloc((size_t)rows * n * 4), *xs = malloc((size_t)rows * (k / 32) * 2 * 4);
    int8_t *p = malloc((size_t)rows * 2 * k);
    for (size_t i = 0; i < (size_t)rows * k; i++) x[i] = (rand() / (float)RAND_MAX) - 0.5f;
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t = now();
        block_matmul(kind, 0, rows, n, k, x, 0, qs, sc, out, p, xs, NULL);
        t = now() - t;
        if (t < best) best = t;
    }
    printf("rows=%d n=%d k=%d: %.2f ms, %.1f GMAC/s\n", rows, n, k, best * 1e3, (double)rows * n * k / best / 1e9);
    return 0;
}
