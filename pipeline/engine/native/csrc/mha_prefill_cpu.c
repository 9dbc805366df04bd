/* One prefill chunk of MLA attention in the non-absorbed (MHA) form, in one call
 * (pipeline/engine/mha_prefill.native_prefill_attention; the torch form is mha_prefill_attention there):
 *
 *   kv = c @ [W_UK^T | W_UV^T]            [T, H * (d_n + d_v)], the latent rows c [T, C] (as stored)
 *   k_nope = s_k * kv[:, h, :d_n],  v = s_k * kv[:, h, d_n:]
 *   o[i, h] = sum_t softmax_t(scale * (q_nope[i, h] . k_nope[t, h] + q_pe[i, h] . k_pe[t])) v[t, h],
 *             t <= start + i (causal)
 *
 * The decompression product runs on the AMX tiles (tdpbf16ps: bf16 inputs, float32 sums) when the caller
 * says the latent values are bf16 values (an int8 cache's integers, a bf16 cache's values: exact) and the
 * CPU has AMX, on AVX512-BF16's vdpbf16ps where it has that and no AMX; else through bf16_gemm.h's FMA
 * loops (float32 x, the packed bf16 weight widened). Either
 * way every product is exact and the sums are float32; the attention is float32 FMAs and an exp
 * polynomial (relative error ~2 ulp). So the output agrees with the torch form within float32 rounding,
 * not bit for bit; a chunk's result depends only on its own inputs (never on the other chunks of a step).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16_gemm.h"
#include "cache_rows.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "amx.h"
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

/* 1 when built with the AVX-512 or AVX2 loops (else plain C, which the engine serves with torch's ops
 * instead). */
int mha_prefill_vectorized(void) {
#if defined(__AVX512F__) || DSQUANT_AVX2
    return 1;
#else
    return 0;
#endif
}

int mha_prefill_has_amx(void) {
#if HAVE_AMX
    return amx_usable();
#else
    return 0;
#endif
}

