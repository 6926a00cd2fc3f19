/* Driver for benchmarks/native_kernels.py: block_matmul over the embedded model's 30 layers of
 * projection shapes (random blocks), rows 1 / 2 / 4 / 8; prints the best of 15 passes per row count.
 * Usage: matmul THREADS KIND(4|8) FINE(0|1). */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <string.h>
int block_matmul(int kind, int fine, int rows, int n, int k, const void *x, int io_bf16, const void *qs,
                  const uint16_t *scales, void *out, int8_t *p, float *xs, float *acc);
void pool_set_threads(int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    int kind = argc > 2 ? atoi(argv[2]) : 4; int fine = argc > 3 ? atoi(argv[3]) : 0;
    pool_set_threads(threads);
    int shapes[7][2] = {{576,576},{192,576},{192,576},{576,576},{1536,576},{1536,576},{576,1536}};
    int L = 30;
    uint8_t *qs[30][7]; uint16_t *sc[30][7];
    srand(1);
    for (int l = 0; l < L; l++) for (int s = 0; s < 7; s++) {
        int n = shapes[s][0], k = shapes[s][1];
        size_t nb = (size_t)n * k / (kind == 4 ? 2 : 1);
        qs[l][s] = aligned_alloc(64, nb); for (size_t i = 0; i < nb; i++) qs[l][s][i] = rand();
        size_t ns = (size_t)n * (k / 32) * (kind == 4 ? 2 : 1);
        sc[l][s] = aligned_alloc(64, ns * 2); for (size_t i = 0; i < ns; i++) sc[l][s][i] = 0x2000 + (rand() & 0xff);
    }
    float *x = malloc(8 * 1536 * 4), *out = malloc(8 * 1536 * 4), *xs = malloc(8 * 48 * 2 * 4), *acc = malloc(8 * 1536 * 4);
    int8_t *p = malloc(8 * 2 * 1536);
    for (int i = 0; i < 8 * 1536; i++) x[i] = (rand() / (float)RAND_MAX) - 0.5f;
    for (int rows = 1; rows <= 8; rows *= 2) {
        double best = 1e9;
        for (int rep = 0; rep < 15; rep++) {
            double t = now();
            for (int l = 0; l < L; l++) for (int s = 0; s < 7; s++)
                block_matmul(kind, fine, rows, shapes[s][0], shapes[s][1], x, 0, qs[l][s], sc[l][s], out, p, xs, acc);
            t = now() - t; if (t < best) best = t;
        }
        printf("threads=%d kind=%d rows=%d: %.2f ms / 30 layers, %.2f ms/row\n", threads, kind, rows, best * 1e3, best * 1e3 / rows);
    }
    return 0;
}
