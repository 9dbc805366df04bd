/* Decode attention over the paged MLA latent cache, every decode row of a step in one call (CPU).
 *
 * Per row b, head h, cached position t < L_b (the arithmetic of pipeline.engine.batched_attention):
 *
 *     scores[b,h,t] = softmax_scale * (<s_k * q_abs[b,h], c[b,t]> + <q_pe[b,h], k_pe[b,t]>)   (one sum)
 *     o_lat[b,h]    = s_k * sum_t softmax_t(scores[b,h,:]) * c[b,t]
 *
 * The positions are taken `tile` at a time. Each token's latent and k_pe are read once from the cache
 * storage through the block table and converted to float32 into a small tile buffer (int8 / bf16 / fp16
 * / float32; ND or NZ, both described by four strides), which then serves all H heads' scores and,
 * while it is still in cache, the V accumulation. The softmax is the usual online one in float32:
 *
 *     m' = max(m, max_t s);  a = exp(m - m');  p = exp(s - m');  l' = a l + sum p;  acc' = a acc + p c
 *
 * and finally o_lat = acc * (s_k / l). Only positions t < L_b are visited (no masking needed; L_b >= 1).
 * With AVX-512 the exps run 16 at a time (vexp.h's Cephes polynomial) and each token's score is one FMA
 * chain over the latent and then the rope columns, the heads' four sums reduced together (reduce4).
 * With AVX2 + FMA and no AVX-512 the same loops run 8 lanes wide (reduce4_8, vexp8_ps).
 * Float32 throughout; the sums run in another order than torch's GEMMs, so results agree with the torch
 * path within float32 rounding (tests/test_native_attention.py measures it).
 *
 * mla_decode_absorbed does the absorption around it as well: q_abs = q_nope @ W_UK before and
 * o = o_lat @ W_UV^T after (small_gemm, all the rows of one head at a time, each element one FMA chain).
 *
 * A store (latent or k_pe) is described by its element dtype and four strides in elements: per block,
 * per token, per column chunk, and the chunk width. ND [nb, bs, cols]: (bs*cols, cols, -, cols) with a
 * single chunk; NZ [nb, C1, R', c0]: (C1*R'*c0, c0, R'*c0, c0).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "dtypes.h"
#include "cache_rows.h"
#include "pool.h"
#if defined(__AVX512F__) || DSQUANT_AVX2
#include <immintrin.h>
#include "vexp.h"
#endif

#ifdef __AVX512F__
/* The four horizontal sums of a0 .. a3 (lanes 0 .. 3 of the result). Each sum adds only its own vector's
 * lanes, in an order that does not depend on the other three: reduce4(a, 0, 0, 0)[0] has a's bits. */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 b01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 b23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(b01, b23, 0x44), _mm512_shuffle_ps(b01, b23, 0xee));
    return _mm_add_ps(_mm_add_ps(_mm512_castps512_ps128(c), _mm512_extractf32x4_ps(c, 1)),
                      _mm_add_ps(_mm512_extractf32x4_ps(c, 2), _mm512_extractf32x4_ps(c, 3)));
}
#endif

#ifdef __AVX512F__
/* a[k] += q[k * n + j] * x[j] lane-wise over j < n (a multiple of 16), for four rows k of q */
static inline __attribute__((always_inline)) void fma4(__m512 *a, const float *q, const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        for (int k = 0; k < 4; k++) a[k] = _mm512_fmadd_ps(_mm512_loadu_ps(q + k * n + j), v, a[k]);
    }
}
#elif DSQUANT_AVX2
/* reduce4 on 8 lanes: each sum adds only its own vector's lanes, as ((0+1)+(2+3)) + ((4+5)+(6+7)) */
static inline __m128 reduce4_8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

/* fma4 on 8 lanes (n a multiple of 8) */
static inline __attribute__((always_inline)) void fma4_8(__m256 *a, const float *q, const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        for (int k = 0; k < 4; k++) a[k] = _mm256_fmadd_ps(_mm256_loadu_ps(q + k * n + j), v, a[k]);
    }
}
#endif