#if HAVE_AMX
/* y [mp, 16 * nb] (mp = m rounded up to 32) = a [mp, k] bf16 bits @ W.T on the tiles, k % 32 == 0. */
static void gemm_amx_bf16(const uint16_t *a, int64_t mp, int64_t k, const uint32_t *pack, int64_t nb, float *y) {
    const int64_t kh = k / 2, ldy = nb * 16 * 4, lda = k * 2;
    amx_load_config();
    for (int64_t r0 = 0; r0 < mp; r0 += 32) {
        const uint16_t *a0 = a + r0 * k, *a1 = a0 + 16 * k;
        for (int64_t b = 0; b < nb; b += 2) {
            const int two = b + 1 < nb;
            const uint32_t *w0 = pack + b * kh * 16, *w1 = w0 + kh * 16;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t s = 0; s < kh; s += 16) {
                _tile_loadd(4, a0 + 2 * s, lda);
                _tile_loadd(5, a1 + 2 * s, lda);
                _tile_loadd(6, w0 + s * 16, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                if (two) {
                    _tile_loadd(7, w1 + s * 16, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            float *yp = y + r0 * nb * 16 + b * 16;
            _tile_stored(0, yp, ldy);
            _tile_stored(2, yp + 16 * nb * 16, ldy);
            if (two) {
                _tile_stored(1, yp + 16, ldy);
                _tile_stored(3, yp + 16 * nb * 16 + 16, ldy);
            }
        }
    }
    _tile_release();
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
/* y [m, 16 * nb] (row stride 16 * nb) = a [m, k] bf16 bits @ W.T with AVX512-BF16's vdpbf16ps, k even:
 * every product exact (bf16 x bf16), float32 sums a pair of k at a time; 4 rows x 4 column blocks of 16 in
 * registers. For CPUs with AVX512-BF16 and no AMX (the tiles' dot products, 16 lanes wide). */
static void gemm_dpbf16(const uint16_t *a, int64_t m, int64_t k, const uint32_t *pack, int64_t nb, float *y) {
    const int64_t kh = k / 2, ldy = nb * 16;
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int nr = m - r0 < 4 ? (int)(m - r0) : 4;
        const uint16_t *ar[4];
        for (int r = 0; r < 4; r++) ar[r] = a + (r0 + (r < nr ? r : 0)) * k;      /* short block: repeats */
        for (int64_t b0 = 0; b0 < nb; b0 += 4) {
            const int nc = nb - b0 < 4 ? (int)(nb - b0) : 4;
            const uint32_t *w[4];
            for (int u = 0; u < 4; u++) w[u] = pack + (b0 + (u < nc ? u : 0)) * kh * 16;
            __m512 acc[4][4];
            for (int r = 0; r < 4; r++)
                for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_ps();
            for (int64_t s = 0; s < kh; s++) {
                __m512i bv[4];
                for (int u = 0; u < 4; u++) bv[u] = _mm512_loadu_si512((const void *)(w[u] + s * 16));
                for (int r = 0; r < 4; r++) {
                    uint32_t pair;
                    memcpy(&pair, ar[r] + 2 * s, 4);          /* a[r][2s] low, a[r][2s+1] high, as packed */
                    const __m512i av = _mm512_set1_epi32((int)pair);
                    for (int u = 0; u < 4; u++)
                        acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)av, (__m512bh)bv[u]);
                }
            }
            for (int r = 0; r < nr; r++)
                for (int u = 0; u < nc; u++) _mm512_storeu_ps(y + (r0 + r) * ldy + (b0 + u) * 16, acc[r][u]);
        }
    }
}
#else
#define HAVE_DPBF16 0
#endif

/* 1 when the decompression product can run on bf16 dot products here (AMX tiles or AVX512-BF16). */
int mha_prefill_has_bf16_dot(void) {
    return HAVE_DPBF16 || mha_prefill_has_amx();
}

#if defined(__AVX512F__) || DSQUANT_AVX2
#include "vexp.h"
#endif

#ifdef __AVX512F__
/* s[r][u] += q[r][d] * k[d][16u ..] over d < n for NQ rows, key rows ldk apart */
static inline __attribute__((always_inline)) void qk_chunk(__m512 s[4][4], const int NQ, const float *const *q,
                                                           int64_t qoff, const float *k, int64_t ldk, int64_t n) {
    for (int64_t d = 0; d < n; d++, k += ldk) {
        const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                     k3 = _mm512_loadu_ps(k + 48);
        for (int r = 0; r < NQ; r++) {
            const __m512 qb = _mm512_set1_ps(q[r][qoff + d]);
            s[r][0] = _mm512_fmadd_ps(qb, k0, s[r][0]);
            s[r][1] = _mm512_fmadd_ps(qb, k1, s[r][1]);
            s[r][2] = _mm512_fmadd_ps(qb, k2, s[r][2]);
            s[r][3] = _mm512_fmadd_ps(qb, k3, s[r][3]);
        }
    }
}

/* scores4's passes for a fixed number of rows NQ (a constant where it is inlined) */
static inline __attribute__((always_inline)) void scores_nq(const int NQ, const float *const *qn,
                                                            const float *const *qr, int64_t dn, int64_t R,
                                                            const float *kt, int64_t ldk, int64_t L, float scale,
                                                            float *sc) {
    for (int64_t t0 = 0; t0 < L; t0 += 64) {
        __m512 s[4][4];
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < 4; u++) s[r][u] = _mm512_setzero_ps();
        qk_chunk(s, NQ, qn, 0, kt + t0, ldk, dn);                 /* the nope columns, then the rope ones */
        qk_chunk(s, NQ, qr, 0, kt + dn * ldk + t0, ldk, R);
        for (int r = 0; r < NQ; r++)
            for (int u = 0; u < 4; u++)
                _mm512_storeu_ps(sc + r * ldk + t0 + 16 * u, _mm512_mul_ps(s[r][u], _mm512_set1_ps(scale)));
    }
}
#elif DSQUANT_AVX2
/* qk_chunk on AVX2: s[r][u] += q[r][d] * k[d][8u ..], 16 keys (two registers) for each of NQ rows */
static inline __attribute__((always_inline)) void qk_chunk8(__m256 s[4][2], const int NQ, const float *const *q,
                                                            const float *k, int64_t ldk, int64_t n) {
    for (int64_t d = 0; d < n; d++, k += ldk) {
        const __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
        for (int r = 0; r < NQ; r++) {
            const __m256 qb = _mm256_broadcast_ss(q[r] + d);
            s[r][0] = _mm256_fmadd_ps(qb, k0, s[r][0]);
            s[r][1] = _mm256_fmadd_ps(qb, k1, s[r][1]);
        }
    }
}

