/* The engine's float work outside the int8 linears and attention, on the CPU (pipeline.engine.cpu_float):
 *
 *   bf16_linear y[i, j] = sum_k x[i, k] * W[j, k]           x float32 [m, k] (row stride ldx), W bf16 packed
 *               (bf16_gemm.h: the float model's bias-free linears and its lm_head)
 *   rms_norm    y[i] = w * cast(x[i] * 1/sqrt(sum_k x[i,k]^2 / dim + eps))     (pipeline.model.norm.RMSNorm)
 *   argmax_rows out[r] = the first index of row r's maximum, a NaN counting as the maximum (torch.argmax)
 *   moe_router  Router.forward (pipeline.model.ffn) from its logits (torch's GEMM): sigmoid scores, grouped
 *               top-2 group scores, the best topk_group groups, the top_k experts by biased score among
 *               them, normalised weights
 *
 * bf16 -> float32 is a 16-bit shift (exact), so the linears' products are the float32 model's products;
 * sums accumulate in float32 (FMA) in another order than torch's GEMMs and reductions: results
 * agree within float32 rounding of the summation order, not bit for bit. The element-wise steps (the
 * normalisation's products, the bf16 rounding to nearest even, sigmoid, the weights' division) are
 * torch's operations in torch's order; built with -ffp-contract=off so no a*b+c is fused there.
 * Returns 0, or 1 (out of memory), 2 (bad sizes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#if defined(__AVX512F__) || DSQUANT_AVX2
#include <immintrin.h>
#endif
#include "bf16_gemm.h"
#include "pool.h"

static inline float load_elem(const void *p, int dtype, int64_t i) {
    return dtype == DT_BF16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* n elements (bf16 or float32) -> float32 */
static void row_to_f32(float *restrict dst, const void *src, int dtype, int64_t n) {
    if (dtype == DT_F32) { memcpy(dst, src, (size_t)n * 4); return; }
    const uint16_t *s = (const uint16_t *)src;
    uint32_t *d = (uint32_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
}

#ifdef __AVX512F__
static inline __m512 ld_bf16(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
#elif DSQUANT_AVX2
static inline __m256 ld_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#endif

/* y [m, n] (contiguous) = x [m, k] (rows ldx apart, float32) @ W.T, W packed (bf16_gemm.h) */
/* 1 when bf16_linear's calls with k % 32 == 0 run on the AMX tiles */
int bf16_linear_has_amx(void) { return bf16_gemm_has_amx(); }

/* Columns in tasks of BF16_TASK_COLS for the pool's threads (pool.h): a column's result does not depend on
 * the tiling (bf16_gemm.h), so the bits do not depend on the thread count. */
#define BF16_TASK_COLS 128

typedef struct {
    const float *const *xr;
    int64_t m, k, n;
    const uint32_t *pack;
    float *y;
    _Atomic int err;
} bf16_job_t;

static void bf16_task(void *ctx, int64_t t) {
    bf16_job_t *J = ctx;
    const int64_t c0 = t * BF16_TASK_COLS, nc = J->n - c0 < BF16_TASK_COLS ? J->n - c0 : BF16_TASK_COLS;
    if (bf16_gemm(J->xr, J->m, J->k, J->pack + (c0 / 16) * bf16_gemm_pairs(J->k) * 16, nc, J->y + c0, J->n))
        J->err = 1;
}

int bf16_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const uint32_t *pack, int64_t n, float *y) {
    if (m < 0 || n < 1 || k < 1 || ldx < k) return 2;
    const float **xr = (const float **)malloc((size_t)(m ? m : 1) * sizeof(float *));
    if (!xr) return 1;
    for (int64_t i = 0; i < m; i++) xr[i] = x + i * ldx;
    bf16_job_t J = {xr, m, k, n, pack, y, 0};
    if (m) pool_run(bf16_task, &J, (n + BF16_TASK_COLS - 1) / BF16_TASK_COLS);
    free(xr);
    return J.err ? 1 : 0;
}

/* sum_k a[k] * b[k] in float32 (a float32, b float32 or bf16 bits) */
static float dot(const float *a, const void *b, int bdt, int64_t k) {
    int64_t c = 0;
    float s = 0.0f;
#ifdef __AVX512F__
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    const float *bf = (const float *)b;
    const uint16_t *bh = (const uint16_t *)b;
    for (; c + 32 <= k; c += 32) {
        __m512 b0 = bdt == DT_BF16 ? ld_bf16(bh + c) : _mm512_loadu_ps(bf + c);
        __m512 b1 = bdt == DT_BF16 ? ld_bf16(bh + c + 16) : _mm512_loadu_ps(bf + c + 16);
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), b0, acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + c + 16), b1, acc1);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif DSQUANT_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const float *bf = (const float *)b;
    const uint16_t *bh = (const uint16_t *)b;
    for (; c + 16 <= k; c += 16) {
        __m256 b0 = bdt == DT_BF16 ? ld_bf16(bh + c) : _mm256_loadu_ps(bf + c);
        __m256 b1 = bdt == DT_BF16 ? ld_bf16(bh + c + 8) : _mm256_loadu_ps(bf + c + 8);
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), b0, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), b1, acc1);
    }
    s = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; c < k; c++) s += a[c] * load_elem(b, bdt, c);
    return s;
}

