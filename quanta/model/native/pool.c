/* A fork-join of two threads for the decode kernels: the calling thread and one worker.
 *
 * A one-row decode step is ~200 kernel calls of 10-150 us, each bound by how fast one
 * core streams its weights in; splitting every call's output columns (or attention's
 * positions) over both cores reads the weights about twice as fast. PyTorch's OpenMP
 * pool was measured worse for this through HTTP (its threads sleep between ops and the
 * event loop preempts them), so quanta keeps its own: between calls of a step the
 * worker spins for SPIN_NS, then sleeps on a futex until the next call wakes it, so
 * an idle server (or a prefill step, which runs on PyTorch's threads) does not spin.
 *
 * One caller at a time: a second thread calling while a job runs does its whole job
 * itself (parts = 1), so concurrent callers stay correct.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>

#include "pool.h"

#define SPIN_NS 200000 /* 0.2 ms: longer than the Python between two calls of a step */

static struct {
    _Atomic unsigned seq;  /* bumped for each job */
    _Atomic unsigned done; /* the last job the worker finished */
    _Atomic int sleeping;
    pool_fn fn;
    void *arg;
    int threads, started;
    pthread_mutex_t busy;
} P = {.threads = 1, .busy = PTHREAD_MUTEX_INITIALIZER};

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void *worker(void *first) {
    unsigned seen = (unsigned)(uintptr_t)first; /* seq when it was started: it may start after the first job is posted */
    for (;;) {
        unsigned s;
        uint64_t since = now_ns();
        for (unsigned spins = 1; (s = atomic_load_explicit(&P.seq, memory_order_acquire)) == seen; spins++) {
            _mm_pause();
            if (spins % 256 || now_ns() - since < SPIN_NS) continue;
            atomic_store(&P.sleeping, 1); /* then re-check seq: a caller bumps seq, then reads sleeping */
            if (atomic_load(&P.seq) == seen) syscall(SYS_futex, &P.seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_store(&P.sleeping, 0);
            since = now_ns();
        }
        seen = s;
        P.fn(P.arg, 1, 2);
        atomic_store_explicit(&P.done, s, memory_order_release);
    }
    return NULL;
}

static void forget_worker(void) { P.started = 0; } /* a fork()ed child has no worker thread */

void pool_set_threads(int threads) { P.threads = threads >= POOL_MAX_PARTS ? POOL_MAX_PARTS : 1; }

int pool_threads(void) { return P.threads; }

int pool_run(pool_fn fn, void *arg) {
    if (P.threads < 2 || pthread_mutex_trylock(&P.busy) != 0) {
        fn(arg, 0, 1);
        return 1;
    }
    if (!P.started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        static int registered;
        if (!registered) registered = !pthread_atfork(NULL, NULL, forget_worker);
        unsigned first = atomic_load(&P.seq);
        atomic_store(&P.done, first);
        P.started = !pthread_create(&t, &attr, worker, (void *)(uintptr_t)first);
        pthread_attr_destroy(&attr);
        if (!P.started) {
            pthread_mutex_unlock(&P.busy);
            fn(arg, 0, 1);
            return 1;
        }
    }
    P.fn = fn;
    P.arg = arg;
    unsigned s = atomic_fetch_add(&P.seq, 1) + 1;
    if (atomic_load(&P.sleeping)) syscall(SYS_futex, &P.seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    fn(arg, 0, 2);
    while (atomic_load_explicit(&P.done, memory_order_acquire) != s) _mm_pause();
    pthread_mutex_unlock(&P.busy);
    return 2;
}