/* scores_nq on AVX2: keys 16 at a time (L rounded up to 16; the rows are 64-padded), the same sums per key */
static inline __attribute__((always_inline)) void scores_nq(const int NQ, const float *const *qn,
                                                            const float *const *qr, int64_t dn, int64_t R,
                                                            const float *kt, int64_t ldk, int64_t L, float scale,
                                                            float *sc) {
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        __m256 s[4][2];
        for (int r = 0; r < 4; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();
        qk_chunk8(s, NQ, qn, kt + t0, ldk, dn);                   /* the nope columns, then the rope ones */
        qk_chunk8(s, NQ, qr, kt + dn * ldk + t0, ldk, R);
        for (int r = 0; r < NQ; r++)
            for (int u = 0; u < 2; u++)
                _mm256_storeu_ps(sc + r * ldk + t0 + 8 * u, _mm256_mul_ps(s[r][u], _mm256_set1_ps(scale)));
    }
}
#endif

/* scale * (q . k) of up to 4 query rows (nq) of one head against keys 0 .. L-1 (L: the last row's count;
 * with AVX-512 rounded up to 64, AVX2 16), into sc [4][ldk]: each key chunk's loads serve every row (16 FMA
 * chains; AVX2: 8), a row's sum over the nope columns then the rope ones. */
static void scores4(const float *const *qn, const float *const *qr, int nq, int64_t dn, int64_t R,
                    const float *kt, int64_t ldk, int64_t L, float scale, float *sc) {
#if defined(__AVX512F__) || DSQUANT_AVX2
    switch (nq) {
    case 4: scores_nq(4, qn, qr, dn, R, kt, ldk, L, scale, sc); break;
    case 3: scores_nq(3, qn, qr, dn, R, kt, ldk, L, scale, sc); break;
    case 2: scores_nq(2, qn, qr, dn, R, kt, ldk, L, scale, sc); break;
    default: scores_nq(1, qn, qr, dn, R, kt, ldk, L, scale, sc);
    }
#else
    for (int r = 0; r < nq; r++)
        for (int64_t t = 0; t < L; t++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < dn; d++) acc += qn[r][d] * kt[d * ldk + t];
            for (int64_t d = 0; d < R; d++) acc += qr[r][d] * kt[(dn + d) * ldk + t];
            sc[r * ldk + t] = acc * scale;
        }
#endif
}

#ifdef __AVX512F__
/* One query row's softmax in place over its L visible keys, zeros from L to Lmax; returns 1 / sum. */
static float softmax_row(float *sc, int64_t L, int64_t Lmax) {
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const __mmask16 live = tail_mask16(L - t0);
        vmx = _mm512_max_ps(vmx, _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(sc + t0)));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < Lmax; t0 += 16) {
        const int64_t left = L - t0;
        const __mmask16 live = tail_mask16(left);
        const __m512 p = _mm512_maskz_mov_ps(live, vexp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + t0), mx)));
        _mm512_storeu_ps(sc + t0, p);
        vsum = _mm512_add_ps(vsum, p);
    }
    return 1.0f / _mm512_reduce_add_ps(vsum);
}

/* od[r] = inv[r] * sum_{t < Lmax} p[r][t] * vv[t] for nq (<= 4) rows of probabilities p = sc + r * ldk
 * (zero past each row's own keys), dv (16, 32, 48 or 64) columns: each value row loaded once for every
 * query row, one FMA chain per row and 16 columns. */