/* s[h * T + i] = (<qa[h], xc[i]> + <qp[h], xp[i]>) * mul for heads h < H, tokens i < n: one sum over the
 * latent's np columns then the rope part's rp (both padded to multiples of 16). A head's result does not
 * depend on H or on its place among the heads (the heads of a tensor-parallel rank give the one-rank
 * engine's bits): heads outside a block of 4 take the block's per-head operations. */
static void dots(float *restrict s, int64_t T, const float *restrict qa, const float *restrict qp,
                 const float *restrict xc, const float *restrict xp, int64_t H, int64_t n, int64_t np, int64_t rp,
                 float mul) {
    for (int64_t i = 0; i < n; i++) {
        const float *xi = xc + i * np, *pi = xp + i * rp;
        int64_t h = 0;
#ifdef __AVX512F__
        for (; h + 4 <= H; h += 4) {
            __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            fma4(a, qa + h * np, xi, np);
            fma4(a, qp + h * rp, pi, rp);
            float d[4];
            _mm_storeu_ps(d, _mm_mul_ps(reduce4(a[0], a[1], a[2], a[3]), _mm_set1_ps(mul)));
            for (int k = 0; k < 4; k++) s[(h + k) * T + i] = d[k];
        }
        for (; h < H; h++) {                        /* the same lanes and sums as one head of the block above */
            const float *q0 = qa + h * np, *r0 = qp + h * rp;
            __m512 a = _mm512_setzero_ps();
            const __m512 z = a;
            for (int64_t j = 0; j < np; j += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + j), _mm512_loadu_ps(xi + j), a);
            for (int64_t j = 0; j < rp; j += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(r0 + j), _mm512_loadu_ps(pi + j), a);
            s[h * T + i] = _mm_cvtss_f32(_mm_mul_ps(reduce4(a, z, z, z), _mm_set1_ps(mul)));
        }
#elif DSQUANT_AVX2
        for (; h + 4 <= H; h += 4) {
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            fma4_8(a, qa + h * np, xi, np);
            fma4_8(a, qp + h * rp, pi, rp);
            float d[4];
            _mm_storeu_ps(d, _mm_mul_ps(reduce4_8(a[0], a[1], a[2], a[3]), _mm_set1_ps(mul)));
            for (int k = 0; k < 4; k++) s[(h + k) * T + i] = d[k];
        }
        for (; h < H; h++) {
            const float *q0 = qa + h * np, *r0 = qp + h * rp;
            __m256 a = _mm256_setzero_ps();
            const __m256 z = a;
            for (int64_t j = 0; j < np; j += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + j), _mm256_loadu_ps(xi + j), a);
            for (int64_t j = 0; j < rp; j += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + j), _mm256_loadu_ps(pi + j), a);
            s[h * T + i] = _mm_cvtss_f32(_mm_mul_ps(reduce4_8(a, z, z, z), _mm_set1_ps(mul)));
        }
#endif
        for (; h < H; h++) {
            const float *q0 = qa + h * np, *r0 = qp + h * rp;
            float d = 0.0f;
            for (int64_t j = 0; j < np; j++) d += q0[j] * xi[j];
            for (int64_t j = 0; j < rp; j++) d += r0[j] * pi[j];
            s[h * T + i] = d * mul;
        }
    }
}

