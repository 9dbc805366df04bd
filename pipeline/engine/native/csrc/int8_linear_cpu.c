/* The engine's int8 linears and routed MoE experts on the CPU: quantize the rows, multiply in int32
 * (exact), apply the epilogue, in one call (pipeline/engine/cpu_linear.py and cpu_moe.py load this file).
 *
 * The float32 arithmetic is torch's (pipeline/engine/qlinear.py), op for op, so the results are the same
 * bits; built with -ffp-contract=off (no a*b+c fused into one rounding) and without -ffast-math:
 *   W8A8 (static):  q = clamp(rint(x / scale + offset), -128, 127)
 *                   exact: y = (float)(((double)acc + (double)quant_bias) * (double)deq)
 *                   fast:  y = (float)(acc + quant_bias) * deq
 *   W8A8_DYNAMIC:   s = max(max|x| / 127, eps),  q = clamp(rint(x / s), -128, 127)
 *                   exact: y = (float)(((double)acc * (double)s) * (double)wscale)   (+ bias, float32)
 *                   fast:  y = ((float)acc * s) * wscale                                (+ bias, float32)
 *   bf16 output: round to nearest even from the float32 value (c10::BFloat16's rule).
 * rint rounds half to even in the default rounding mode (torch.round's rule).
 *
 * The integer product: the activations are stored shifted to unsigned (u = q + 128) and the weights are
 * packed once per linear into blocks of 16 output columns x 4 inputs ([np/16][kp/4][16][4] int8, zero
 * padded to np = n rounded up to 64 and kp = k rounded up to 4), the layout of AVX-512 VNNI's vpdpbusd
 * (u8 x s8, four products summed into each int32 lane). sum_j u_j w_j = sum_j q_j w_j + 128 sum_j w_j,
 * so acc = that - wsum with wsum = 128 * row sum of W, computed at packing. Everything is modulo 2^32
 * (vpdpbusd wraps, the subtraction is unsigned) and the true |acc| <= 128 * 128 * k < 2^31 for k <= 131071,
 * so the int32 result is exact. Without AVX-512 VNNI, on AVX2, the same layout is summed with vpmaddwd
 * (both operands widened to int16: u8 -> [0, 255], s8 -> [-128, 127]; each int32 lane gets two exact
 * products, a lane pair per column and step, added at the end; three rows per tile, each row widened to
 * int16 once per panel), the same int32 result; else plain C.
 *
 * With AMX (built for a CPU that has it, and the kernel grants the process the tile state) a call of at
 * least AMX_MIN_ROWS rows and kp a multiple of 64 runs on the tiles instead: tdpbusd is the same u8 x s8
 * product summed into int32 lanes (the packed blocks are B tiles as they are: 16 k-steps x 64 bytes), so
 * the int32 result is the same exact one, bit for bit, whichever unit computes it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "dtypes.h"
#include "pool.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif
#if !HAVE_VNNI && defined(__AVX2__)
#include <immintrin.h>
#define HAVE_AVX2_GEMM 1
#else
#define HAVE_AVX2_GEMM 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include "amx.h"
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

enum { KIND_STATIC = 0, KIND_DYNAMIC = 1 };
enum { EPI_EXACT = 0, EPI_FAST = 1 };
#define COLS 16   /* output columns per packed block */
#define PANEL 4   /* blocks per panel: 64 columns */
#define MR 4      /* rows per register tile */

typedef struct {            /* one linear; filled once by cpu_linear.py (must match LinearParams) */
    int64_t n, k, np, kp;
    const int8_t *wpack;    /* [np/16][kp/4][16][4] */
    const int32_t *wsum;    /* [np]: 128 * sum_j W[i, j] */
    int32_t kind, epilogue;
    float in_scale, in_offset;
    const int32_t *quant_bias;  /* static: [n] */
    const float *deq;           /* static: [n] */
    const float *wscale;        /* dynamic: [n] (float32, exact from bf16 / fp16) */
    const float *bias;          /* dynamic: [n] or NULL */
} linear_t;

int native_has_vnni(void) { return HAVE_VNNI; }

#if HAVE_AMX
#define AMX_MIN_ROWS 32   /* below this many rows the VNNI tiles are as fast (benchmarks/cpu_linear.json) */
#define AMX_ROWS 32       /* rows per AMX block: two 16-row A tiles */
#endif

/* 1 when the AMX tiles take the calls of AMX_MIN_ROWS rows or more (built for them and granted). */
int native_has_amx(void) {
#if HAVE_AMX
    return amx_usable();
#else
    return 0;
#endif
}

static inline float load_x(const void *x, int32_t dt, int64_t i) {
    return dt == DT_BF16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline float clampq(float t) { return t < -128.0f ? -128.0f : (t > 127.0f ? 127.0f : t); }

/* ----- activations ------------------------------------------------------------------------------- */
#if HAVE_VNNI
/* 16 floats at x (bf16 or float32) */
static inline __m512 load16(const void *x, int32_t dt, int64_t i) {
    if (dt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}

/* u8 = clamp(rint(t), -128, 127) + 128 of 16 values, stored (the scalar code's rounding and clamp) */
static inline void store_u8(uint8_t *u, __m512 t) {
    t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
    __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(t), _mm512_set1_epi32(128));
    _mm_storeu_si128((__m128i *)u, _mm512_cvtepi32_epi8(q));
}
#elif HAVE_AVX2_GEMM
/* 8 floats at x (bf16 or float32) */
static inline __m256 load8(const void *x, int32_t dt, int64_t i) {
    if (dt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

/* store_u8 of 8 values (the same rounding and clamp: NaN -> -128 as on AVX-512) */
static inline void store_u8x8(uint8_t *u, __m256 t) {
    t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-128.0f)), _mm256_set1_ps(127.0f));
    const __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(t), _mm256_set1_epi32(128));     /* 0 .. 255 */
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64((__m128i *)u, _mm_packus_epi16(w, w));
}
#endif