#define VALUES4_FITS(dv) ((dv) % 16 == 0 && (dv) <= 64)
static void values4(const float *sc, int64_t ldk, int nq, int64_t Lmax, const float *vv, int64_t dv,
                    const float *inv, float *const *od) {
    const int nv = (int)(dv / 16);
    __m512 a[4][4];
    for (int r = 0; r < 4; r++)
        for (int u = 0; u < 4; u++) a[r][u] = _mm512_setzero_ps();
    for (int64_t t = 0; t < Lmax; t++) {
        const float *v = vv + t * dv;
        __m512 vl[4];
        for (int u = 0; u < nv; u++) vl[u] = _mm512_loadu_ps(v + 16 * u);
        for (int r = 0; r < nq; r++) {
            const __m512 p = _mm512_set1_ps(sc[r * ldk + t]);
            for (int u = 0; u < nv; u++) a[r][u] = _mm512_fmadd_ps(p, vl[u], a[r][u]);
        }
    }
    for (int r = 0; r < nq; r++)
        for (int u = 0; u < nv; u++) _mm512_storeu_ps(od[r] + 16 * u, _mm512_mul_ps(a[r][u], _mm512_set1_ps(inv[r])));
}
#elif DSQUANT_AVX2
/* softmax_row on AVX2 (8 lanes, vexp8_ps): zeros from L to Lmax (rounded up to 8); returns 1 / sum. */
static float softmax_row(float *sc, int64_t L, int64_t Lmax) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 vmx = ninf;
    for (int64_t t0 = 0; t0 < L; t0 += 8)
        vmx = _mm256_max_ps(vmx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(sc + t0), _mm256_castsi256_ps(tail_mask8(L - t0))));
    const __m256 mx = _mm256_set1_ps(hmax8(vmx));
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < Lmax; t0 += 8) {
        const __m256 live = _mm256_castsi256_ps(tail_mask8(L - t0));
        const __m256 p = _mm256_and_ps(live, vexp8_ps(_mm256_sub_ps(_mm256_loadu_ps(sc + t0), mx)));
        _mm256_storeu_ps(sc + t0, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    return 1.0f / hsum8(vsum);
}

/* values4 on AVX2, dv a multiple of 8: 16 columns (two registers) of every row a pass, then an 8-column
 * tail; each value row's loads serve every query row, one FMA chain per row and 8 columns. */
#define VALUES4_FITS(dv) ((dv) % 8 == 0)
static void values4(const float *sc, int64_t ldk, int nq, int64_t Lmax, const float *vv, int64_t dv,
                    const float *inv, float *const *od) {
    for (int64_t c0 = 0; c0 < dv; c0 += 16) {
        const int two = c0 + 16 <= dv;
        __m256 a[4][2];
        for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int64_t t = 0; t < Lmax; t++) {
            const float *v = vv + t * dv + c0;
            const __m256 v0 = _mm256_loadu_ps(v), v1 = two ? _mm256_loadu_ps(v + 8) : v0;
            for (int r = 0; r < nq; r++) {
                const __m256 p = _mm256_broadcast_ss(sc + r * ldk + t);
                a[r][0] = _mm256_fmadd_ps(p, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(p, v1, a[r][1]);
            }
        }
        for (int r = 0; r < nq; r++) {
            const __m256 s = _mm256_set1_ps(inv[r]);
            _mm256_storeu_ps(od[r] + c0, _mm256_mul_ps(a[r][0], s));
            if (two) _mm256_storeu_ps(od[r] + c0 + 8, _mm256_mul_ps(a[r][1], s));
        }
    }
}
#endif

/* One query row of one head, its scores sc [L..] given (scores4; overwritten): the softmax over the L
 * visible keys and the values' sum vv [L.., dv] into od [dv] (acc [dv]: scratch). */
static void attend(float *sc, int64_t L, const float *vv, int64_t dv, float *acc, float *od) {
#ifdef __AVX512F__
    const float inv = softmax_row(sc, L, L);
    if (dv % 16 == 0) {                                        /* the values' sum, 32 columns a pass */
        const __m512 vinv = _mm512_set1_ps(inv);
        for (int64_t c0 = 0; c0 < dv; c0 += 32) {
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            const float *v = vv + c0;
            if (c0 + 16 < dv) {
                for (int64_t t = 0; t < L; t++, v += dv) {
                    const __m512 p = _mm512_set1_ps(sc[t]);
                    a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v), a0);
                    a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16), a1);
                }
                _mm512_storeu_ps(od + c0 + 16, _mm512_mul_ps(a1, vinv));
            } else {
                for (int64_t t = 0; t < L; t++, v += dv) a0 = _mm512_fmadd_ps(_mm512_set1_ps(sc[t]), _mm512_loadu_ps(v), a0);
            }
            _mm512_storeu_ps(od + c0, _mm512_mul_ps(a0, vinv));
        }
        return;
    }
#elif DSQUANT_AVX2
    const float inv = softmax_row(sc, L, L);
