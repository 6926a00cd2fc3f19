/* The fork-join of pool.c: a job's chunks claimed one by one by the caller and one worker. */
#ifndef QUANTA_POOL_H
#define QUANTA_POOL_H
#include <stdint.h>

/* One chunk of a job: fn(arg, chunk, chunks, thread) does chunk `chunk` of `chunks`
 * (0 <= chunk < chunks) with the scratch of `thread` (0: the caller, 1: the worker). What a
 * chunk computes must not depend on `thread`: which thread takes which chunk changes from
 * call to call. */
typedef void (*pool_fn)(void *arg, int chunk, int chunks, int thread);

/* Runs every chunk of fn, returning when all are done: with two threads the caller and the
 * worker claim them in turn; with one (or while another caller holds the pool) the caller
 * runs them all. */
void pool_run(pool_fn fn, void *arg, int chunks);

/* The most threads a job runs on: the caller and one worker (scratch is sized for them). */
#define POOL_MAX_THREADS 2

/* 1 (default: every chunk on the caller) or POOL_MAX_THREADS threads. */
void pool_set_threads(int threads);
int pool_threads(void);

/* [lo, hi) of part `part` of `parts` equal shares of n items, each a multiple of `step` (but the last). */
static inline void pool_share(int64_t n, int64_t step, int part, int parts, int64_t *lo, int64_t *hi) {
    int64_t units = (n + step - 1) / step;
    int64_t a = units * part / parts, b = units * (part + 1) / parts;
    *lo = a * step < n ? a * step : n;
    *hi = b * step < n ? b * step : n;
}

/* Chunks for n units of work: one a unit up to POOL_CHUNKS, so a thread that is descheduled
 * leaves the others at most one chunk to wait for. */
#define POOL_CHUNKS 32
static inline int pool_chunks(int64_t units) { return units < POOL_CHUNKS ? (units > 0 ? (int)units : 1) : POOL_CHUNKS; }

/* pool_chunks for a job that reads `bytes` of weights: no more chunks than one per POOL_CHUNK_BYTES
 * (at least 2, one a thread). Each chunk is claimed from a counter both cores write, so a small
 * matrix cut in 32 pays for the claims about as much as for its work (the 135M model's decode
 * calls, 0.2-1.1 MB of q4_1 each: 34 us a call on average in 32 chunks, 20 us in 2 halves, a
 * one-row step 5.0 against 3.3 ms in-process on a 2-core AMD EPYC with AVX-512). */
#define POOL_CHUNK_BYTES (64 * 1024)
static inline int pool_chunks_sized(int64_t units, int64_t bytes) {
    int chunks = pool_chunks(units);
    int64_t by_size = bytes / POOL_CHUNK_BYTES;
    if (by_size < 2) by_size = 2;
    return by_size < chunks ? (int)by_size : chunks;
}
#endif