static void quant_static(const void *x, int32_t dt, int64_t m, int64_t k, int64_t ldx, float sc, float off,
                         uint8_t *u, int64_t kp) {
    for (int64_t r = 0; r < m; r++) {
        uint8_t *ur = u + r * kp;
        int64_t j = 0;
#if HAVE_VNNI
        const __m512 vs = _mm512_set1_ps(sc), vo = _mm512_set1_ps(off);
        for (; j + 16 <= k; j += 16)
            store_u8(ur + j, _mm512_add_ps(_mm512_div_ps(load16(x, dt, r * ldx + j), vs), vo));
#elif HAVE_AVX2_GEMM
        const __m256 vs = _mm256_set1_ps(sc), vo = _mm256_set1_ps(off);
        for (; j + 8 <= k; j += 8)
            store_u8x8(ur + j, _mm256_add_ps(_mm256_div_ps(load8(x, dt, r * ldx + j), vs), vo));
#endif
        for (; j < k; j++)
            ur[j] = (uint8_t)((int32_t)clampq(rintf(load_x(x, dt, r * ldx + j) / sc + off)) + 128);
        for (j = k; j < kp; j++) ur[j] = 128;
    }
}

/* One row x of k float32 or bf16 (dt) values quantized per token. */
static void quant_dynamic_row(const void *x, int32_t dt, int64_t k, uint8_t *ur, int64_t kp, float *s_out) {
    float amax = 0.0f;
    int64_t j = 0;
#if HAVE_VNNI
    __m512 vm = _mm512_setzero_ps();      /* max(a, vm) keeps vm when a is NaN, as the scalar loop does */
    for (; j + 16 <= k; j += 16) vm = _mm512_max_ps(_mm512_abs_ps(load16(x, dt, j)), vm);
    amax = _mm512_reduce_max_ps(vm);
#elif HAVE_AVX2_GEMM
    __m256 vm = _mm256_setzero_ps();      /* max(a, vm) keeps vm when a is NaN, as the scalar loop does */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; j + 8 <= k; j += 8) vm = _mm256_max_ps(_mm256_and_ps(load8(x, dt, j), absmask), vm);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
    for (; j < k; j++) {
        float a = fabsf(load_x(x, dt, j));
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.0f;
    const float eps = 1.1920928955078125e-07f;          /* torch.finfo(float32).eps */
    s = s < eps ? eps : s;
    j = 0;
#if HAVE_VNNI
    const __m512 vs = _mm512_set1_ps(s);
    for (; j + 16 <= k; j += 16) store_u8(ur + j, _mm512_div_ps(load16(x, dt, j), vs));
#elif HAVE_AVX2_GEMM
    const __m256 vs = _mm256_set1_ps(s);
    for (; j + 8 <= k; j += 8) store_u8x8(ur + j, _mm256_div_ps(load8(x, dt, j), vs));
#endif
    for (; j < k; j++) ur[j] = (uint8_t)((int32_t)clampq(rintf(load_x(x, dt, j) / s)) + 128);
    for (j = k; j < kp; j++) ur[j] = 128;
    *s_out = s;
}

static void quant_dynamic(const void *x, int32_t dt, int64_t m, int64_t k, int64_t ldx, uint8_t *u, int64_t kp,
                          float *s) {
    for (int64_t r = 0; r < m; r++)
        quant_dynamic_row((const char *)x + (size_t)(r * ldx) * dtype_size(dt), dt, k, u + r * kp, kp, s + r);
}

static void shift_int8(const int8_t *q, int64_t m, int64_t k, uint8_t *u, int64_t kp) {
    for (int64_t r = 0; r < m; r++) {
        for (int64_t j = 0; j < k; j++) u[r * kp + j] = (uint8_t)((int32_t)q[r * k + j] + 128);
        for (int64_t j = k; j < kp; j++) u[r * kp + j] = 128;
    }
}

/* ----- weights ------------------------------------------------------------------------------------ */
void int8_pack(const int8_t *w, int64_t n, int64_t k, int64_t np, int64_t kp, int8_t *pack, int32_t *wsum) {
    int64_t ks = kp / 4;
    memset(pack, 0, (size_t)(np * kp));
    for (int64_t i = 0; i < np; i++) {
        int64_t sum = 0;
        if (i < n) {
            int8_t *blk = pack + (i / COLS) * ks * 64 + (i % COLS) * 4;
            for (int64_t j = 0; j < k; j++) {
                blk[(j / 4) * 64 + (j % 4)] = w[i * k + j];
                sum += w[i * k + j];
            }
        }
        wsum[i] = (int32_t)(uint32_t)(128 * sum);
    }
}

/* ----- the exact product: c[r][0..np) = sum_j (a[r][j] - 128) * W[i][j] ------------------------------ */
#if HAVE_VNNI
/* One register tile: mr (<= 4) rows x 64 columns, all of k; c = acc - wsum, stored. Accumulators for
 * even and odd k steps apart when mr <= 2, so that enough independent vpdpbusd chains are in flight. */