#else
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < L; t++) mx = sc[t] > mx ? sc[t] : mx;
    for (int64_t t = 0; t < L; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
    const float inv = 1.0f / sum;
#endif
    for (int64_t d = 0; d < dv; d++) acc[d] = 0.0f;
    for (int64_t t = 0; t < L; t++)
        for (int64_t d = 0; d < dv; d++) acc[d] += sc[t] * vv[t * dv + d];
    for (int64_t d = 0; d < dv; d++) od[d] = acc[d] * inv;
}

/* o [S, H, dv] for q_nope [S, H, dn], q_pe [S, H, R] (float32, contiguous) at positions start .. start+S-1,
 * over the T = start + S latent rows c [T, C] and k_pe rows pe [T, R] (float32); wpack: [W_UK^T | W_UV^T]
 * as a [H * (dn + dv), C] weight packed by pipeline.engine.bf16_pack. amx_ok: c's values are bf16 values.
 * Returns 0, or 1 when out of memory. */
int mha_prefill(const float *q_nope, const float *q_pe, int64_t S, int64_t H, int64_t dn, int64_t R, int64_t dv,
                const float *c, const float *pe, int64_t start, int64_t C, const uint32_t *wpack, float s_k,
                float scale, int amx_ok, float *o) {
    const int64_t T = start + S, w = dn + dv, n = H * w, nb = bf16_gemm_blocks(n), ld = nb * 16;
    const int64_t Tp = (T + 31) / 32 * 32, T64 = (T + 63) / 64 * 64, D = dn + R;
    float *kv = malloc((size_t)(Tp * ld) * sizeof(float));
    float *kt = malloc((size_t)(D * T64 + 4 * T64 + T * dv + dv) * sizeof(float));
    if (!kv || !kt) { free(kv); free(kt); return 1; }
    float *sc = kt + D * T64, *vv = sc + 4 * T64, *acc = vv + T * dv;
    int done = 0;
#if HAVE_AMX || HAVE_DPBF16
    int tiles = 0;
#if HAVE_AMX
    tiles = amx_ok && C % 32 == 0 && amx_usable();
#endif
    if (tiles || (HAVE_DPBF16 && amx_ok && C % 2 == 0)) {
        uint16_t *a = malloc((size_t)(Tp * C) * 2);
        if (a) {
            for (int64_t t = 0; t < Tp; t++)
                for (int64_t j = 0; j < C; j++) {
                    uint32_t u = 0;
                    if (t < T) memcpy(&u, c + t * C + j, 4);
                    a[t * C + j] = (uint16_t)(u >> 16);          /* exact: the value is a bf16 value */
                }
#if HAVE_AMX
            if (tiles) gemm_amx_bf16(a, Tp, C, wpack, nb, kv);
#endif
#if HAVE_DPBF16
            if (!tiles) gemm_dpbf16(a, T, C, wpack, nb, kv);
#endif
            free(a);
            done = 1;
        }
    }
#else
    (void)amx_ok;
#endif
    if (!done) {
        const float **rows = malloc((size_t)T * sizeof(*rows));
        if (!rows) { free(kv); free(kt); return 1; }
        for (int64_t t = 0; t < T; t++) rows[t] = c + t * C;
        const int rc = bf16_gemm(rows, T, C, wpack, n, kv, ld);
        free(rows);
        if (rc) { free(kv); free(kt); return 1; }
    }
    /* keys transposed [D][T64] (k_nope scaled by s_k, then k_pe, the heads' common rows, built once;
     * zero past T), values [T][dv] (s_k) */
    for (int64_t d = dn; d < D; d++) {
        float *row = kt + d * T64;
        for (int64_t t = 0; t < T; t++) row[t] = pe[t * R + d - dn];
        for (int64_t t = T; t < T64; t++) row[t] = 0.0f;
    }
    for (int64_t h = 0; h < H; h++) {
        for (int64_t d = 0; d < dn; d++) {
            float *row = kt + d * T64;
            for (int64_t t = 0; t < T; t++) row[t] = s_k * kv[t * ld + h * w + d];
            for (int64_t t = T; t < T64; t++) row[t] = 0.0f;
        }
        for (int64_t t = 0; t < T; t++)
            for (int64_t d = 0; d < dv; d++) vv[t * dv + d] = s_k * kv[t * ld + h * w + dn + d];
        for (int64_t i0 = 0; i0 < S; i0 += 4) {
            const int nq = S - i0 < 4 ? (int)(S - i0) : 4;
            const float *qn[4], *qr[4];
            for (int r = 0; r < nq; r++) {
                qn[r] = q_nope + ((i0 + r) * H + h) * dn;
                qr[r] = q_pe + ((i0 + r) * H + h) * R;
            }
            scores4(qn, qr, nq, dn, R, kt, T64, start + i0 + nq, scale, sc);
#ifdef VALUES4_FITS
            if (VALUES4_FITS(dv)) {                                /* the rows' values' sums together */
                float inv[4];
                float *od[4];
                for (int r = 0; r < nq; r++) {
                    const int64_t i = i0 + r, L = start + i + 1;    /* keys 0 .. start + i */
                    inv[r] = softmax_row(sc + r * T64, L, start + i0 + nq);
                    od[r] = o + (i * H + h) * dv;
                }
                values4(sc, T64, nq, start + i0 + nq, vv, dv, inv, od);
                continue;
            }
#endif
            for (int r = 0; r < nq; r++) {
                const int64_t i = i0 + r, L = start + i + 1;        /* keys 0 .. start + i */
                attend(sc + r * T64, L, vv, dv, acc, o + (i * H + h) * dv);
            }
        }
    }
    free(kv);
    free(kt);
    return 0;
}

