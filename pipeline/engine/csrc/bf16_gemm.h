/* y = x @ W.T in float32 from W's bfloat16 bits, for few rows (the decode step's): the float linears and
 * the routed experts of the float model (float_ops_cpu.c, float_moe_cpu.c; packed by
 * pipeline.engine.cpu_float.pack_bf16).
 *
 * Layout: W [n, k] bf16 is packed as [ceil(n/16)][ceil(k/2)][16] uint32, the word for (column c, pair s)
 * holding W[c, 2s] in its low half and W[c, 2s+1] in its high half (zero padded). One 64-byte load gives
 * 16 columns x 2 inputs; widening is one shift (low half) or one mask (high half), exact: bf16 -> float32
 * is the high half of the float32.
 *
 * Arithmetic: every output is one float32 accumulator, acc = fma(W[c, j], x[j], acc) for j = 0, 1, ..,
 * k-1 in that order, from 0. The products are the float32 model's products (exact widening); only the
 * summation order (sequential, fused) differs from torch's GEMM, so outputs agree with F.linear within
 * float32 rounding of that order. The order does not depend on m, on the row's place among the rows of a
 * call, nor on the column tiling: a row's result is the same whatever else is in the call.
 * Without AVX-512 the same loops in plain C (acc = acc + w * x, unfused under -ffp-contract=off).
 */
#ifndef DSQUANT_BF16_GEMM_H
#define DSQUANT_BF16_GEMM_H

#include <stdint.h>
#include "dtypes.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline int64_t bf16_gemm_blocks(int64_t n) { return (n + 15) / 16; }
static inline int64_t bf16_gemm_pairs(int64_t k) { return (k + 1) / 2; }

#ifdef __AVX512F__
/* mr rows (pointers xr) x nbk blocks of 16 columns starting at block b0: y[i * ldy + 16 * (b0 + b) + c] */
static inline __attribute__((always_inline)) void bf16_tile(const int mr, const int nbk, const float *const *xr,
                                                            int64_t k, const uint32_t *pack, int64_t b0,
                                                            int64_t n, float *y, int64_t ldy) {
    const int64_t kh = bf16_gemm_pairs(k), full = k / 2;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 8
        for (int b = 0; b < nbk; b++) acc[i][b] = _mm512_setzero_ps();
    const uint32_t *wp = pack + b0 * kh * 16;
    for (int64_t s = 0; s < full; s++) {
        __m512 we[8], wo[8];
#pragma GCC unroll 8
        for (int b = 0; b < nbk; b++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wp + (b * kh + s) * 16));
            we[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            wo[b] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        }
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            const __m512 xe = _mm512_set1_ps(xr[i][2 * s]);
#pragma GCC unroll 8
            for (int b = 0; b < nbk; b++) acc[i][b] = _mm512_fmadd_ps(we[b], xe, acc[i][b]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            const __m512 xo = _mm512_set1_ps(xr[i][2 * s + 1]);
#pragma GCC unroll 8
            for (int b = 0; b < nbk; b++) acc[i][b] = _mm512_fmadd_ps(wo[b], xo, acc[i][b]);
        }
    }
    if (kh > full) {                        /* odd k: the last input alone (x[k] is never read) */
#pragma GCC unroll 8
        for (int b = 0; b < nbk; b++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wp + (b * kh + full) * 16));
            const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++) acc[i][b] = _mm512_fmadd_ps(we, _mm512_set1_ps(xr[i][2 * full]), acc[i][b]);
        }
    }
#pragma GCC unroll 8
    for (int b = 0; b < nbk; b++) {
        const int64_t c0 = 16 * (b0 + b), left = n - c0;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(y + i * ldy + c0, mask, acc[i][b]);
    }
}

#define BF16_TILE_CASE(MR, NB) case NB: bf16_tile(MR, NB, xr, k, pack, b0, n, y, ldy); break;
static void bf16_tile_small(int mr, int nbk, const float *const *xr, int64_t k, const uint32_t *pack, int64_t b0,
                            int64_t n, float *y, int64_t ldy) {      /* mr 1-2: up to 8 blocks (128 columns) */
    if (mr == 1)
        switch (nbk) { BF16_TILE_CASE(1, 1) BF16_TILE_CASE(1, 2) BF16_TILE_CASE(1, 3) BF16_TILE_CASE(1, 4)
                       BF16_TILE_CASE(1, 5) BF16_TILE_CASE(1, 6) BF16_TILE_CASE(1, 7) default: BF16_TILE_CASE(1, 8) }
    else
        switch (nbk) { BF16_TILE_CASE(2, 1) BF16_TILE_CASE(2, 2) BF16_TILE_CASE(2, 3) BF16_TILE_CASE(2, 4)
                       BF16_TILE_CASE(2, 5) BF16_TILE_CASE(2, 6) BF16_TILE_CASE(2, 7) default: BF16_TILE_CASE(2, 8) }
}

static void bf16_tile_large(int mr, int nbk, const float *const *xr, int64_t k, const uint32_t *pack, int64_t b0,
                            int64_t n, float *y, int64_t ldy) {      /* mr 3-4: up to 4 blocks (64 columns) */
    if (mr == 3)
        switch (nbk) { BF16_TILE_CASE(3, 1) BF16_TILE_CASE(3, 2) BF16_TILE_CASE(3, 3) default: BF16_TILE_CASE(3, 4) }
    else
        switch (nbk) { BF16_TILE_CASE(4, 1) BF16_TILE_CASE(4, 2) BF16_TILE_CASE(4, 3) default: BF16_TILE_CASE(4, 4) }
}
#undef BF16_TILE_CASE
#endif

/* y [m, n] (rows ldy apart) = rows xr[0..m) (float32, k each) @ W.T, W packed as above. Columns in panels
 * of 128, the rows 4 at a time within a panel (the panel's weights stay in L1/L2 for the next rows). */
static void bf16_gemm(const float *const *xr, int64_t m, int64_t k, const uint32_t *pack, int64_t n, float *y,
                      int64_t ldy) {
#ifdef __AVX512F__
    const int64_t nb = bf16_gemm_blocks(n);
    for (int64_t p = 0; p < nb; p += 8) {
        const int pn = nb - p < 8 ? (int)(nb - p) : 8;
        for (int64_t r = 0; r < m; r += 4) {
            const int mr = m - r < 4 ? (int)(m - r) : 4;
            float *yr = y + r * ldy;
            if (mr <= 2) {
                bf16_tile_small(mr, pn, xr + r, k, pack, p, n, yr, ldy);
            } else {
                bf16_tile_large(mr, pn < 4 ? pn : 4, xr + r, k, pack, p, n, yr, ldy);
                if (pn > 4) bf16_tile_large(mr, pn - 4, xr + r, k, pack, p + 4, n, yr, ldy);
            }
        }
    }
#else
    const int64_t kh = bf16_gemm_pairs(k);
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < n; c++) {
            const uint32_t *col = pack + (c / 16) * kh * 16 + c % 16;
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                const uint32_t wd = col[(j / 2) * 16];
                acc = acc + bf16_to_float((uint16_t)(j % 2 ? wd >> 16 : wd & 0xffffu)) * xr[i][j];
            }
            y[i * ldy + c] = acc;
        }
#endif
}

#endif