/* acc[h] = alpha[h] * acc[h] + sum_{i < n} p[h * T + i] * x[i], rows of np floats (multiple of 16). */
static void accumulate_v(float *restrict acc, const float *restrict alpha, const float *restrict p, int64_t T,
                         const float *restrict x, int64_t H, int64_t n, int64_t np) {
    int64_t h = 0;
#ifdef __AVX512F__
    for (; h + 4 <= H; h += 4) {
        const float *p0 = p + h * T, *p1 = p0 + T, *p2 = p1 + T, *p3 = p2 + T;
        float *c0 = acc + h * np, *c1 = c0 + np, *c2 = c1 + np, *c3 = c2 + np;
        __m512 s0 = _mm512_set1_ps(alpha[h]), s1 = _mm512_set1_ps(alpha[h + 1]);
        __m512 s2 = _mm512_set1_ps(alpha[h + 2]), s3 = _mm512_set1_ps(alpha[h + 3]);
        for (int64_t j = 0; j < np; j += 16) {
            __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(c0 + j), s0), a1 = _mm512_mul_ps(_mm512_loadu_ps(c1 + j), s1);
            __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(c2 + j), s2), a3 = _mm512_mul_ps(_mm512_loadu_ps(c3 + j), s3);
            for (int64_t i = 0; i < n; i++) {
                __m512 v = _mm512_loadu_ps(x + i * np + j);
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(p0[i]), v, a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(p1[i]), v, a1);
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(p2[i]), v, a2);
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(p3[i]), v, a3);
            }
            _mm512_storeu_ps(c0 + j, a0);
            _mm512_storeu_ps(c1 + j, a1);
            _mm512_storeu_ps(c2 + j, a2);
            _mm512_storeu_ps(c3 + j, a3);
        }
    }
    for (; h < H; h++) {                            /* the same operations as one head of the block above */
        const float *ph = p + h * T;
        float *ch = acc + h * np;
        __m512 sh = _mm512_set1_ps(alpha[h]);
        for (int64_t j = 0; j < np; j += 16) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ch + j), sh);
            for (int64_t i = 0; i < n; i++)
                a = _mm512_fmadd_ps(_mm512_set1_ps(ph[i]), _mm512_loadu_ps(x + i * np + j), a);
            _mm512_storeu_ps(ch + j, a);
        }
    }
#elif DSQUANT_AVX2
    for (; h + 4 <= H; h += 4) {
        const float *p0 = p + h * T, *p1 = p0 + T, *p2 = p1 + T, *p3 = p2 + T;
        float *c0 = acc + h * np, *c1 = c0 + np, *c2 = c1 + np, *c3 = c2 + np;
        __m256 s0 = _mm256_set1_ps(alpha[h]), s1 = _mm256_set1_ps(alpha[h + 1]);
        __m256 s2 = _mm256_set1_ps(alpha[h + 2]), s3 = _mm256_set1_ps(alpha[h + 3]);
        for (int64_t j = 0; j < np; j += 8) {
            __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(c0 + j), s0), a1 = _mm256_mul_ps(_mm256_loadu_ps(c1 + j), s1);
            __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(c2 + j), s2), a3 = _mm256_mul_ps(_mm256_loadu_ps(c3 + j), s3);
            for (int64_t i = 0; i < n; i++) {
                __m256 v = _mm256_loadu_ps(x + i * np + j);
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(p0[i]), v, a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(p1[i]), v, a1);
                a2 = _mm256_fmadd_ps(_mm256_set1_ps(p2[i]), v, a2);
                a3 = _mm256_fmadd_ps(_mm256_set1_ps(p3[i]), v, a3);
            }
            _mm256_storeu_ps(c0 + j, a0);
            _mm256_storeu_ps(c1 + j, a1);
            _mm256_storeu_ps(c2 + j, a2);
            _mm256_storeu_ps(c3 + j, a3);
        }
    }
    for (; h < H; h++) {                            /* the same operations as one head of the block above */
        const float *ph = p + h * T;
        float *ch = acc + h * np;
        __m256 sh = _mm256_set1_ps(alpha[h]);
        for (int64_t j = 0; j < np; j += 8) {
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(ch + j), sh);
            for (int64_t i = 0; i < n; i++)
                a = _mm256_fmadd_ps(_mm256_set1_ps(ph[i]), _mm256_loadu_ps(x + i * np + j), a);
            _mm256_storeu_ps(ch + j, a);
        }
    }
#endif
    for (; h < H; h++) {
        float *ch = acc + h * np;
        const float *ph = p + h * T;
        for (int64_t j = 0; j < np; j++) ch[j] *= alpha[h];
        for (int64_t i = 0; i < n; i++) {
            const float *xi = x + i * np;
            for (int64_t j = 0; j < np; j++) ch[j] += ph[i] * xi[j];
        }
    }
}

static int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

/* The online softmax's step for one head over a tile's scores sh[0..n): the new running max (returned),
 * sh[i] = exp(sh[i] - max), *alpha = exp(old max - max) (0 on the first tile: exp(-inf)), and
 * *l = alpha * l + sum_i sh[i]. With AVX-512 the exps 16 at a time (vexp.h; a tail masked, so every score
 * runs the same code) and the sum in 16 lanes, then across them (AVX2: 8 lanes, vexp8_ps); else libm's
 * expf and a sequential sum. */