/* y [rows, dim] (contiguous, dtype ydt) = RMSNorm(x [rows, dim], rows ldx apart): r = 1/sqrt(sum x^2 / dim
 * + eps) in float32; t = x * r rounded to x's dtype; y = w * t in float32, rounded to ydt (bf16: nearest
 * even). x, w: DT_F32 or DT_BF16; ydt: DT_F32, or DT_BF16 when both are bf16 (torch's promotion). */
int rms_norm(const void *x, int xdt, int64_t rows, int64_t dim, int64_t ldx, const void *w, int wdt, float eps,
             void *y, int ydt) {
    if (rows < 0 || dim < 1 || ldx < dim) return 2;
    float *buf = (float *)malloc((size_t)dim * 4), *wf = (float *)malloc((size_t)dim * 4);
    if (!buf || !wf) { free(buf); free(wf); return 1; }
    row_to_f32(wf, w, wdt, dim);
    const size_t xs = dtype_size(xdt);
    for (int64_t r = 0; r < rows; r++) {
        row_to_f32(buf, (const char *)x + (size_t)(r * ldx) * xs, xdt, dim);
        const float ss = dot(buf, buf, DT_F32, dim);
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *yf = (float *)y + r * dim;
        uint16_t *yh = (uint16_t *)y + r * dim;
        for (int64_t c = 0; c < dim; c++) {
            float t = buf[c] * inv;
            if (xdt == DT_BF16) t = bf16_to_float(float_to_bf16(t));
            const float v = wf[c] * t;
            if (ydt == DT_BF16) yh[c] = float_to_bf16(v); else yf[c] = v;
        }
    }
    free(buf);
    free(wf);
    return 0;
}

/* the index of the largest of v[0..n) not taken (ties: the lowest index; NaN above all, as torch.topk
 * orders it), -1 when all are taken */
static int64_t argmax_free(const float *v, const unsigned char *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; e++)
        if (!taken[e] && (best < 0 || v[e] > v[best] || (v[e] != v[e] && v[best] == v[best]))) best = e;
    return best;
}

/* Router.forward's selection for N rows of its float32 logits [N, E] (x @ W.T, computed by the caller with
 * torch's GEMM: a row's logits then never depend on the call's other rows) and the float32 correction
 * bias [E]: weights [N, top_k] float32, idx [N, top_k] int64 (experts in descending biased score, as
 * torch.topk returns them; ties to the lower index). */