static inline __attribute__((always_inline)) void tile(const int mr, const uint8_t *const *ar, const int8_t *wb,
                                                       int64_t ks, const int32_t *sb, int32_t *c, int64_t ldc) {
    const int split = mr <= 2;
    __m512i acc[2][MR][PANEL];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < mr; i++)
            for (int b = 0; b < PANEL; b++) acc[h][i][b] = _mm512_setzero_si512();
    int64_t s = 0;
    if (split)
        for (; s + 1 < ks; s += 2)
            for (int h = 0; h < 2; h++) {
                __m512i w[PANEL];
                for (int b = 0; b < PANEL; b++)
                    w[b] = _mm512_loadu_si512((const void *)(wb + (b * ks + s + h) * 64));
                for (int i = 0; i < mr; i++) {
                    int32_t a4;
                    memcpy(&a4, ar[i] + 4 * (s + h), 4);
                    __m512i av = _mm512_set1_epi32(a4);
                    for (int b = 0; b < PANEL; b++) acc[h][i][b] = _mm512_dpbusd_epi32(acc[h][i][b], av, w[b]);
                }
            }
    for (; s < ks; s++) {
        __m512i w[PANEL];
        for (int b = 0; b < PANEL; b++) w[b] = _mm512_loadu_si512((const void *)(wb + (b * ks + s) * 64));
        for (int i = 0; i < mr; i++) {
            int32_t a4;
            memcpy(&a4, ar[i] + 4 * s, 4);
            __m512i av = _mm512_set1_epi32(a4);
            for (int b = 0; b < PANEL; b++) acc[0][i][b] = _mm512_dpbusd_epi32(acc[0][i][b], av, w[b]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int b = 0; b < PANEL; b++) {
            __m512i v = split ? _mm512_add_epi32(acc[0][i][b], acc[1][i][b]) : acc[0][i][b];
            v = _mm512_sub_epi32(v, _mm512_loadu_si512((const void *)(sb + b * COLS)));
            _mm512_storeu_si512((void *)(c + i * ldc + b * COLS), v);
        }
}
#endif

#if HAVE_AVX2_GEMM
#define MR_AVX2 3   /* rows per AVX2 tile: each widened weight vector serves 3 rows (measured 1.3x two) */
/* mr (<= 3) rows x one block of 16 columns, all of k, on AVX2. The rows come widened to int16 (u16: the
 * caller's widen_rows, once per row and panel); a step's 4 activations (8 bytes, repeated 4 times) meet 4
 * columns' 4 weights (16 int16): vpmaddwd leaves per column two int32 lanes (inputs 0+1, 2+3), summed
 * over the steps; hadd joins each column's two lanes at the end. */
static inline __attribute__((always_inline)) void tile_avx2(const int mr, const uint16_t *const *ar,
                                                            const int8_t *wbb, int64_t ks, const int32_t *sbb,
                                                            int32_t *c, int64_t ldc) {
    __m256i acc[MR_AVX2][4];
    for (int i = 0; i < mr; i++)
        for (int g = 0; g < 4; g++) acc[i][g] = _mm256_setzero_si256();
    for (int64_t s = 0; s < ks; s++) {
        __m256i a[MR_AVX2];
        for (int i = 0; i < mr; i++) {
            int64_t a4;
            memcpy(&a4, ar[i] + 4 * s, 8);
            a[i] = _mm256_set1_epi64x(a4);
        }
        for (int g = 0; g < 4; g++) {
            const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wbb + s * 64 + g * 16)));
            for (int i = 0; i < mr; i++) acc[i][g] = _mm256_add_epi32(acc[i][g], _mm256_madd_epi16(w, a[i]));
        }
    }
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) {          /* columns 8h .. 8h+7: [c0 c1 c4 c5 | c2 c3 c6 c7], reordered */
            __m256i v = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[i][2 * h], acc[i][2 * h + 1]), 0xD8);
            v = _mm256_sub_epi32(v, _mm256_loadu_si256((const __m256i *)(sbb + 8 * h)));
            _mm256_storeu_si256((__m256i *)(c + i * ldc + 8 * h), v);
        }
}

/* rows a[r] (u8, kp of them) -> w16 [mr][kp] u16 */
static void widen_rows(const uint8_t *const *ar, int mr, int64_t kp, uint16_t *w16) {
    for (int i = 0; i < mr; i++) {
        uint16_t *d = w16 + i * kp;
        int64_t j = 0;
        for (; j + 16 <= kp; j += 16)
            _mm256_storeu_si256((__m256i *)(d + j), _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(ar[i] + j))));
        for (; j < kp; j++) d[j] = ar[i][j];
    }
}
#endif

/* A thread's scratch, kept between calls (the pool's workers and the caller each have their own): the AVX2
 * tiles' widened rows, the AMX tiles' staged rows. */
static __thread void *tl_buf;
static __thread size_t tl_cap;

static __attribute__((unused)) void *thread_scratch(size_t bytes) {
    if (bytes > tl_cap) {
        void *p = realloc(tl_buf, bytes);
        if (!p) return NULL;
        tl_buf = p;
        tl_cap = bytes;
    }
    return tl_buf;
}

#if HAVE_AMX
/* Panels [p0, p1) of gemm_panels() on the AMX tiles, kp % 64 == 0: blocks of 32 rows x 32 columns (C tiles
 * 0-3, the rows' A tiles 4-5, the columns' B tiles 6-7), k in steps of 64. A block of gathered rows
 * (``rows``) or the last, short block is copied into ``stage`` [32][kp] first; c must have room for m
 * rounded up to 32 rows (the extra rows are scratch). The tile configuration is loaded on every call (it is
 * per thread, and other code on this thread, oneDNN's, may have changed it) and released at the end. */