static float softmax_tile(float *restrict sh, int64_t n, float m_old, float *alpha, float *l) {
    float mx = m_old, sum = 0.0f;
#ifdef __AVX512F__
    __m512 vm = _mm512_set1_ps(m_old);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mk = tail_mask16(n - i);
        vm = _mm512_mask_max_ps(vm, mk, vm, _mm512_maskz_loadu_ps(mk, sh + i));
    }
    mx = _mm512_reduce_max_ps(vm);
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 vs = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mk = tail_mask16(n - i);
        const __m512 p = _mm512_maskz_mov_ps(mk, vexp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sh + i), vmx)));
        _mm512_mask_storeu_ps(sh + i, mk, p);
        vs = _mm512_add_ps(vs, p);
    }
    sum = _mm512_reduce_add_ps(vs);
    *alpha = m_old == -INFINITY ? 0.0f : _mm512_cvtss_f32(vexp_ps(_mm512_set1_ps(m_old - mx)));
#elif DSQUANT_AVX2
    __m256 vm = _mm256_set1_ps(m_old);
    for (int64_t i = 0; i < n; i += 8) {           /* lanes past the tail keep vm */
        const __m256 mk = _mm256_castsi256_ps(tail_mask8(n - i));
        vm = _mm256_max_ps(vm, _mm256_blendv_ps(vm, _mm256_maskload_ps(sh + i, _mm256_castps_si256(mk)), mk));
    }
    mx = hmax8(vm);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vs = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i mi = tail_mask8(n - i);
        const __m256 p = _mm256_and_ps(_mm256_castsi256_ps(mi),
                                       vexp8_ps(_mm256_sub_ps(_mm256_maskload_ps(sh + i, mi), vmx)));
        _mm256_maskstore_ps(sh + i, mi, p);
        vs = _mm256_add_ps(vs, p);
    }
    sum = hsum8(vs);
    *alpha = m_old == -INFINITY ? 0.0f : _mm256_cvtss_f32(vexp8_ps(_mm256_set1_ps(m_old - mx)));
#else
    for (int64_t i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
    for (int64_t i = 0; i < n; i++) {
        sh[i] = expf(sh[i] - mx);
        sum += sh[i];
    }
    *alpha = expf(m_old - mx);
#endif
    *l = *alpha * *l + sum;
    return mx;
}

/* Weights of the absorption, float32 or bf16 (exact in float32: the same products either way). */
#ifdef __AVX512F__
static inline __m512 wload16(const void *w, int wdt, int64_t i) {
    if (wdt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i))), 16));
    return _mm512_loadu_ps((const float *)w + i);
}
#elif DSQUANT_AVX2
static inline __m256 wload8(const void *w, int wdt, int64_t i) {
    if (wdt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return _mm256_loadu_ps((const float *)w + i);
}
#endif
static inline float wload1(const void *w, int wdt, int64_t i) {
    return wdt == DT_BF16 ? bf16_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* y[r * ldy + j] = sum_{k < K} x[r * ldx + k] * w[k * N + j] for rows r < M, columns j < N (w float32 or
 * bf16: wdt): each element one fused multiply-add chain over k in order from 0, whichever branch computes
 * it (4 rows x 16 columns at a time, a row alone, or a scalar column tail: the same bits), so a row's
 * result never depends on M. */
static void small_gemm(float *restrict y, int64_t ldy, const float *restrict x, int64_t ldx, const void *w, int wdt,
                       int64_t M, int64_t K, int64_t N) {
    const int64_t M4 = M / 4 * 4;       /* rows taken four at a time; the others alone, 8 column vectors at once */
    (void)M4;
    int64_t jv = 0;                     /* columns done in vectors */
#ifdef __AVX512F__
    jv = N / 16 * 16;
    for (int64_t j0 = 0; j0 < jv; j0 += 16)
        for (int64_t r = 0; r < M4; r += 4) {
            const float *x0 = x + r * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k++) {
                const __m512 v = wload16(w, wdt, k * N + j0);
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(x0[k]), v, a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(x1[k]), v, a1);
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(x2[k]), v, a2);
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(x3[k]), v, a3);
            }
            _mm512_storeu_ps(y + r * ldy + j0, a0);
            _mm512_storeu_ps(y + (r + 1) * ldy + j0, a1);
            _mm512_storeu_ps(y + (r + 2) * ldy + j0, a2);
            _mm512_storeu_ps(y + (r + 3) * ldy + j0, a3);
        }
    for (int64_t r = M4; r < M; r++) {  /* independent chains across columns: the FMA latency hidden */
        const float *xr = x + r * ldx;
        int64_t j0 = 0;
        for (; j0 + 128 <= jv; j0 += 128) {
            __m512 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k++) {
                const __m512 xk = _mm512_set1_ps(xr[k]);
                for (int i = 0; i < 8; i++) a[i] = _mm512_fmadd_ps(xk, wload16(w, wdt, k * N + j0 + 16 * i), a[i]);
            }
            for (int i = 0; i < 8; i++) _mm512_storeu_ps(y + r * ldy + j0 + 16 * i, a[i]);
        }
        for (; j0 < jv; j0 += 16) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k++) a = _mm512_fmadd_ps(_mm512_set1_ps(xr[k]), wload16(w, wdt, k * N + j0), a);
            _mm512_storeu_ps(y + r * ldy + j0, a);
        }
    }
