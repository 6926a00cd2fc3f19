/* A fork-join for the decode kernels: the calling thread and one worker claim a job's chunks.
 *
 * A one-row decode step is ~200 kernel calls of 10-150 us, each bound by how fast one
 * core streams its weights in; splitting every call's output columns (or attention's
 * positions) over both cores reads the weights about twice as fast. PyTorch's OpenMP
 * pool was measured worse for this through HTTP (its threads sleep between ops and the
 * event loop preempts them), so quanta keeps its own: between calls of a step the
 * worker spins for SPIN_NS, then sleeps on a futex until the next call wakes it, so
 * an idle server (or a prefill step, which runs on PyTorch's threads) does not spin.
 *
 * Cores shared with other work. A job is cut into chunks (pool_chunks) that the caller and
 * the worker claim one at a time from one counter, so a worker that is descheduled, or not
 * yet awake, leaves its share to the caller; the caller waits only for a chunk the worker
 * has begun. What a chunk computes does not depend on who runs it, so results are the same
 * on 1 or 2 threads. Whether two threads beat one on cores that other work shares is
 * measured step by step in Python (quanta/model/thread_tuner.py), which sets the threads.
 *
 * One caller at a time: a second thread calling while a job runs does its whole job
 * itself, so concurrent callers stay correct.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>

#include "pool.h"

#define SPIN_NS 200000       /* 0.2 ms: longer than the Python between two calls of a step */
#define JOIN_SPIN_NS 20000   /* the caller spins this long for the worker's last chunk, then yields */

/* ticket: the job's number (high 32 bits), its chunks (bits 16-31), the next chunk (bits 0-15) */
#define TICKET(job, chunks) (((uint64_t)(job) << 32) | ((uint64_t)(chunks) << 16))
#define NEXT(t) ((int)((t) & 0xffff))
#define CHUNKS(t) ((int)(((t) >> 16) & 0xffff))
#define MAX_CHUNKS 0x7fff

/* ticket, finished and seq each on a cache line of its own: the caller's claims (ticket), the
 * worker's count of chunks done (finished) and the worker's spinning on seq would otherwise move
 * one line between the cores at every step of each */
static struct {
    _Alignas(64) _Atomic uint64_t ticket;
    _Alignas(64) _Atomic int finished; /* chunks of the job the worker finished */
    _Alignas(64) _Atomic unsigned seq; /* the job's number, the word the worker sleeps on */
    _Atomic int sleeping;
    _Atomic(pool_fn) fn;
    _Atomic(void *) arg;
    int threads, started;
    pthread_mutex_t busy;
} P = {.threads = 1, .busy = PTHREAD_MUTEX_INITIALIZER};

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Claims and runs chunks of the job in P.ticket until none is left. */
static void claim_chunks(int thread) {
    uint64_t t = atomic_load_explicit(&P.ticket, memory_order_acquire);
    while (NEXT(t) < CHUNKS(t)) {
        pool_fn fn = atomic_load_explicit(&P.fn, memory_order_relaxed);
        void *arg = atomic_load_explicit(&P.arg, memory_order_relaxed);
        /* the ticket unchanged since it was read: the job is still open, so fn and arg are its own */
        if (!atomic_compare_exchange_weak(&P.ticket, &t, t + 1)) continue;
        fn(arg, NEXT(t), CHUNKS(t), thread);
        atomic_fetch_add_explicit(&P.finished, 1, memory_order_release);
        t = atomic_load_explicit(&P.ticket, memory_order_acquire);
    }
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
        claim_chunks(1);
    }
    return NULL;
}

static void forget_worker(void) { P.started = 0; } /* a fork()ed child has no worker thread */

void pool_set_threads(int threads) { P.threads = threads >= POOL_MAX_THREADS ? POOL_MAX_THREADS : 1; }

int pool_threads(void) { return P.threads; }

static int start_worker(void) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    static int registered;
    if (!registered) registered = !pthread_atfork(NULL, NULL, forget_worker);
    P.started = !pthread_create(&t, &attr, worker, (void *)(uintptr_t)atomic_load(&P.seq));
    pthread_attr_destroy(&attr);
    return P.started;
}

static void run_alone(pool_fn fn, void *arg, int chunks) {
    for (int c = 0; c < chunks; c++) fn(arg, c, chunks, 0);
}

/* Waits for the worker's `owed` chunks: spins JOIN_SPIN_NS, then yields the CPU (to the worker,
 * when they share a core). */
static void join_worker(int owed) {
    uint64_t since = 0;
    for (unsigned spins = 1; atomic_load_explicit(&P.finished, memory_order_acquire) != owed; spins++) {
        _mm_pause();
        if (spins % 64) continue;
        if (!since) since = now_ns();
        else if (now_ns() - since > JOIN_SPIN_NS) sched_yield();
    }
}

void pool_run(pool_fn fn, void *arg, int chunks) {
    if (chunks > MAX_CHUNKS) chunks = MAX_CHUNKS; /* callers size chunks with pool_chunks */
    if (P.threads < 2 || chunks < 2 || pthread_mutex_trylock(&P.busy) != 0) {
        run_alone(fn, arg, chunks);
        return;
    }
    if (!P.started && !start_worker()) {
        pthread_mutex_unlock(&P.busy);
        run_alone(fn, arg, chunks);
        return;
    }
    atomic_store_explicit(&P.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&P.arg, arg, memory_order_relaxed);
    atomic_store_explicit(&P.finished, 0, memory_order_relaxed);
    unsigned s = atomic_load(&P.seq) + 1;
    atomic_store_explicit(&P.ticket, TICKET(s, chunks), memory_order_release);
    atomic_store_explicit(&P.seq, s, memory_order_release);
    if (atomic_load(&P.sleeping)) syscall(SYS_futex, &P.seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    int mine = 0;
    for (uint64_t t; NEXT(t = atomic_fetch_add(&P.ticket, 1)) < chunks; mine++) fn(arg, NEXT(t), chunks, 0);
    join_worker(chunks - mine);
    pthread_mutex_unlock(&P.busy);
}