static void gemm_amx(const uint8_t *a, int64_t lda, const int64_t *rows, int64_t m, const int8_t *wpack,
                     const int32_t *wsum, int64_t kp, int32_t *c, int64_t ldc, int64_t p0, int64_t p1,
                     uint8_t *stage) {
    int64_t ks = kp / 4, kc = kp / 64, ldb = ldc * 4;
    amx_load_config();
    for (int64_t r0 = 0; r0 < m; r0 += AMX_ROWS) {
        int64_t mr = m - r0 < AMX_ROWS ? m - r0 : AMX_ROWS;
        const uint8_t *ab = a + r0 * lda;
        int64_t ld = lda;
        if (rows || mr < AMX_ROWS) {
            for (int64_t i = 0; i < AMX_ROWS; i++) {
                if (i < mr) memcpy(stage + i * kp, a + (rows ? rows[r0 + i] : r0 + i) * lda, (size_t)kp);
                else memset(stage + i * kp, 128, (size_t)kp);
            }
            ab = stage;
            ld = kp;
        }
        for (int64_t cb = p0 * PANEL; cb < p1 * PANEL; cb += 2) {
            const int8_t *b0 = wpack + cb * ks * 64, *b1 = b0 + ks * 64;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t q = 0; q < kc; q++) {
                _tile_loadd(4, ab + q * 64, ld);
                _tile_loadd(5, ab + 16 * ld + q * 64, ld);
                _tile_loadd(6, b0 + q * 16 * 64, 64);
                _tile_loadd(7, b1 + q * 16 * 64, 64);
                _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7);
                _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
            }
            int32_t *cp = c + r0 * ldc + cb * COLS;
            _tile_stored(0, cp, ldb); _tile_stored(1, cp + COLS, ldb);
            _tile_stored(2, cp + 16 * ldc, ldb); _tile_stored(3, cp + 16 * ldc + COLS, ldb);
        }
        for (int64_t i = 0; i < mr; i++) {
            uint32_t *cr = (uint32_t *)(c + (r0 + i) * ldc);
            for (int64_t j = p0 * COLS * PANEL; j < p1 * COLS * PANEL; j++) cr[j] -= (uint32_t)wsum[j];
        }
    }
    _tile_release();
}
#endif

/* The exact product of m rows (a[r] = a + r * lda, or a + rows[r] * lda) with the packed weight, for the
 * output panels [p0, p1) (64 columns each): c[r][j] (row stride ldc) for j in those panels. The result of a
 * panel does not depend on which others are computed with it, nor on the thread. Returns -1 when a thread's
 * scratch cannot be had. c must have room for m rounded up to 32 rows where the AMX tiles may run. */
static int gemm_panels(const uint8_t *a, int64_t lda, const int64_t *rows, int64_t m, const int8_t *wpack,
                       const int32_t *wsum, int64_t kp, int32_t *c, int64_t ldc, int64_t p0, int64_t p1) {
    int64_t ks = kp / 4;
#if HAVE_AMX
    if (m >= AMX_MIN_ROWS && kp % 64 == 0 && amx_usable()) {
        uint8_t *stage = thread_scratch((size_t)(AMX_ROWS * kp));
        if (!stage) return -1;
        gemm_amx(a, lda, rows, m, wpack, wsum, kp, c, ldc, p0, p1, stage);
        return 0;
    }
#endif
#if HAVE_AVX2_GEMM
    uint16_t *stage16 = thread_scratch((size_t)(MR_AVX2 * kp) * 2);
    if (!stage16) return -1;
    for (int64_t p = p0; p < p1; p++) {
        const int8_t *wb = wpack + p * PANEL * ks * 64;
        const int32_t *sb = wsum + p * COLS * PANEL;
        for (int64_t r0 = 0; r0 < m; r0 += MR_AVX2) {
            int mr = (int)(m - r0 < MR_AVX2 ? m - r0 : MR_AVX2);
            const uint8_t *ar[MR_AVX2];
            const uint16_t *wr[MR_AVX2];
            for (int i = 0; i < mr; i++) {
                ar[i] = a + (rows ? rows[r0 + i] : r0 + i) * lda;
                wr[i] = stage16 + i * kp;
            }
            widen_rows(ar, mr, kp, stage16);
            int32_t *cp = c + r0 * ldc + p * COLS * PANEL;
            for (int b = 0; b < PANEL; b++) {
                const int8_t *wbb = wb + b * ks * 64;
                switch (mr) {
                case 3: tile_avx2(3, wr, wbb, ks, sb + b * COLS, cp + b * COLS, ldc); break;
                case 2: tile_avx2(2, wr, wbb, ks, sb + b * COLS, cp + b * COLS, ldc); break;
                default: tile_avx2(1, wr, wbb, ks, sb + b * COLS, cp + b * COLS, ldc); break;
                }
            }
        }
    }
#else
    for (int64_t p = p0; p < p1; p++) {
        const int8_t *wb = wpack + p * PANEL * ks * 64;
        const int32_t *sb = wsum + p * COLS * PANEL;
        for (int64_t r0 = 0; r0 < m; r0 += MR) {
            int mr = (int)(m - r0 < MR ? m - r0 : MR);
            const uint8_t *ar[MR];
            for (int i = 0; i < mr; i++) ar[i] = a + (rows ? rows[r0 + i] : r0 + i) * lda;
            int32_t *cp = c + r0 * ldc + p * COLS * PANEL;
#if HAVE_VNNI
            switch (mr) {
            case 4: tile(4, ar, wb, ks, sb, cp, ldc); break;
            case 3: tile(3, ar, wb, ks, sb, cp, ldc); break;
            case 2: tile(2, ar, wb, ks, sb, cp, ldc); break;
            default: tile(1, ar, wb, ks, sb, cp, ldc); break;
            }
#else
            for (int i = 0; i < mr; i++)
                for (int b = 0; b < PANEL; b++) {
                    uint32_t acc[COLS] = {0};
                    const int8_t *wbb = wb + b * ks * 64;
                    for (int64_t s = 0; s < ks; s++)
                        for (int col = 0; col < COLS; col++)
                            for (int t = 0; t < 4; t++)
                                acc[col] += (uint32_t)((int32_t)ar[i][4 * s + t] * wbb[s * 64 + col * 4 + t]);
                    for (int col = 0; col < COLS; col++)
                        cp[i * ldc + b * COLS + col] = (int32_t)(acc[col] - (uint32_t)sb[b * COLS + col]);
                }
#endif
        }
    }
#endif
    return 0;
}