#elif DSQUANT_AVX2
    jv = N / 8 * 8;
    for (int64_t j0 = 0; j0 < jv; j0 += 8)
        for (int64_t r = 0; r < M4; r += 4) {
            const float *x0 = x + r * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k++) {
                const __m256 v = wload8(w, wdt, k * N + j0);
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(x0[k]), v, a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(x1[k]), v, a1);
                a2 = _mm256_fmadd_ps(_mm256_set1_ps(x2[k]), v, a2);
                a3 = _mm256_fmadd_ps(_mm256_set1_ps(x3[k]), v, a3);
            }
            _mm256_storeu_ps(y + r * ldy + j0, a0);
            _mm256_storeu_ps(y + (r + 1) * ldy + j0, a1);
            _mm256_storeu_ps(y + (r + 2) * ldy + j0, a2);
            _mm256_storeu_ps(y + (r + 3) * ldy + j0, a3);
        }
    for (int64_t r = M4; r < M; r++) {
        const float *xr = x + r * ldx;
        int64_t j0 = 0;
        for (; j0 + 64 <= jv; j0 += 64) {
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k++) {
                const __m256 xk = _mm256_set1_ps(xr[k]);
                for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(xk, wload8(w, wdt, k * N + j0 + 8 * i), a[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(y + r * ldy + j0 + 8 * i, a[i]);
        }
        for (; j0 < jv; j0 += 8) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k++) a = _mm256_fmadd_ps(_mm256_set1_ps(xr[k]), wload8(w, wdt, k * N + j0), a);
            _mm256_storeu_ps(y + r * ldy + j0, a);
        }
    }
#endif
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = jv; j < N; j++) {
            float a = 0.0f;
            for (int64_t k = 0; k < K; k++) a = fmaf(x[r * ldx + k], wload1(w, wdt, k * N + j), a);
            y[r * ldy + j] = a;
        }
}

typedef struct {                 /* one call of decode(): what every head group's task reads */
    const float *q, *q_pe;
    int64_t dn, dv, B, H, C, R, W, block_size, tile, group;
    const void *w_uk, *w_uv_t;
    int wdt;
    const store_t *cs, *ps;
    const int64_t *table, *lengths;
    float s_k, softmax_scale;
    float *out;
    _Atomic int err;
} decode_job_t;

/* Heads [h0, h0 + g) of every row: their absorption (q_abs), their attention and their output. A head's
 * bits do not depend on the other heads of its group (dots' and accumulate_v's comments), so the result is
 * the same for any grouping and any thread. */
