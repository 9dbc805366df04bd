/* Element types shared by the engine's C kernels (pipeline/engine/csrc), with the dtype codes the Python
 * side passes (pipeline.engine.cpu_attention._DTYPES) and exact conversions to float32. */
#ifndef DSQUANT_DTYPES_H
#define DSQUANT_DTYPES_H

#include <stdint.h>
#include <string.h>

enum { DT_INT8 = 0, DT_BF16 = 1, DT_FP16 = 2, DT_F32 = 3 };

#ifdef __AVX512F__
#include <immintrin.h>
/* The lanes of a 16-lane vector that hold the last `left` elements of a row: all 16 when left >= 16, none
 * when left <= 0. */
static inline __mmask16 tail_mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : (__mmask16)0;
}
#endif

/* AVX2 + FMA (+ F16C, which every AVX2 CPU has) without AVX-512: the kernels' 8-lane loops (AVX-512
 * machines keep their 16-lane ones). */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DSQUANT_AVX2 1
#include <immintrin.h>
/* The lanes of an 8-lane vector that hold the last `left` elements of a row (all bits set in those lanes):
 * all 8 when left >= 8, none when left <= 0. For _mm256_maskload_ps / _mm256_maskstore_ps. */
static inline __m256i tail_mask8(int64_t left) {
    const int k = left >= 8 ? 8 : left > 0 ? (int)left : 0;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The sum / the max of an 8-lane vector's lanes: ((0+4) + (2+6)) + ((1+5) + (3+7)), the max alike. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#else
#define DSQUANT_AVX2 0
#endif

/* bfloat16 bits -> float32 (exact: the high half of a float32). */
static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN): torch's c10::BFloat16(float). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE half bits -> float32 (exact, subnormals and inf/NaN included). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {                                   /* subnormal: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline size_t dtype_size(int dtype) { return dtype == DT_INT8 ? 1 : dtype == DT_F32 ? 4 : 2; }

#endif