/* Every prefill chunk of one layer's step in one call, the cache rows read here: chunk i holds the query
 * rows chunks[3i] .. chunks[3i] + chunks[3i+1] - 1 of q_nope [N, H, dn] / q_pe [N, H, R] (float32) at
 * positions chunks[3i+2] .., its tokens in the blocks table[i * W ..] of the stores cs (latent) and ps
 * (k_pe; see cache_rows.h); each chunk as mha_prefill over its rows, into the same rows of o [N, H, dv].
 * Returns 0, or 1 (out of memory), 2 (a chunk that does not fit its W blocks) or 3 (a block id outside
 * 0 .. num_blocks - 1); nothing is computed for any chunk unless every chunk's blocks are valid. */
int mha_prefill_paged(const float *q_nope, const float *q_pe, int64_t H, int64_t dn, int64_t R, int64_t dv,
                      int64_t C, const void *c_base, int c_dtype, int64_t c_bstride, int64_t c_tstride,
                      int64_t c_kstride, int64_t c_kwidth, const void *p_base, int p_dtype, int64_t p_bstride,
                      int64_t p_tstride, int64_t p_kstride, int64_t p_kwidth, int64_t block_size,
                      int64_t num_blocks, int64_t nchunks, const int64_t *chunks, const int64_t *table, int64_t W,
                      const uint32_t *wpack, float s_k, float scale, int amx_ok, float *o) {
    const store_t cs = {c_base, c_dtype, c_bstride, c_tstride, c_kstride, c_kwidth, C};
    const store_t ps = {p_base, p_dtype, p_bstride, p_tstride, p_kstride, p_kwidth, R};
    int64_t most = 0;
    for (int64_t i = 0; i < nchunks; i++) {
        const int64_t S = chunks[3 * i + 1], start = chunks[3 * i + 2], T = start + S;
        if (S < 1 || start < 0 || chunks[3 * i] < 0 || T > W * block_size) return 2;
        for (int64_t k = 0; k < (T + block_size - 1) / block_size; k++)
            if (table[i * W + k] < 0 || table[i * W + k] >= num_blocks) return 3;
        most = T > most ? T : most;
    }
    float *c = malloc((size_t)(most * (C + R)) * sizeof(float) + 64);
    if (!c) return 1;
    float *pe = c + most * C;
    int rc = 0;
    for (int64_t i = 0; i < nchunks && !rc; i++) {
        const int64_t a = chunks[3 * i], S = chunks[3 * i + 1], start = chunks[3 * i + 2], T = start + S;
        const int64_t *blocks = table + i * W;
        for (int64_t t = 0; t < T;) {                /* the tokens, a block's run at a time */
            const int64_t blk = blocks[t / block_size], off = t % block_size;
            const int64_t run = block_size - off < T - t ? block_size - off : T - t;
            load_rows(c + t * C, C, &cs, blk, off, run);
            load_rows(pe + t * R, R, &ps, blk, off, run);
            t += run;
        }
        rc = mha_prefill(q_nope + a * H * dn, q_pe + a * H * R, S, H, dn, R, dv, c, pe, start, C, wpack, s_k, scale,
                         amx_ok, o + a * H * dv);
    }
    free(c);
    return rc;
}