static void decode_heads(void *ctx, int64_t task) {
    decode_job_t *J = ctx;
    const int64_t H = J->H, C = J->C, R = J->R, B = J->B, T = J->tile, dn = J->dn, dv = J->dv;
    const int64_t h0 = task * J->group, g = H - h0 < J->group ? H - h0 : J->group;
    const int64_t Cp = pad16(C), Rp = pad16(R), esz = J->wdt == DT_BF16 ? 2 : 4;
    const int64_t rows = J->w_uk ? B * g * Cp : 0;  /* absorbed: every row's q_abs, then every row's o_lat */
    size_t floats = (size_t)(T * Cp + T * Rp + g * Cp + g * Rp + g * Cp + g * T + 3 * g + rows);
    float *buf = (float *)aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
    if (!buf) {
        J->err = 1;
        return;
    }
    memset(buf, 0, floats * 4);                    /* padding columns stay zero */
    float *xc = buf, *xp = xc + T * Cp, *qa = xp + T * Rp, *qp = qa + g * Cp, *acc = qp + g * Rp;
    float *s = acc + g * Cp, *m = s + g * T, *l = m + g, *alpha = l + g, *all = alpha + g;
    for (int64_t i = 0; J->w_uk && i < g; i++)      /* q_abs[b, h] = q_nope[b, h] @ W_UK[h], all rows per head */
        small_gemm(all + i * Cp, g * Cp, J->q + (h0 + i) * dn, H * dn,
                   (const char *)J->w_uk + (size_t)((h0 + i) * dn * C) * esz, J->wdt, B, dn, C);
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = J->lengths[b];
        const int64_t *blocks = J->table + b * J->W;
        for (int64_t i = 0; i < g; i++) {
            const int64_t h = h0 + i;
            const float *qs = J->w_uk ? all + (b * g + i) * Cp : J->q + (b * H + h) * C;
            for (int64_t j = 0; j < C; j++) qa[i * Cp + j] = qs[j] * J->s_k;    /* s_k folded into the query */
            memcpy(qp + i * Rp, J->q_pe + (b * H + h) * R, (size_t)R * 4);
            memset(acc + i * Cp, 0, (size_t)Cp * 4);
            m[i] = -INFINITY;
            l[i] = 0.0f;
        }
        for (int64_t t0 = 0; t0 < L; t0 += T) {
            const int64_t n = L - t0 < T ? L - t0 : T;
            for (int64_t i = 0; i < n;) {          /* runs of positions within one block */
                const int64_t pos = t0 + i, blk = blocks[pos / J->block_size], off = pos % J->block_size;
                const int64_t run = J->block_size - off < n - i ? J->block_size - off : n - i;
                load_rows(xc + i * Cp, Cp, J->cs, blk, off, run);
                load_rows(xp + i * Rp, Rp, J->ps, blk, off, run);
                i += run;
            }
            dots(s, T, qa, qp, xc, xp, g, n, Cp, Rp, J->softmax_scale);
            for (int64_t i = 0; i < g; i++) m[i] = softmax_tile(s + i * T, n, m[i], &alpha[i], &l[i]);
            accumulate_v(acc, alpha, s, T, xc, g, n, Cp);
        }
        for (int64_t i = 0; i < g; i++) {       /* absorbed: o_lat over q_abs, which served its row */
            const float f = J->s_k / l[i];
            float *o = J->w_uv_t ? all + (b * g + i) * Cp : J->out + (b * H + h0 + i) * C;
            for (int64_t j = 0; j < C; j++) o[j] = acc[i * Cp + j] * f;
        }
    }
    for (int64_t i = 0; J->w_uv_t && i < g; i++)   /* o[b, h] = o_lat[b, h] @ W_UV^T[h], all rows per head */
        small_gemm(J->out + (h0 + i) * dv, H * dv, all + i * Cp, g * Cp,
                   (const char *)J->w_uv_t + (size_t)((h0 + i) * C * dv) * esz, J->wdt, B, C, dv);
    free(buf);
}

/* The decode rows' attention (module comment); with w_uk / w_uv_t (else NULL; float32 or bf16: wdt) the
 * absorption around it: the queries are q_nope [B, H, dn] and q_abs[b, h] = q_nope[b, h] @ w_uk[h]
 * ([H, dn, C]), and out holds o[b, h] = o_lat[b, h] @ w_uv_t[h] ([H, C, dv]) [B, H, dv] instead of o_lat
 * [B, H, C]. The heads go to the pool's threads in groups (a multiple of 4, at least two groups a thread).
 * Returns 0, or: 1 out of memory, 2 a length outside 1 .. W * block_size, 3 a block id outside the cache. */
