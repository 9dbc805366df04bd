/* One step's cache write (PagedLatentCache.write_slots) in one call: token i's row goes to flat slot
 * slots[i] = block * block_size + offset of an ND or NZ store, optionally quantized to int8 on the way.
 *
 * Quantize (an FA3 latent): float32(x) / scale, rounded half to even, clamped to [-127, 127], cast to
 * int8 -- the float32 operations of paged_cache._to_int8 one by one (x -> float32 is exact from
 * bf16 / fp16 / float32; IEEE division; rint in the default rounding mode is round half to even; NaN
 * gives 0 as torch's conversion does). Built with -ffp-contract=off, so the result is bit-identical.
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


static void quantize(int8_t *restrict dst, const void *src, int src_dtype, int64_t n, float scale) {
    for (int64_t j = 0; j < n; j++) {
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
