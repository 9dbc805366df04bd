/* A small pool of worker threads for the kernels of one library: pool_run(fn, ctx, n) calls fn(ctx, i)
 * for i in 0 .. n-1 on the calling thread and the workers, handing out indices one at a time (an atomic
 * counter), and returns when all are done. A kernel splits its work into tasks whose results do not depend
 * on which thread runs them (disjoint output columns, each computed by the same operations in the same
 * order), so the results are the same bits for any thread count.
 *
 * The workers are started on first use, up to pool_threads - 1 of them. Between jobs a worker spins for
 * POOL_SPIN_NS (a decode step's kernels follow each other within microseconds: a sleeping worker would add a
 * wake-up to every call), then sleeps on a condition variable until the next job. One job runs at a time:
 * a caller that finds the pool busy (another thread of the process calling the kernels) runs its tasks
 * alone. With one thread (pool_set_threads(1), the default) no worker exists and pool_run is a loop.
 */
#ifndef DSQUANT_POOL_H
#define DSQUANT_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define POOL_MAX 256
#define POOL_SPIN_NS 200000LL  /* 0.2 ms */

typedef void (*pool_fn)(void *ctx, int64_t i);

static struct {
    int threads;                    /* threads a job uses, the caller included */
    int started;                    /* workers running */
    pthread_t th[POOL_MAX];
    uint64_t first[POOL_MAX + 1];   /* the job word a worker was started at */
    _Atomic uint64_t job;           /* (job number << 16) | workers taking part: one word, read at once */
    _Atomic int64_t next;           /* the next task index */
    _Atomic int pending;            /* workers taking part still working */
    _Atomic int sleepers;
    _Atomic int busy;               /* a job in flight */
    pool_fn fn;
    void *ctx;
    int64_t n;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} POOL = {.threads = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static inline int64_t pool_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void pool_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void pool_tasks(void) {
    const int64_t n = POOL.n;
    for (int64_t i; (i = atomic_fetch_add(&POOL.next, 1)) < n;) POOL.fn(POOL.ctx, i);
}

/* A worker takes part in a job when its id (1 ..) is below the job's count of workers taking part; the
 * caller waits for exactly those, so a job's fields stay put while any of them reads them. */
static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    uint64_t seen = POOL.first[id];
    for (;;) {
        uint64_t job;
        const int64_t until = pool_now_ns() + POOL_SPIN_NS;
        int spins = 0;
        while ((job = atomic_load(&POOL.job)) == seen) {
            pool_relax();
            if (++spins % 256 == 0 && pool_now_ns() > until) {
                pthread_mutex_lock(&POOL.mu);
                atomic_fetch_add(&POOL.sleepers, 1);
                while ((job = atomic_load(&POOL.job)) == seen) pthread_cond_wait(&POOL.cv, &POOL.mu);
                atomic_fetch_sub(&POOL.sleepers, 1);
                pthread_mutex_unlock(&POOL.mu);
                break;
            }
        }
        seen = job;
        if (id < (int)(job & 0xffff)) {
            pool_tasks();
            atomic_fetch_sub(&POOL.pending, 1);
        }
    }
    return NULL;
}

/* In a forked child no worker exists: start afresh. */
static void pool_after_fork(void) {
    POOL.started = 0;
    atomic_store(&POOL.busy, 0);
    atomic_store(&POOL.sleepers, 0);
    atomic_store(&POOL.pending, 0);
    pthread_mutex_init(&POOL.mu, NULL);
    pthread_cond_init(&POOL.cv, NULL);
}

/* Threads for the next jobs (1 .. POOL_MAX), the caller included; returns the number set. */
int pool_set_threads(int n) {
    n = n < 1 ? 1 : (n > POOL_MAX ? POOL_MAX : n);
    POOL.threads = n;
    return n;
}

int pool_get_threads(void) { return POOL.threads; }

static void pool_run(pool_fn fn, void *ctx, int64_t n) {
    int want = POOL.threads < n ? POOL.threads : (int)n;
    int expected = 0;
    if (want <= 1 || !atomic_compare_exchange_strong(&POOL.busy, &expected, 1)) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    static int forks_watched;
    if (!forks_watched) forks_watched = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    while (POOL.started < want - 1) {      /* start the workers this job needs (kept for later jobs) */
        const int id = POOL.started + 1;
        POOL.first[id] = atomic_load(&POOL.job);
        if (pthread_create(&POOL.th[id - 1], NULL, pool_worker, (void *)(intptr_t)id)) break;
        POOL.started = id;
    }
    if (POOL.started < want - 1) want = POOL.started + 1;
    POOL.fn = fn;
    POOL.ctx = ctx;
    POOL.n = n;
    atomic_store(&POOL.next, 0);
    atomic_store(&POOL.pending, want - 1);
    atomic_store(&POOL.job, ((atomic_load(&POOL.job) >> 16) + 1) << 16 | (uint64_t)want);
    if (atomic_load(&POOL.sleepers) > 0) {
        pthread_mutex_lock(&POOL.mu);
        pthread_cond_broadcast(&POOL.cv);
        pthread_mutex_unlock(&POOL.mu);
    }
    pool_tasks();
    for (int spins = 0; atomic_load(&POOL.pending) > 0;)
        if (++spins % 1024 == 0) sched_yield(); else pool_relax();     /* a worker descheduled: let it run */
    atomic_store(&POOL.busy, 0);
}

#endif