int moe_router(const float *logits, int64_t N, int64_t E, const float *bias, int64_t n_group, int64_t topk_group,
               int64_t top_k, int norm, float scaling, float *weights, int64_t *idx) {
    if (N < 0 || n_group < 1 || E % n_group || E / n_group < 2 || topk_group < 1 ||
        topk_group > n_group || top_k < 1 || top_k > topk_group * (E / n_group))
        return 2;
    const int64_t gs = E / n_group;
    float *buf = (float *)malloc((size_t)(2 * E + n_group) * 4);
    unsigned char *taken = (unsigned char *)malloc((size_t)(E + n_group));
    if (!buf || !taken) { free(buf); free(taken); return 1; }
    float *score = buf, *masked = score + E, *gscore = masked + E;
    unsigned char *gtaken = taken + E;
    const float *zr = logits;
    for (int64_t r = 0; r < N; r++, zr += E) {
        float *biased = masked;      /* (overwritten by the masked scores below) */
        for (int64_t e = 0; e < E; e++) {
            score[e] = 1.0f / (1.0f + expf(-zr[e]));
            biased[e] = score[e] + bias[e];
        }
        for (int64_t g = 0; g < n_group; g++) {       /* the sum of the group's two best biased scores */
            const float *v = biased + g * gs;
            int64_t a = 0;
            for (int64_t e = 1; e < gs; e++) if (v[e] > v[a]) a = e;
            int64_t b = a == 0 ? 1 : 0;
            for (int64_t e = 0; e < gs; e++) if (e != a && v[e] > v[b]) b = e;
            gscore[g] = v[a] + v[b];
        }
        memset(gtaken, 0, (size_t)n_group);
        for (int64_t t = 0; t < topk_group; t++) gtaken[argmax_free(gscore, gtaken, n_group)] = 1;
        for (int64_t e = 0; e < E; e++) if (!gtaken[e / gs]) masked[e] = -INFINITY;
        memset(taken, 0, (size_t)E);
        float *wr = weights + r * top_k, sum = 0.0f;
        int64_t *ir = idx + r * top_k;
        for (int64_t t = 0; t < top_k; t++) {
            const int64_t e = argmax_free(masked, taken, E);
            taken[e] = 1;
            ir[t] = e;
            wr[t] = score[e];
        }
        if (norm) {
            for (int64_t t = 0; t < top_k; t++) sum += wr[t];
            const float den = sum + 1e-20f;
            for (int64_t t = 0; t < top_k; t++) wr[t] = wr[t] / den;
        }
        for (int64_t t = 0; t < top_k; t++) wr[t] = wr[t] * scaling;
    }
    free(buf);
    free(taken);
    return 0;
}

/* Rotary embedding of interleaved pairs (pipeline.model.rope.apply_rope): x [n, heads, d] (rows ldr
 * elements apart, heads ldh apart; float32 or bf16), cos / sin [n, d/2] float32 -> out [n, heads, d]
 * (contiguous) in x's dtype:  out[2i] = x[2i] c_i - x[2i+1] s_i,  out[2i+1] = x[2i+1] c_i + x[2i] s_i,
 * each product and sum one float32 operation as torch does them (no contraction), then rounded to bf16
 * to nearest even for a bf16 x: the same bits as apply_rope. */
int rope(const void *x, int dt, int64_t n, int64_t heads, int64_t ldr, int64_t ldh, int64_t d, const float *cos,
         const float *sin, void *out) {
    if (n < 0 || heads < 1 || d < 2 || d % 2 || (dt != DT_BF16 && dt != DT_F32)) return 2;
    const int64_t half = d / 2;
    for (int64_t r = 0; r < n; r++) {
        const float *cr = cos + r * half, *sr = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t src = r * ldr + h * ldh, dst = (r * heads + h) * d;
            for (int64_t i = 0; i < half; i++) {
                const float x0 = load_elem(x, dt, src + 2 * i), x1 = load_elem(x, dt, src + 2 * i + 1);
                const float a = x0 * cr[i], b = x1 * sr[i], e = x1 * cr[i], f = x0 * sr[i];
                const float o0 = a - b, o1 = e + f;
                if (dt == DT_BF16) {
                    ((uint16_t *)out)[dst + 2 * i] = float_to_bf16(o0);
                    ((uint16_t *)out)[dst + 2 * i + 1] = float_to_bf16(o1);
                } else {
                    ((float *)out)[dst + 2 * i] = o0;
                    ((float *)out)[dst + 2 * i + 1] = o1;
                }
            }
        }
    }
    return 0;
}

/* out[r] = argmax of x[r * ld + 0 .. n) (n >= 1): the first index of the maximum, or of the first NaN */
int argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out) {
    if (rows < 0 || n < 1 || ld < n) return 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * ld;
        float m = v[0];
        int64_t j = 0;
        int nan = 0;
#ifdef __AVX512F__
        __m512 vm = _mm512_set1_ps(v[0]);
        __mmask16 un = 0;
        for (; j + 16 <= n; j += 16) {
            const __m512 a = _mm512_loadu_ps(v + j);
            un |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            vm = _mm512_max_ps(vm, a);
        }
        nan = un != 0;
        m = _mm512_reduce_max_ps(vm);
#elif DSQUANT_AVX2
        __m256 vm = _mm256_set1_ps(v[0]);
        int un = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 a = _mm256_loadu_ps(v + j);
            un |= _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            vm = _mm256_max_ps(vm, a);
        }
        nan = un != 0;
        m = hmax8(vm);
#endif
        for (; j < n; j++) {
            if (v[j] != v[j]) nan = 1;
            else if (v[j] > m) m = v[j];
        }
        int64_t best = 0;
        if (nan) {
            while (v[best] == v[best]) best++;
        } else {
            while (v[best] != m) best++;
        }
        out[r] = best;
    }
    return 0;
}
