/* The float model's feed-forward blocks on the CPU, every token in one call (pipeline/engine/cpu_float_ffn.py):
 * a MoE's routed experts and its shared expert, or a dense MLP (no routed experts).
 *
 * An expert (MLP.forward) on rows r:   gu = x_r @ [W_gate; W_up].T    one packed bf16 GEMM (bf16_gemm.h)
 *                                      h  = gu_gate / (1 + exp(-gu_gate)) * gu_up    (F.silu's formula, then
 *                                                                                       the product, float32)
 *                                      y  = h @ W_down.T
 * MoE.forward (pipeline.model.ffn):    the (token, k) slots sorted by expert, stable (combine_experts'
 *                                      argsort(stable=True)); per expert with tokens, y on its tokens' rows
 *                                      (read in place, no gather); out[t] = out[t] + y * w[slot] in that
 *                                      order from 0 (index_add_'s two roundings); then out[t] = out[t] +
 *                                      y_shared[t] (``out + shared_experts(flat)``)
 * a dense MLP (E = 0):                 out = y on all rows
 *
 * The products and the element-wise operations are torch's float32 operations in torch's order (built
 * with -ffp-contract=off); the GEMMs sum in another order than torch's (bf16_gemm.h: an FMA chain, or the
 * AMX tiles) and the exp (vexp.h's Cephes polynomial with AVX-512 or AVX2, else libm's expf) may differ from
 * torch's vectorized exp by an ulp or two, so outputs agree within float32 rounding, not bit for bit. A
 * token's output depends only on its own row and routing, never on the other tokens of the call.
 * Returns 0, 1 (out of memory), 2 (bad sizes) or 3 (an expert id outside [0, E)).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_gemm.h"
#if defined(__AVX512F__) || DSQUANT_AVX2
#include "vexp.h"
#endif

typedef struct {                   /* must match cpu_float_ffn.FFNParams */
    int64_t E, H, I, Is;           /* routed experts (E may be 0), hidden, their and the shared intermediate */
    const uint32_t *gate_up;       /* E x packed [2I, H] */
    const uint32_t *down;          /* E x packed [H, I] */
    const uint32_t *s_gate_up;     /* packed [2Is, H] (Is > 0) */
    const uint32_t *s_down;        /* packed [H, Is] */
} float_ffn_t;

static inline int64_t packed_words(int64_t n, int64_t k) { return bf16_gemm_blocks(n) * bf16_gemm_pairs(k) * 16; }

/* h[j] = g[j] / (1 + exp(-g[j])) * u[j], j < I: F.silu's formula, then the product (with AVX-512 or AVX2
 * every element through the same vector code, vexp.h, a tail masked; else libm's expf) */
static void silu_mul(const float *g, const float *u, float *h, int64_t I) {
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t j = 0; j < I; j += 16) {
        const __mmask16 mk = tail_mask16(I - j);
        const __m512 gv = _mm512_maskz_loadu_ps(mk, g + j), uv = _mm512_maskz_loadu_ps(mk, u + j);
        const __m512 e = vexp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_mask_storeu_ps(h + j, mk, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv));
    }
#elif DSQUANT_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t j = 0; j < I; j += 8) {
        const __m256i mk = tail_mask8(I - j);
        const __m256 gv = _mm256_maskload_ps(g + j, mk), uv = _mm256_maskload_ps(u + j, mk);
        const __m256 e = vexp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_maskstore_ps(h + j, mk, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv));
    }
#else
    for (int64_t j = 0; j < I; j++) h[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
#endif
}

/* y [n, H] (rows ldy apart) = the expert on rows xr[0..n): scratch gu [n, 2I], h [n, I], hr [n]; 0 or 1 */
static int expert(const float *const *xr, int64_t n, int64_t H, int64_t I, const uint32_t *gu_pack,
                  const uint32_t *dn_pack, float *gu, float *h, const float **hr, float *y, int64_t ldy) {
    if (bf16_gemm(xr, n, H, gu_pack, 2 * I, gu, 2 * I)) return 1;
    for (int64_t r = 0; r < n; r++) {
        const float *g = gu + r * 2 * I;
        silu_mul(g, g + I, h + r * I, I);
        hr[r] = h + r * I;
    }
    return bf16_gemm(hr, n, I, dn_pack, H, y, ldy);
}

/* x [N, H] float32 (rows ldx apart); with routed experts idx / w [N, top_k] (int64 expert ids, float32
 * router weights) and load [E] (out: slots per expert) -> out [N, H] float32 (contiguous). */
int float_ffn(const float_ffn_t *M, const float *x, int64_t N, int64_t ldx, int64_t top_k, const int64_t *idx,
              const float *w, int64_t *load, float *out) {
    const int64_t E = M->E, H = M->H, I = M->I, Is = M->Is, S = E ? N * top_k : 0;
    if (N < 0 || E < 0 || H < 1 || ldx < H || (E && (top_k < 1 || I < 1)) || Is < 0 || (!E && !Is)) return 2;
    for (int64_t e = 0; e < E; e++) load[e] = 0;
    for (int64_t i = 0; i < S; i++) {
        if (idx[i] < 0 || idx[i] >= E) return 3;
        load[idx[i]]++;
    }
    int64_t most = Is ? N : 0;
    for (int64_t e = 0; e < E; e++) most = load[e] > most ? load[e] : most;
    if (E) memset(out, 0, (size_t)(N * H) * sizeof(float));
    if (!most) return 0;
    const int64_t Im = I > Is ? I : Is;
    int64_t *start = (int64_t *)malloc((size_t)(E + 1 + S) * sizeof(int64_t));
    float *gu = (float *)malloc((size_t)(most * (3 * Im + H)) * sizeof(float));
    const float **rows = (const float **)malloc((size_t)most * 2 * sizeof(float *));
    if (!start || !gu || !rows) { free(start); free(gu); free(rows); return 1; }
    int64_t *order = start + E + 1;
    int rc = 0;
    float *h = gu + most * 2 * Im, *y = h + most * Im;
    const float **hr = rows + most;
    start[0] = 0;
    for (int64_t e = 0; e < E; e++) start[e + 1] = start[e] + load[e];
    for (int64_t i = 0; i < S; i++) order[start[idx[i]]++] = i;      /* counting sort: stable */
    const int64_t gu_words = packed_words(2 * I, H), dn_words = packed_words(H, I);
    for (int64_t e = 0, r0 = 0; e < E; r0 += load[e], e++) {
        const int64_t ne = load[e];
        if (!ne) continue;
        for (int64_t r = 0; r < ne; r++) rows[r] = x + (order[r0 + r] / top_k) * ldx;
        if (expert(rows, ne, H, I, M->gate_up + e * gu_words, M->down + e * dn_words, gu, h, hr, y, H)) {
            rc = 1;
            goto done;
        }
        for (int64_t r = 0; r < ne; r++) {
            const int64_t slot = order[r0 + r];
            const float ws = w[slot], *yr = y + r * H;
            float *o = out + (slot / top_k) * H;
            for (int64_t j = 0; j < H; j++) o[j] = o[j] + yr[j] * ws;
        }
    }
    if (Is && N) {
        for (int64_t r = 0; r < N; r++) rows[r] = x + r * ldx;
        if (expert(rows, N, H, Is, M->s_gate_up, M->s_down, gu, h, hr, E ? y : out, H)) {
            rc = 1;
            goto done;
        }
        if (E)
            for (int64_t i = 0; i < N * H; i++) out[i] = out[i] + y[i];
    }
done:
    free(start);
    free(gu);
    free(rows);
    return rc;
}