static int decode(const float *q, int64_t dn, const void *w_uk, const void *w_uv_t, int wdt, int64_t dv,
                  const float *q_pe, int64_t B, int64_t H, int64_t C, int64_t R, const store_t *cs,
                  const store_t *ps, const int64_t *table, int64_t W, const int64_t *lengths, int64_t block_size,
                  int64_t num_blocks, float s_k, float softmax_scale, int64_t tile, float *out) {
    for (int64_t b = 0; b < B; b++) {
        if (lengths[b] < 1 || lengths[b] > W * block_size) return 2;
        for (int64_t k = 0; k < (lengths[b] + block_size - 1) / block_size; k++)
            if (table[b * W + k] < 0 || table[b * W + k] >= num_blocks) return 3;
    }
    const int64_t threads = pool_get_threads();
    int64_t group = threads <= 1 ? H : (H + 2 * threads - 1) / (2 * threads);
    group = (group + 3) / 4 * 4;
    decode_job_t J = {q, q_pe, dn, dv, B, H, C, R, W, block_size, tile, group, w_uk, w_uv_t, wdt, cs, ps, table,
                      lengths, s_k, softmax_scale, out, 0};
    pool_run(decode_heads, &J, (H + group - 1) / group);
    return J.err ? 1 : 0;
}

/* 1 when built with the AVX-512 or AVX2 loops (else plain C, which the engine serves with torch's ops instead). */
int mla_decode_vectorized(void) {
#if defined(__AVX512F__) || DSQUANT_AVX2
    return 1;
#else
    return 0;
#endif
}

int mla_decode(const float *q_abs, const float *q_pe, int64_t B, int64_t H, int64_t C, int64_t R,
               const void *c_base, int c_dtype, int64_t c_bstride, int64_t c_tstride, int64_t c_kstride,
               int64_t c_kwidth, const void *p_base, int p_dtype, int64_t p_bstride, int64_t p_tstride,
               int64_t p_kstride, int64_t p_kwidth, const int64_t *table, int64_t W, const int64_t *lengths,
               int64_t block_size, int64_t num_blocks, float s_k, float softmax_scale, int64_t tile, float *out) {
    store_t cs = {c_base, c_dtype, c_bstride, c_tstride, c_kstride, c_kwidth, C};
    store_t ps = {p_base, p_dtype, p_bstride, p_tstride, p_kstride, p_kwidth, R};
    return decode(q_abs, C, NULL, NULL, DT_F32, C, q_pe, B, H, C, R, &cs, &ps, table, W, lengths, block_size, num_blocks,
                  s_k, softmax_scale, tile, out);
}

/* mla_decode from q_nope [B, H, dn] with the absorption folded in (see decode), its weights float32 or bf16
 * (w_dtype): out [B, H, dv]. */
int mla_decode_absorbed(const float *q_nope, int64_t dn, const void *w_uk, const void *w_uv_t, int w_dtype, int64_t dv,
                        const float *q_pe, int64_t B, int64_t H, int64_t C, int64_t R,
                        const void *c_base, int c_dtype, int64_t c_bstride, int64_t c_tstride, int64_t c_kstride,
                        int64_t c_kwidth, const void *p_base, int p_dtype, int64_t p_bstride, int64_t p_tstride,
                        int64_t p_kstride, int64_t p_kwidth, const int64_t *table, int64_t W,
                        const int64_t *lengths, int64_t block_size, int64_t num_blocks, float s_k,
                        float softmax_scale, int64_t tile, float *out) {
    store_t cs = {c_base, c_dtype, c_bstride, c_tstride, c_kstride, c_kwidth, C};
    store_t ps = {p_base, p_dtype, p_bstride, p_tstride, p_kstride, p_kwidth, R};
    return decode(q_nope, dn, w_uk, w_uv_t, w_dtype, dv, q_pe, B, H, C, R, &cs, &ps, table, W, lengths, block_size,
                  num_blocks, s_k, softmax_scale, tile, out);
}
