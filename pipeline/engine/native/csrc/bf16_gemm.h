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
 * Without AVX-512, on AVX2 + FMA, the same fused chain 8 columns to a register (the same bits as AVX-512's);
 * else the same loops in plain C (acc = acc + w * x, unfused under -ffp-contract=off).
 *
 * With AMX (built for a CPU with AMX-BF16 and granted the tile state by the kernel) every call whose k is a
 * multiple of 32 runs on the tiles instead, at any m (so a row's result still never depends on the call):
 * the packed blocks are B tiles as they are (16 pairs x 16 columns), and each row's float32 x is split into
 * three bf16 pieces, hi = x truncated to bf16, mid = (x - hi) truncated, lo = x - hi - mid; each piece holds
 * 8 significant bits of x's 24, so hi + mid + lo == x exactly and every piece's product with W is exact in
 * float32. The tiles sum, per output and per 32 inputs, lo's, then mid's, then hi's products into one
 * float32 accumulator (tdpbf16ps, its own order within the 32): float32 sums of the float32 model's exact
 * products, as the FMA chain, in another order (outputs agree with it within float32 rounding of the
 * order). AMX flushes denormal inputs and outputs to zero (|x| pieces below ~1e-38 are lost).
 */
#ifndef DSQUANT_BF16_GEMM_H
#define DSQUANT_BF16_GEMM_H

#include <stdint.h>
#include "dtypes.h"
#if defined(__AVX512F__) || DSQUANT_AVX2
#include <immintrin.h>
#endif
#include <stdlib.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include "amx.h"
#define BF16_GEMM_AMX 1
#else
#define BF16_GEMM_AMX 0
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
        const __mmask16 mask = tail_mask16(left);
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

#if DSQUANT_AVX2     /* dtypes.h: AVX2 + FMA, no AVX-512 */
/* mr (<= 4) rows (pointers xr) x the block of 16 columns b: y[i * ldy + 16 * b + c], each column's chain of
 * fused multiply-adds in AVX-512's order (two registers of 8 columns per block). */
static inline __attribute__((always_inline)) void bf16_tile_avx2(const int mr, const float *const *xr, int64_t k,
                                                                 const uint32_t *pack, int64_t b, int64_t n,
                                                                 float *y, int64_t ldy) {
    const int64_t kh = bf16_gemm_pairs(k), full = k / 2;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[4][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const uint32_t *wp = pack + b * kh * 16;
    for (int64_t s = 0; s < full; s++) {
        __m256 we[2], wo[2];
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wp + s * 16 + 8 * h));
            we[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            wo[h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
        }
        for (int i = 0; i < mr; i++) {
            const __m256 xe = _mm256_broadcast_ss(xr[i] + 2 * s), xo = _mm256_broadcast_ss(xr[i] + 2 * s + 1);
            for (int h = 0; h < 2; h++) acc[i][h] = _mm256_fmadd_ps(we[h], xe, acc[i][h]);
            for (int h = 0; h < 2; h++) acc[i][h] = _mm256_fmadd_ps(wo[h], xo, acc[i][h]);
        }
    }
    if (kh > full)                          /* odd k: the last input alone (x[k] is never read) */
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wp + full * 16 + 8 * h));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            for (int i = 0; i < mr; i++) acc[i][h] = _mm256_fmadd_ps(we, _mm256_set1_ps(xr[i][2 * full]), acc[i][h]);
        }
    const int64_t c0 = 16 * b, left = n - c0;
    for (int i = 0; i < mr; i++) {
        if (left >= 16) {
            _mm256_storeu_ps(y + i * ldy + c0, acc[i][0]);
            _mm256_storeu_ps(y + i * ldy + c0 + 8, acc[i][1]);
        } else {
            float t[16];
            _mm256_storeu_ps(t, acc[i][0]);
            _mm256_storeu_ps(t + 8, acc[i][1]);
            memcpy(y + i * ldy + c0, t, (size_t)left * sizeof(float));
        }
    }
}
#endif

#if BF16_GEMM_AMX
/* rows xr[0..mr) (k floats each, k % 16 == 0) as three planes of 16 rows x k bf16 (hi, mid, lo; see the
 * header) */
static void bf16_split3(const float *const *xr, int mr, int64_t k, uint16_t *st) {
    const int64_t plane = 16 * k;
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < mr; i++) {
        uint16_t *hi = st + i * k, *mid = hi + plane, *lo = mid + plane;
        const float *x = xr[i];
        for (int64_t j = 0; j < k; j += 16) {
            const __m512 v = _mm512_loadu_ps(x + j);
            const __m512i a = _mm512_and_si512(_mm512_castps_si512(v), top);
            const __m512 r = _mm512_sub_ps(v, _mm512_castsi512_ps(a));
            const __m512i b = _mm512_and_si512(_mm512_castps_si512(r), top);
            const __m512i c = _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(b)));
            _mm256_storeu_si256((__m256i *)(hi + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(a, 16)));
            _mm256_storeu_si256((__m256i *)(mid + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
            _mm256_storeu_si256((__m256i *)(lo + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(c, 16)));
        }
    }
}