/* ----- epilogues ---------------------------------------------------------------------------------- */
static inline float epi_dynamic(int32_t epi, int32_t acc, float s, float ws) {
    if (epi == EPI_EXACT) return (float)(((double)acc * (double)s) * (double)ws);
    return ((float)acc * s) * ws;
}

/* One output of the linear's epilogue (the header's formulas), bias included when use_bias. */
static inline float epi1(const linear_t *L, const int32_t *cr, float s, int64_t j, int use_bias) {
    if (L->kind == KIND_STATIC) {
        if (L->epilogue == EPI_EXACT) return (float)(((double)cr[j] + (double)L->quant_bias[j]) * (double)L->deq[j]);
        return (float)(int32_t)((uint32_t)cr[j] + (uint32_t)L->quant_bias[j]) * L->deq[j];
    }
    float v = epi_dynamic(L->epilogue, cr[j], s, L->wscale[j]);
    return use_bias && L->bias ? v + L->bias[j] : v;
}

#if HAVE_VNNI
static inline __m512d lo_pd(__m512i v) { return _mm512_cvtepi32_pd(_mm512_castsi512_si256(v)); }
static inline __m512d hi_pd(__m512i v) { return _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(v, 1)); }
static inline __m512d lo_psd(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
static inline __m512d hi_psd(__m512 v) { return _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)); }
static inline __m512 join_ps(__m512d lo, __m512d hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo)), _mm512_cvtpd_ps(hi), 1);
}

/* epi_dynamic of 16 products c with the row's scale s and the columns' scales ws */
static inline __m512 epi_dynamic16(int32_t epi, __m512i c, float s, __m512 ws) {
    if (epi == EPI_FAST) return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(s)), ws);
    const __m512d sd = _mm512_set1_pd((double)s);
    return join_ps(_mm512_mul_pd(_mm512_mul_pd(lo_pd(c), sd), lo_psd(ws)),
                   _mm512_mul_pd(_mm512_mul_pd(hi_pd(c), sd), hi_psd(ws)));
}

/* epi1 of 16 outputs j .. j + 15: the same operations on vector lanes (float64 ones for ``exact``) */
static inline __m512 epi16(const linear_t *L, const int32_t *cr, float s, int64_t j, int use_bias) {
    __m512i c = _mm512_loadu_si512((const void *)(cr + j));
    if (L->kind == KIND_STATIC) {
        __m512i qb = _mm512_loadu_si512((const void *)(L->quant_bias + j));
        __m512 deq = _mm512_loadu_ps(L->deq + j);
        if (L->epilogue == EPI_FAST) return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(c, qb)), deq);
        return join_ps(_mm512_mul_pd(_mm512_add_pd(lo_pd(c), lo_pd(qb)), lo_psd(deq)),
                       _mm512_mul_pd(_mm512_add_pd(hi_pd(c), hi_pd(qb)), hi_psd(deq)));
    }
    const __m512 v = epi_dynamic16(L->epilogue, c, s, _mm512_loadu_ps(L->wscale + j));
    return use_bias && L->bias ? _mm512_add_ps(v, _mm512_loadu_ps(L->bias + j)) : v;
}

/* float_to_bf16 then back to float32, on 16 lanes (the MoE's cast of an expert's output to bf16) */
static inline __m512 round_bf16_ps(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_mov_epi32(_mm512_slli_epi32(_mm512_srli_epi32(r, 16), 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}

/* float32 -> bf16 bits of 16 values: float_to_bf16's rounding (the high halves of round_bf16_ps) */
static inline void store_bf16x16(uint16_t *y, __m512 v) {
    const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(v)), 16);
    _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(r));
}
#elif HAVE_AVX2_GEMM
static inline __m256 join8(__m256d lo, __m256d hi) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(lo)), _mm256_cvtpd_ps(hi), 1);
}
static inline __m256d lo_pd8(__m256i v) { return _mm256_cvtepi32_pd(_mm256_castsi256_si128(v)); }
static inline __m256d hi_pd8(__m256i v) { return _mm256_cvtepi32_pd(_mm256_extracti128_si256(v, 1)); }
static inline __m256d lo_psd8(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
static inline __m256d hi_psd8(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }

/* epi_dynamic of 8 products */
static inline __m256 epi_dynamic8(int32_t epi, __m256i c, float s, __m256 ws) {
    if (epi == EPI_FAST) return _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(s)), ws);
    const __m256d sd = _mm256_set1_pd((double)s);
    return join8(_mm256_mul_pd(_mm256_mul_pd(lo_pd8(c), sd), lo_psd8(ws)),
                 _mm256_mul_pd(_mm256_mul_pd(hi_pd8(c), sd), hi_psd8(ws)));
}

/* epi1 of 8 outputs j .. j + 7 */
static inline __m256 epi8v(const linear_t *L, const int32_t *cr, float s, int64_t j, int use_bias) {
    const __m256i c = _mm256_loadu_si256((const __m256i *)(cr + j));
    if (L->kind == KIND_STATIC) {
        const __m256i qb = _mm256_loadu_si256((const __m256i *)(L->quant_bias + j));
        const __m256 deq = _mm256_loadu_ps(L->deq + j);
        if (L->epilogue == EPI_FAST) return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(c, qb)), deq);
        return join8(_mm256_mul_pd(_mm256_add_pd(lo_pd8(c), lo_pd8(qb)), lo_psd8(deq)),
                     _mm256_mul_pd(_mm256_add_pd(hi_pd8(c), hi_pd8(qb)), hi_psd8(deq)));
    }
    const __m256 v = epi_dynamic8(L->epilogue, c, s, _mm256_loadu_ps(L->wscale + j));
    return use_bias && L->bias ? _mm256_add_ps(v, _mm256_loadu_ps(L->bias + j)) : v;
}

