/* Reading rows of the paged latent cache as float32 (mla_decode_cpu.c, mha_prefill_cpu.c). A store (the
 * latent or k_pe) is described by its element dtype and four strides in elements: per block, per token,
 * per column chunk, and the chunk width. ND [nb, bs, cols]: (bs*cols, cols, -, cols) with a single chunk;
 * NZ [nb, C1, R', c0]: (C1*R'*c0, c0, R'*c0, c0). The conversions are exact (int8 -> its integer value). */
#ifndef DSQUANT_CACHE_ROWS_H
#define DSQUANT_CACHE_ROWS_H

#include <stdint.h>
#include <string.h>
#include "dtypes.h"
#if defined(__AVX512F__) || DSQUANT_AVX2
#include <immintrin.h>
#endif

typedef struct {
    const void *base;
    int dtype;
    int64_t bstride, tstride, kstride, kwidth, cols;
} store_t;


/* n elements of dtype at src -> float32 at dst */
static void to_f32(float *restrict dst, const void *src, int dtype, int64_t n) {
    switch (dtype) {
    case DT_INT8: {
        const int8_t *s = (const int8_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
        break;
    }
    case DT_BF16: {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *d = (uint32_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
        break;
    }
    case DT_FP16: {
        const uint16_t *s = (const uint16_t *)src;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
#elif DSQUANT_AVX2
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) dst[i] = half_to_float(s[i]);
        break;
    }
    default:
        memcpy(dst, src, (size_t)n * 4);
    }
}


#if defined(__AVX512F__) || DSQUANT_AVX2
#ifdef __AVX512F__
#define ROW_LANES 16
/* ROW_LANES int8 (bf16) elements at src -> float32 at d */
static inline void int8_lanes(float *d, const char *src) {
    _mm512_storeu_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src))));
}
static inline void bf16_lanes(float *d, const char *src) {
    _mm512_storeu_si512(d, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}
#else
#define ROW_LANES 8
static inline void int8_lanes(float *d, const char *src) {
    _mm256_storeu_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src))));
}
static inline void bf16_lanes(float *d, const char *src) {
    _mm256_storeu_si256((__m256i *)d, _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}
#endif
#endif

/* tokens off .. off + count - 1 of block `blk` of store st -> float32 rows dst[i * ld + 0 .. cols). Chunk
 * by chunk, token by token within a chunk: the block's memory is read in order (NZ: fractal by fractal).
 * int8 and bf16 chunks of a multiple of ROW_LANES columns (AVX-512: 16, AVX2: 8) take a vector loop of
 * their own (the decode step's stores). */
static void load_rows(float *restrict dst, int64_t ld, const store_t *st, int64_t blk, int64_t off, int64_t count) {
    const size_t es = dtype_size(st->dtype);
    const char *base = (const char *)st->base + (size_t)(blk * st->bstride + off * st->tstride) * es;
#ifdef ROW_LANES
    if ((st->dtype == DT_INT8 || st->dtype == DT_BF16) && st->kwidth % ROW_LANES == 0 && st->cols % st->kwidth == 0) {
        const size_t kstep = (size_t)st->kstride * es, tstep = (size_t)st->tstride * es;
        const int64_t w = st->kwidth;
        for (int64_t j = 0; j < st->cols; j += w, base += kstep) {
            const char *src = base;
            float *d = dst + j;
            if (st->dtype == DT_INT8)
                for (int64_t t = 0; t < count; t++, src += tstep, d += ld)
                    for (int64_t i = 0; i < w; i += ROW_LANES) int8_lanes(d + i, src + i);
            else
                for (int64_t t = 0; t < count; t++, src += tstep, d += ld)
                    for (int64_t i = 0; i < w; i += ROW_LANES) bf16_lanes(d + i, src + 2 * i);
        }
        return;
    }
#endif
    for (int64_t j = 0, k = 0; j < st->cols; j += st->kwidth, k++) {
        const int64_t w = st->cols - j < st->kwidth ? st->cols - j : st->kwidth;
        for (int64_t t = 0; t < count; t++) {
            const char *src = base + (size_t)(k * st->kstride + t * st->tstride) * es;
            to_f32(dst + t * ld + j, src, st->dtype, w);
        }
    }
}

#endif
