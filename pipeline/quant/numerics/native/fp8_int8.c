/* Per-output-channel int8 quantization of bf16 models' weights, from FP8 e4m3 block weights (one pass
 * per row) or from bf16 weights.
 *
 * Computes exactly what pipeline.quant.numerics.qparams.quantize_weight_per_channel gives for the bf16
 * dequantization of the weight (pipeline.fp8.dequantize_fp8_blocks), each operation rounded as torch
 * rounds it:
 *     W[i, j]  = bf16(float(Wq[i, j]) * s[i / b0, j / b1])          (float32 product, rounded once to bf16)
 *     ws[i]    = max(bf16(bf16(max_j |W[i, j]|) / 127), eps)
 *     W8[i, j] = clamp(rint(bf16(W[i, j] / ws[i])), -128, 127)      (round half to even)
 * max_j |W[i, j]| is taken from the codes: |bf16(x * s)| grows with |x| and e4m3 magnitudes grow with
 * their code's low 7 bits, so each block's largest |code| gives its largest |W|. A NaN code (S.1111.111)
 * makes ws NaN, as a NaN in W makes torch's amax NaN: the caller checks ws and reports the weight.
 * Compile without -ffast-math (it would let the compiler reorder or approximate the float operations).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> bf16 (as a float32 with the low 16 bits clear), round to nearest even: torch's rule. */
static inline float round_bf16(float f) {
    uint32_t x = bits_of(f);
    return float_of((x + 0x7FFFu + ((x >> 16) & 1u)) & 0xFFFF0000u);
}

/* e4m3fn code -> its value (codes 0x7F/0xFF, NaN, give 480 here: callers treat them apart). */
static inline float e4m3_value(uint8_t c) {
    uint32_t e = (c >> 3) & 15u, m = c & 7u, sign = ((uint32_t)(c & 0x80u)) << 24;
    float subnormal = (float)m * (1.0f / 512.0f);
    return float_of(sign | (e ? (((e + 120u) << 23) | (m << 20)) : bits_of(subnormal)));
}

/* codes: [n, k] row-major; scales: [ceil(n / b0), ceil(k / b1)] float32; q: [n, k]; ws: [n];
 * srow: scratch of k floats. */
void fp8_to_int8_bf16(const uint8_t *codes, int64_t n, int64_t k, const float *scales, int64_t b0, int64_t b1,
                      int8_t *q, float *ws, float eps, float *srow) {
    const int64_t nbc = (k + b1 - 1) / b1;
    for (int64_t r0 = 0; r0 < n; r0 += b0) {
        const float *s = scales + (r0 / b0) * nbc;
        for (int64_t j = 0; j < k; j++) srow[j] = s[j / b1];
        const int64_t r1 = r0 + b0 < n ? r0 + b0 : n;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *c = codes + r * k;
            int8_t *qr = q + r * k;
            float amax = 0.0f;
            for (int64_t b = 0; b < nbc; b++) {
                const int64_t j1 = (b + 1) * b1 < k ? (b + 1) * b1 : k;
                uint8_t top = 0;
                for (int64_t j = b * b1; j < j1; j++) {
                    uint8_t v = c[j] & 0x7Fu;
                    top = v > top ? v : top;
                }
                float a = top == 0x7Fu ? NAN : round_bf16(e4m3_value(top) * fabsf(s[b]));
                if (a > amax || a != a) amax = a;
            }
            float scale = round_bf16(amax / 127.0f);
            if (scale < eps) scale = eps; /* a NaN scale stays NaN */
            ws[r] = scale;
            for (int64_t j = 0; j < k; j++) {
                float x = rintf(round_bf16(round_bf16(e4m3_value(c[j]) * srow[j]) / scale));
                qr[j] = (int8_t)(int32_t)(x > 127.0f ? 127.0f : x);
            }
        }
    }
}

/* bf16 weights [n, k] (as uint16 bit patterns) -> int8 [n, k] and ws [n]: the same rules as above with
 * W given. max_j |W[i, j]| is taken on the bit patterns (|W| orders as its low 15 bits; above 0x7F80 is
 * NaN, which makes ws NaN). */
void bf16_to_int8(const uint16_t *w, int64_t n, int64_t k, int8_t *q, float *ws, float eps) {
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = w + r * k;
        int8_t *qr = q + r * k;
        uint16_t top = 0;
        for (int64_t j = 0; j < k; j++) {
            uint16_t v = row[j] & 0x7FFFu;
            top = v > top ? v : top;
        }
        float amax = top > 0x7F80u ? NAN : float_of((uint32_t)top << 16);
        float scale = round_bf16(amax / 127.0f);
        if (scale < eps) scale = eps;
        ws[r] = scale;
        for (int64_t j = 0; j < k; j++) {
            float x = rintf(round_bf16(float_of((uint32_t)row[j] << 16) / scale));
            qr[j] = (int8_t)(int32_t)(x > 127.0f ? 127.0f : x);
        }
    }
}

/* Exact row sums of an int8 [n, k] (k < 2^24: an int32 accumulator cannot overflow) into int64 [n]. */
void int8_row_sums(const int8_t *q, int64_t n, int64_t k, int64_t *out) {
    for (int64_t r = 0; r < n; r++) {
        const int8_t *row = q + r * k;
        int32_t acc = 0;
        for (int64_t j = 0; j < k; j++) acc += row[j];
        out[r] = acc;
    }
}
