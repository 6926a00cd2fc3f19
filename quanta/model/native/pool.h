/* The two-thread fork-join of pool.c. */
#ifndef QUANTA_POOL_H
#define QUANTA_POOL_H
#include <stdint.h>

/* One part of a job: fn(arg, part, parts) does share `part` of `parts` (0 <= part < parts). */
typedef void (*pool_fn)(void *arg, int part, int parts);

/* Runs fn(arg, 0, 2) here and fn(arg, 1, 2) on the worker, returning when both are done;
 * fn(arg, 0, 1) alone with one thread, or when another caller holds the pool.
 * Returns the parts run (2 or 1). */
int pool_run(pool_fn fn, void *arg);

/* The most parts a job is split into: the caller and one worker. */
#define POOL_MAX_PARTS 2

/* 1 (default: every part on the caller) or POOL_MAX_PARTS threads. */
void pool_set_threads(int threads);
int pool_threads(void);

/* [lo, hi) of part `part` of `parts` equal shares of n items, each a multiple of `step` (but the last). */
static inline void pool_share(int64_t n, int64_t step, int part, int parts, int64_t *lo, int64_t *hi) {
    int64_t units = (n + step - 1) / step;
    int64_t a = units * part / parts, b = units * (part + 1) / parts;
    *lo = a * step < n ? a * step : n;
    *hi = b * step < n ? b * step : n;
}
#endif