/* round_bf16_ps on 8 lanes */
static inline __m256 round_bf16_8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_slli_epi32(_mm256_srli_epi32(r, 16), 16);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* float32 -> bf16 bits of 8 values (float_to_bf16's rounding) */
static inline void store_bf16x8(uint16_t *y, __m256 v) {
    const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(v)), 16);
    _mm_storeu_si128((__m128i *)y, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

/* Columns [j0, j1) of m rows' epilogue: int32 products c (row stride ldc) -> y [m, n] in dt. */
static void epilogue_cols(const linear_t *L, const int32_t *c, int64_t ldc, const float *s, int64_t m,
                          int use_bias, void *y, int32_t dt, int64_t j0, int64_t j1) {
    int64_t n = L->n;
    for (int64_t r = 0; r < m; r++) {
        const int32_t *cr = c + r * ldc;
        float sr = L->kind == KIND_STATIC ? 0.0f : s[r];
        int64_t j = j0;
#if HAVE_VNNI
        for (; j + 16 <= j1; j += 16) {
            __m512 v = epi16(L, cr, sr, j, use_bias);
            if (dt == DT_BF16) store_bf16x16((uint16_t *)y + r * n + j, v);
            else _mm512_storeu_ps((float *)y + r * n + j, v);
        }
#elif HAVE_AVX2_GEMM
        for (; j + 8 <= j1; j += 8) {
            __m256 v = epi8v(L, cr, sr, j, use_bias);
            if (dt == DT_BF16) store_bf16x8((uint16_t *)y + r * n + j, v);
            else _mm256_storeu_ps((float *)y + r * n + j, v);
        }
#endif
        for (; j < j1; j++) {
            float v = epi1(L, cr, sr, j, use_bias);
            if (dt == DT_BF16) ((uint16_t *)y)[r * n + j] = float_to_bf16(v);
            else ((float *)y)[r * n + j] = v;
        }
    }
}

/* scratch for m rows: int32 products [m + 32][np] (gemm_amx's last block writes whole tiles), scales [m],
 * u8 activations [m][kp] */
typedef struct { uint8_t *u; int32_t *c; float *s; } scratch_t;

static int scratch(scratch_t *t, int64_t m, int64_t kp, int64_t np) {
    size_t cb = (size_t)((m + 32) * np) * 4, sb = (size_t)m * 4, ub = (size_t)(m * kp);
    char *p = malloc(cb + sb + ub + 64);
    if (!p) return -1;
    t->c = (int32_t *)p;
    t->s = (float *)(p + cb);
    t->u = (uint8_t *)(p + cb + sb);
    return 0;
}

/* ----- the calls, split over the pool (pool.h): rows for the quantization, output panels for the rest ---- */
#define QUANT_ROWS 8      /* rows per quantization task */

typedef struct {          /* quantize m rows of x (static with scale/offset, or dynamic: scales into s) */
    int32_t kind, dt;
    const void *x;
    int64_t m, k, ldx, kp;
    float in_scale, in_offset;
    uint8_t *u;
    float *s;
} quant_job_t;

static void quant_task(void *ctx, int64_t i) {
    const quant_job_t *J = ctx;
    const int64_t r0 = i * QUANT_ROWS, mr = J->m - r0 < QUANT_ROWS ? J->m - r0 : QUANT_ROWS;
    const void *xr = (const char *)J->x + (size_t)(r0 * J->ldx) * dtype_size(J->dt);
    if (J->kind == KIND_STATIC)
        quant_static(xr, J->dt, mr, J->k, J->ldx, J->in_scale, J->in_offset, J->u + r0 * J->kp, J->kp);
    else
        quant_dynamic(xr, J->dt, mr, J->k, J->ldx, J->u + r0 * J->kp, J->kp, J->s + r0);
}

static void quantize_rows(int32_t kind, const void *x, int32_t dt, int64_t m, int64_t k, int64_t ldx, float sc,
                          float off, uint8_t *u, int64_t kp, float *s) {
    quant_job_t J = {kind, dt, x, m, k, ldx, kp, sc, off, u, s};
    pool_run(quant_task, &J, (m + QUANT_ROWS - 1) / QUANT_ROWS);
}

enum { OUT_LINEAR = 0, OUT_DYNAMIC_F32 = 1, OUT_INT32 = 2 };

typedef struct {          /* one row block of a linear: the product and the output, panel by panel */
    const linear_t *L;
    const uint8_t *u;
    int64_t m;
    int32_t *c;
    const float *s;
    void *y;
    int32_t dt, out;
    _Atomic int err;
} linear_job_t;

static void linear_task(void *ctx, int64_t p) {
    linear_job_t *J = ctx;
    const linear_t *L = J->L;
    if (gemm_panels(J->u, L->kp, NULL, J->m, L->wpack, L->wsum, L->kp, J->c, L->np, p, p + 1)) {
        J->err = 1;
        return;
    }
    const int64_t j0 = p * COLS * PANEL, j1 = L->n < j0 + COLS * PANEL ? L->n : j0 + COLS * PANEL;
    if (J->out == OUT_INT32) {
        for (int64_t r = 0; r < J->m && j0 < j1; r++)
            memcpy((int32_t *)J->y + r * L->n + j0, J->c + r * L->np + j0, (size_t)(j1 - j0) * 4);
    } else if (j0 < j1) {
        epilogue_cols(L, J->c, L->np, J->s, J->m, J->out == OUT_LINEAR, J->y, J->dt, j0, j1);
    }
}

/* Rows are done ROW_BLOCK at a time (quantize, product, epilogue), so that the int32 products and the u8
 * rows of a block stay in L2 between the three passes instead of streaming through memory (a 2048-row
 * call's [2048, 576] int32 products are 4.7 MB); a row's result is the same whatever block it is in. */
#define ROW_BLOCK 128

/* y [m, n] (x's dtype) = the linear of x [m, k] (row stride ldx). Returns 0, or -1 when out of memory. */
int int8_linear(const linear_t *L, const void *x, int64_t m, int64_t ldx, int32_t dt, void *y) {
    scratch_t t = {0};
    const int64_t rb = m < ROW_BLOCK ? m : ROW_BLOCK;
    const size_t es = dtype_size(dt);
    if (scratch(&t, rb, L->kp, L->np)) return -1;
    int rc = 0;
    for (int64_t r0 = 0; r0 < m && !rc; r0 += rb) {
        const int64_t mr = m - r0 < rb ? m - r0 : rb;
        quantize_rows(L->kind, (const char *)x + (size_t)(r0 * ldx) * es, dt, mr, L->k, ldx, L->in_scale,
                      L->in_offset, t.u, L->kp, t.s);
        linear_job_t J = {L, t.u, mr, t.c, t.s, (char *)y + (size_t)(r0 * L->n) * es, dt, OUT_LINEAR, 0};
        pool_run(linear_task, &J, L->np / (COLS * PANEL));
        rc = J.err ? -1 : 0;
    }
    free(t.c);
    return rc;
}

/* Already quantized rows q int8 [m, k]: the exact product int32 [m, n] (s == NULL), or the dynamic
 * epilogue with the per-token scales s [m] into float32 y [m, n] (no bias: Int8Linear.apply_quantized). */
int int8_linear_q(const linear_t *L, const int8_t *q, const float *s, int64_t m, void *y) {
    scratch_t t = {0};
    const int64_t rb = m < ROW_BLOCK ? m : ROW_BLOCK;
    if (scratch(&t, rb, L->kp, L->np)) return -1;
    int rc = 0;
    for (int64_t r0 = 0; r0 < m && !rc; r0 += rb) {
        const int64_t mr = m - r0 < rb ? m - r0 : rb;
        shift_int8(q + r0 * L->k, mr, L->k, t.u, L->kp);
        linear_job_t J = {L, t.u, mr, t.c, s ? s + r0 : NULL, (char *)y + (size_t)(r0 * L->n) * 4, DT_F32,
                          s ? OUT_DYNAMIC_F32 : OUT_INT32, 0};
        pool_run(linear_task, &J, L->np / (COLS * PANEL));
        rc = J.err ? -1 : 0;
    }
    free(t.c);
    return rc;
}

/* ----- the routed experts (cpu_moe.py) ------------------------------------------------------------ */
typedef struct {            /* must match cpu_moe.MoEParams */
    int64_t E, H, I;
    int64_t gu_np, gu_kp, dn_np, dn_kp;   /* gate+up [2I, H] and down [H, I], padded */
    const int8_t *gu_pack;  /* E x [gu_np * gu_kp] */
    const int32_t *gu_sum;  /* E x [gu_np] */
    const float *gu_scale;  /* E x [2I] */
    const int8_t *dn_pack;  /* E x [dn_np * dn_kp] */
    const int32_t *dn_sum;  /* E x [dn_np] */
    const float *dn_scale;  /* E x [H] */
    int32_t epilogue;
} moe_t;

typedef struct {          /* the routed experts' gate+up, panel by panel (every expert's rows in turn) */
    const moe_t *M;
    const uint8_t *u;
    const int64_t *tok, *start;
    int32_t *c;
    const float *s;
    float *gu;
    _Atomic int err;
} gate_up_job_t;

static void gate_up_task(void *ctx, int64_t p) {
    gate_up_job_t *J = ctx;
    const moe_t *M = J->M;
    const int64_t I2 = 2 * M->I, j0 = p * COLS * PANEL, j1 = I2 < j0 + COLS * PANEL ? I2 : j0 + COLS * PANEL;
    for (int64_t e = 0; e < M->E; e++) {
        const int64_t n_e = J->start[e + 1] - J->start[e];
        if (!n_e) continue;
        if (gemm_panels(J->u, M->gu_kp, J->tok + J->start[e], n_e, M->gu_pack + e * M->gu_np * M->gu_kp,
                        M->gu_sum + e * M->gu_np, M->gu_kp, J->c, M->gu_np, p, p + 1)) {
            J->err = 1;
            return;
        }
        const float *ws = M->gu_scale + e * I2;
        for (int64_t r = 0; r < n_e; r++) {
            const float s = J->s[J->tok[J->start[e] + r]];
            float *g = J->gu + (J->start[e] + r) * I2;
            const int32_t *cr = J->c + r * M->gu_np;
            int64_t j = j0;
#if HAVE_VNNI
            for (; j + 16 <= j1; j += 16)
                _mm512_storeu_ps(g + j, epi_dynamic16(M->epilogue, _mm512_loadu_si512((const void *)(cr + j)), s,
                                                      _mm512_loadu_ps(ws + j)));
#elif HAVE_AVX2_GEMM
            for (; j + 8 <= j1; j += 8)
                _mm256_storeu_ps(g + j, epi_dynamic8(M->epilogue, _mm256_loadu_si256((const __m256i *)(cr + j)), s,
                                                     _mm256_loadu_ps(ws + j)));
#endif
            for (; j < j1; j++) g[j] = epi_dynamic(M->epilogue, cr[j], s, ws[j]);
        }
    }
}

/* Routes the N * top_k slots: order [S] (slot ids sorted by expert, stable: torch.argsort(stable=True)),
 * load [E] (slots per expert); and gu [S, 2I] float32 = expert idx[slot]'s stacked gate and up projections
 * of the slot's token, the tokens x [N, H] quantized per token once. Returns 0, -1 (out of memory) or
 * -2 (an expert id outside [0, E)). */
int moe_gate_up(const moe_t *M, const void *x, int32_t dt, int64_t N, int64_t top_k, const int64_t *idx,
                int64_t *order, int64_t *load, float *gu) {
    int64_t S = N * top_k;
    for (int64_t e = 0; e < M->E; e++) load[e] = 0;
    for (int64_t i = 0; i < S; i++) {
        if (idx[i] < 0 || idx[i] >= M->E) return -2;
        load[idx[i]]++;
    }
    int64_t *start = malloc((size_t)(M->E + 1) * 8 + (size_t)S * 8);
    if (!start) return -1;
    int64_t *tok = start + M->E + 1;
    start[0] = 0;
    for (int64_t e = 0; e < M->E; e++) start[e + 1] = start[e] + load[e];
    for (int64_t i = 0; i < S; i++) order[start[idx[i]]++] = i;   /* counting sort: stable */
    for (int64_t e = M->E; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    for (int64_t i = 0; i < S; i++) tok[i] = order[i] / top_k;
    scratch_t t = {0};
    int64_t rows = N > S ? N : S;
    if (scratch(&t, rows, M->gu_kp, M->gu_np)) { free(start); return -1; }
    quantize_rows(KIND_DYNAMIC, x, dt, N, M->H, M->H, 0.0f, 0.0f, t.u, M->gu_kp, t.s);
    gate_up_job_t J = {M, t.u, tok, start, t.c, t.s, gu, 0};
    pool_run(gate_up_task, &J, M->gu_np / (COLS * PANEL));
    free(t.c);
    free(start);
    return J.err ? -1 : 0;
}

typedef struct {          /* the routed experts' down projections, panel by panel, added in slot order */
    const moe_t *M;
    const uint8_t *u;
    const int64_t *order, *load;
    int64_t top_k;
    int32_t *c;
    const float *s, *weights;
    float *out;
    int32_t dt;
    _Atomic int err;
} down_job_t;

static void down_task(void *ctx, int64_t p) {
    down_job_t *J = ctx;
    const moe_t *M = J->M;
    const int64_t H = M->H, j0 = p * COLS * PANEL, j1 = H < j0 + COLS * PANEL ? H : j0 + COLS * PANEL;
    for (int64_t e = 0, r0 = 0; e < M->E; r0 += J->load[e], e++) {
        if (!J->load[e]) continue;
        if (gemm_panels(J->u + r0 * M->dn_kp, M->dn_kp, NULL, J->load[e], M->dn_pack + e * M->dn_np * M->dn_kp,
                        M->dn_sum + e * M->dn_np, M->dn_kp, J->c, M->dn_np, p, p + 1)) {
            J->err = 1;
            return;
        }
        const float *ws = M->dn_scale + e * H;
        for (int64_t r = 0; r < J->load[e]; r++) {
            const int64_t slot = J->order[r0 + r];
            const float w = J->weights[slot], s = J->s[r0 + r];
            float *o = J->out + (slot / J->top_k) * H;
            const int32_t *cr = J->c + r * M->dn_np;
            int64_t j = j0;
#if HAVE_VNNI
            for (; j + 16 <= j1; j += 16) {
                __m512 v = epi_dynamic16(M->epilogue, _mm512_loadu_si512((const void *)(cr + j)), s,
                                         _mm512_loadu_ps(ws + j));
                if (J->dt == DT_BF16) v = round_bf16_ps(v);
                _mm512_storeu_ps(o + j, _mm512_add_ps(_mm512_loadu_ps(o + j), _mm512_mul_ps(v, _mm512_set1_ps(w))));
            }
#elif HAVE_AVX2_GEMM
            for (; j + 8 <= j1; j += 8) {
                __m256 v = epi_dynamic8(M->epilogue, _mm256_loadu_si256((const __m256i *)(cr + j)), s,
                                        _mm256_loadu_ps(ws + j));
                if (J->dt == DT_BF16) v = round_bf16_8(v);
                _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_mul_ps(v, _mm256_set1_ps(w))));
            }
#endif
            for (; j < j1; j++) {
                float v = epi_dynamic(M->epilogue, cr[j], s, ws[j]);
                if (J->dt == DT_BF16) v = bf16_to_float(float_to_bf16(v));
                o[j] = o[j] + v * w;
            }
        }
    }
}

/* out [N, H] float32 = sum over each token's slots, in slot order (by expert, stable), of
 * w[slot] * (float)cast_dt(down_e(h[row])), h [S, I] (dtype dt) the SiLU(gate) * up rows in that order:
 * index_add_'s additions, one per slot, starting from 0. Each output column's additions are one task's, in
 * that order. Returns 0 or -1 (out of memory). */
int moe_down(const moe_t *M, const void *h, int32_t dt, int64_t N, int64_t top_k, const int64_t *order,
             const int64_t *load, const float *weights, float *out) {
    int64_t S = N * top_k, H = M->H;
    scratch_t t = {0};
    if (scratch(&t, S, M->dn_kp, M->dn_np)) return -1;
    quantize_rows(KIND_DYNAMIC, h, dt, S, M->I, M->I, 0.0f, 0.0f, t.u, M->dn_kp, t.s);
    memset(out, 0, (size_t)(N * H) * sizeof(float));
    down_job_t J = {M, t.u, order, load, top_k, t.c, t.s, weights, out, dt, 0};
    pool_run(down_task, &J, M->dn_np / (COLS * PANEL));
    free(t.c);
    return J.err ? -1 : 0;
}
