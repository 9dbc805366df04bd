/* One step's cache write (PagedLatentCache.write_slots) in one call: token i's row goes to flat slot
 * slots[i] = block * block_size + offset of an ND or NZ store, optionally quantized to int8 on the way.
 *
 * Quantize (an FA3 latent): float32(x) / scale, rounded half to even, clamped to [-127, 127], cast to
 * int8 -- the float32 operations of paged_cache._to_int8 one by one (x -> float32 is exact from
 * bf16 / fp16 / float32; IEEE division; rint in the default rounding mode is round half to even; NaN
 * gives 0 as torch's conversion does). Built with -ffp-contract=off, so the result is bit-identical; with
 * AVX-512 the same operations 16 lanes at a time, with AVX2 8 (the division is IEEE in all three).
 * Otherwise the element bytes are copied as they are (the caller converts dtypes with torch first).
 *
 * NZ padding columns of the row's last chunk are written as zero, as the torch code does.
 * Store strides (elements): per block, per token, per column chunk, and the chunk width (see
 * mla_decode_cpu.c). Returns 0, or 2 when a slot lies outside 0 .. num_slots - 1 (nothing written).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#if defined(__AVX512F__) || DSQUANT_AVX2
#include <immintrin.h>
#endif


#ifdef __AVX512F__
/* 16 elements (mask mk) of src from element j -> float32, exactly */
static inline __m512 load16(const void *src, int src_dtype, int64_t j, __mmask16 mk) {
    if (src_dtype == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)src + j)), 16));
    if (src_dtype == DT_FP16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)src + j));
    return _mm512_maskz_loadu_ps(mk, (const float *)src + j);
}
#elif DSQUANT_AVX2
/* 8 elements of src from element j -> float32, exactly */
static inline __m256 load8(const void *src, int src_dtype, int64_t j) {
    if (src_dtype == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + j))), 16));
    if (src_dtype == DT_FP16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + j)));
    return _mm256_loadu_ps((const float *)src + j);
}
#endif

static void quantize(int8_t *restrict dst, const void *src, int src_dtype, int64_t n, float scale) {
    int64_t j0 = 0;
#ifdef __AVX512F__
    /* the scalar loop's operations 16 lanes at a time: the IEEE division, round to nearest even, the
     * clamp, NaN -> 0 (a tail masked) */
    const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (; j0 < n; j0 += 16) {
        const __mmask16 mk = tail_mask16(n - j0);
        const __m512 q = _mm512_div_ps(load16(src, src_dtype, j0, mk), vs);
        __m512 r = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __mmask16 num = _mm512_cmp_ps_mask(r, r, _CMP_ORD_Q);
        r = _mm512_maskz_mov_ps(num, _mm512_min_ps(_mm512_max_ps(r, lo), hi));
        _mm_mask_storeu_epi8(dst + j0, mk, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
    }
#elif DSQUANT_AVX2
    /* the same operations 8 lanes at a time over whole vectors; the tail takes the scalar loop (the same
     * IEEE operations, so the same bytes) */
    const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (; j0 + 8 <= n; j0 += 8) {
        const __m256 q = _mm256_div_ps(load8(src, src_dtype, j0), vs);
        __m256 r = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_and_ps(_mm256_cmp_ps(r, r, _CMP_ORD_Q), _mm256_min_ps(_mm256_max_ps(r, lo), hi));
        const __m256i i32 = _mm256_cvtps_epi32(r);           /* in [-127, 127]: the packs below are exact */
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64((__m128i *)(dst + j0), _mm_packs_epi16(i16, i16));
    }
#endif
    for (int64_t j = j0; j < n; j++) {
        float x;
        if (src_dtype == DT_BF16) {
            x = bf16_to_float(((const uint16_t *)src)[j]);
        } else if (src_dtype == DT_FP16) {
            x = half_to_float(((const uint16_t *)src)[j]);
        } else {
            x = ((const float *)src)[j];
        }
        float r = rintf(x / scale);
        r = r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r;
        dst[j] = r == r ? (int8_t)r : 0;
    }
}

/* src [S, cols] of src_dtype (contiguous) -> dst store of dst_dtype; quantize when dst is int8 and src
 * is not (then `scale` is used), else dst_dtype == src_dtype and the bytes are copied. */
int latent_write(const void *src, int src_dtype, int64_t S, int64_t cols, const int64_t *slots,
                 int64_t num_slots, void *dst, int dst_dtype, int64_t block_size, int64_t bstride,
                 int64_t tstride, int64_t kstride, int64_t kwidth, float scale) {
    for (int64_t i = 0; i < S; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return 2;
    const size_t se = dtype_size(src_dtype), de = dtype_size(dst_dtype);
    const int quant = dst_dtype == DT_INT8 && src_dtype != DT_INT8;
    for (int64_t i = 0; i < S; i++) {
        const int64_t blk = slots[i] / block_size, off = slots[i] % block_size;
        char *row = (char *)dst + (size_t)(blk * bstride + off * tstride) * de;
        const char *in = (const char *)src + (size_t)(i * cols) * se;
        for (int64_t j = 0; j < cols; j += kwidth) {
            const int64_t w = cols - j < kwidth ? cols - j : kwidth;
            char *o = row + (size_t)((j / kwidth) * kstride) * de;
            if (quant)
                quantize((int8_t *)o, in + (size_t)j * se, src_dtype, w, scale);
            else
                memcpy(o, in + (size_t)j * se, (size_t)w * de);
            if (w < kwidth) memset(o + (size_t)w * de, 0, (size_t)(kwidth - w) * de);
        }
    }
    return 0;
}