#define BF16_AMX_COLUMNS(J)                                                                          \
    if (J < nbk) {                                                                                   \
        _tile_loadd(7, pack + ((b0 + J) * kh + q * 16) * 16, 64);                                    \
        _tile_dpbf16ps(J, 6, 7); _tile_dpbf16ps(J, 5, 7); _tile_dpbf16ps(J, 4, 7);                   \
    }

/* bf16_gemm on the tiles (k % 32 == 0): blocks of up to 16 rows x 64 columns, C tiles 0-3, the rows' hi /
 * mid / lo A tiles 4-6, one B tile (7) at a time; st: 3 x 16 x k bf16 of scratch, cb: 16 x 64 floats. */
static void bf16_gemm_amx(const float *const *xr, int64_t m, int64_t k, const uint32_t *pack, int64_t n,
                          float *y, int64_t ldy, uint16_t *st, float *cb) {
    const int64_t kh = k / 2, nb = bf16_gemm_blocks(n), lds = k * 2;
    int configured = 0;
    for (int64_t r0 = 0; r0 < m; r0 += 16) {
        const int mr = m - r0 < 16 ? (int)(m - r0) : 16;
        if (mr != configured) { amx_load_config_rows(mr, 7); configured = mr; }   /* C, A: mr rows */
        bf16_split3(xr + r0, mr, k, st);
        for (int64_t b0 = 0; b0 < nb; b0 += 4) {
            const int nbk = nb - b0 < 4 ? (int)(nb - b0) : 4;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t q = 0; q < k / 32; q++) {
                _tile_loadd(4, st + q * 32, lds);
                _tile_loadd(5, st + 16 * k + q * 32, lds);
                _tile_loadd(6, st + 32 * k + q * 32, lds);
                BF16_AMX_COLUMNS(0) BF16_AMX_COLUMNS(1) BF16_AMX_COLUMNS(2) BF16_AMX_COLUMNS(3)
            }
            _tile_stored(0, cb, 256); _tile_stored(1, cb + 16, 256);
            _tile_stored(2, cb + 32, 256); _tile_stored(3, cb + 48, 256);
            const int64_t c0 = 16 * b0, nc = n - c0 < 64 ? n - c0 : 64;
            for (int i = 0; i < mr; i++) memcpy(y + (r0 + i) * ldy + c0, cb + i * 64, (size_t)nc * sizeof(float));
        }
    }
    _tile_release();
}
#undef BF16_AMX_COLUMNS
#endif

/* 1 when calls with k % 32 == 0 run on the AMX tiles (built for them and granted). */
static inline int bf16_gemm_has_amx(void) {
#if BF16_GEMM_AMX
    return amx_usable();
#else
    return 0;
#endif
}

/* y [m, n] (rows ldy apart) = rows xr[0..m) (float32, k each) @ W.T, W packed as above. Columns in panels
 * of 128, the rows 4 at a time within a panel (the panel's weights stay in L1/L2 for the next rows); or
 * the AMX tiles (see the header). Returns 0, or 1 (out of memory: the tiles' scratch). */
static int bf16_gemm(const float *const *xr, int64_t m, int64_t k, const uint32_t *pack, int64_t n, float *y,
                     int64_t ldy) {
#if BF16_GEMM_AMX
    if (k % 32 == 0 && m > 0 && amx_usable()) {
        uint16_t *st = (uint16_t *)malloc((size_t)(48 * k) * sizeof(uint16_t) + 16 * 64 * sizeof(float) + 64);
        if (!st) return 1;
        float *cb = (float *)(((uintptr_t)(st + 48 * k) + 63) & ~(uintptr_t)63);
        bf16_gemm_amx(xr, m, k, pack, n, y, ldy, st, cb);
        free(st);
        return 0;
    }
#endif
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
#elif DSQUANT_AVX2
    const int64_t nb = bf16_gemm_blocks(n);
    for (int64_t b = 0; b < nb; b++)
        for (int64_t r = 0; r < m; r += 4) {
            const int mr = m - r < 4 ? (int)(m - r) : 4;
            switch (mr) {
            case 4: bf16_tile_avx2(4, xr + r, k, pack, b, n, y + r * ldy, ldy); break;
            case 3: bf16_tile_avx2(3, xr + r, k, pack, b, n, y + r * ldy, ldy); break;
            case 2: bf16_tile_avx2(2, xr + r, k, pack, b, n, y + r * ldy, ldy); break;
            default: bf16_tile_avx2(1, xr + r, k, pack, b, n, y + r * ldy, ldy); break;
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
    return 0;
}

#endif
