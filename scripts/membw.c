/* Read bandwidth of this machine's memory: `threads` threads each sum their own slice of a buffer much
 * larger than the caches, with the widest loads the build has; the figure is bytes read / wall time of the
 * slowest thread, the median of `reps` passes (scripts/bench_real_width.py). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct { const uint8_t *p; size_t n; uint64_t sink; int streams; } slice_t;

/* One stream a thread, or four (its slice in four quarters read side by side, as the int8 kernels read a
 * panel's four column blocks); which reads faster depends on the machine, so the script measures both. */
static void *reader(void *arg) {
    slice_t *s = arg;
    const size_t q = s->streams == 4 ? s->n / 4 / 256 * 256 : 128;
    const uint8_t *p0 = s->p, *p1 = p0 + q, *p2 = p1 + q, *p3 = p2 + q;
    if (s->streams != 4) {                         /* one stream: the same loop over consecutive 4 x q bytes */
        size_t i = 0;
#if defined(__AVX512F__)
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 256 <= s->n; i += 256) {
            a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void *)(s->p + i)));
            a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void *)(s->p + i + 64)));
            a2 = _mm512_xor_si512(a2, _mm512_load_si512((const void *)(s->p + i + 128)));
            a3 = _mm512_xor_si512(a3, _mm512_load_si512((const void *)(s->p + i + 192)));
        }
        s->sink = (uint64_t)_mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
#elif defined(__AVX2__)
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        for (; i + 64 <= s->n; i += 64) {
            a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(s->p + i)));
            a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(s->p + i + 32)));
        }
        __m256i a = _mm256_xor_si256(a0, a1);
        s->sink = (uint64_t)_mm256_extract_epi64(a, 0) ^ (uint64_t)_mm256_extract_epi64(a, 3);
#else
        uint64_t acc = 0;
        for (; i + 8 <= s->n; i += 8) { uint64_t v; memcpy(&v, s->p + i, 8); acc ^= v; }
        s->sink = acc;
#endif
        s->n = i;
        return NULL;
    }
    size_t i = 0;
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 128 <= q; i += 128) {
        a0 = _mm512_xor_si512(a0, _mm512_xor_si512(_mm512_load_si512((const void *)(p0 + i)),
                                                   _mm512_load_si512((const void *)(p0 + i + 64))));
        a1 = _mm512_xor_si512(a1, _mm512_xor_si512(_mm512_load_si512((const void *)(p1 + i)),
                                                   _mm512_load_si512((const void *)(p1 + i + 64))));
        a2 = _mm512_xor_si512(a2, _mm512_xor_si512(_mm512_load_si512((const void *)(p2 + i)),
                                                   _mm512_load_si512((const void *)(p2 + i + 64))));
        a3 = _mm512_xor_si512(a3, _mm512_xor_si512(_mm512_load_si512((const void *)(p3 + i)),
                                                   _mm512_load_si512((const void *)(p3 + i + 64))));
    }
    s->sink = (uint64_t)_mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= q; i += 64) {
        a0 = _mm256_xor_si256(a0, _mm256_xor_si256(_mm256_load_si256((const __m256i *)(p0 + i)),
                                                   _mm256_load_si256((const __m256i *)(p0 + i + 32))));
        a1 = _mm256_xor_si256(a1, _mm256_xor_si256(_mm256_load_si256((const __m256i *)(p1 + i)),
                                                   _mm256_load_si256((const __m256i *)(p1 + i + 32))));
        a2 = _mm256_xor_si256(a2, _mm256_xor_si256(_mm256_load_si256((const __m256i *)(p2 + i)),
                                                   _mm256_load_si256((const __m256i *)(p2 + i + 32))));
        a3 = _mm256_xor_si256(a3, _mm256_xor_si256(_mm256_load_si256((const __m256i *)(p3 + i)),
                                                   _mm256_load_si256((const __m256i *)(p3 + i + 32))));
    }
    __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    s->sink = (uint64_t)_mm256_extract_epi64(a, 0) ^ (uint64_t)_mm256_extract_epi64(a, 3);
#else
    uint64_t acc = 0;
    for (; i + 8 <= q; i += 8) {
        uint64_t v[4];
        memcpy(&v[0], p0 + i, 8); memcpy(&v[1], p1 + i, 8); memcpy(&v[2], p2 + i, 8); memcpy(&v[3], p3 + i, 8);
        acc ^= v[0] ^ v[1] ^ v[2] ^ v[3];
    }
    s->sink = acc;
#endif
    s->n = 4 * q;
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* GB/s of each pass into out[reps], each thread reading `streams` (1 or 4) streams of its slice; returns 0,
 * or -1 (out of memory / threads). */
int read_bandwidth(int64_t bytes, int threads, int streams, int reps, double *out) {
    if (threads < 1 || threads > 256 || bytes < (int64_t)threads * 4096) return -1;
    uint8_t *buf = aligned_alloc(1 << 21, (size_t)bytes);
    if (!buf) return -1;
    madvise(buf, (size_t)bytes, MADV_HUGEPAGE);        /* as large tensors get where the kernel allows it */
    memset(buf, 1, (size_t)bytes);                     /* touch every page */
    slice_t sl[256];
    pthread_t th[256];
    const size_t per = (size_t)bytes / threads / 4096 * 4096;
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        for (int t = 0; t < threads; t++) {
            sl[t] = (slice_t){buf + t * per, per, 0, streams};
            if (pthread_create(&th[t], NULL, reader, &sl[t])) { free(buf); return -1; }
        }
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
        size_t got = 0;
        for (int t = 0; t < threads; t++) got += sl[t].n;
        out[r] = (double)got / (now() - t0) / 1e9;
    }
    free(buf);
    return 0;
}
