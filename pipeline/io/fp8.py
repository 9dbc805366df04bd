"""FP8 e4m3 block quantization in the DeepSeek-V3 release's convention: pure tensor functions.

A weight W [out, in] is stored as Wq (float8_e4m3fn, same shape) and ``scale_inv`` s (float32,
[ceil(out / b0), ceil(in / b1)]), one scale per b0 x b1 block (128 x 128 in the release), so that

    W[i, j] = float(Wq[i, j]) * s[i // b0, j // b1]

The last block row/column may be partial ("ragged": kv_a_proj_with_mqa is [576, 7168], 576 = 4.5 * 128,
scale [5, 56]); it has a scale of its own like any other block.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448 = 1.75 * 2^8, e4m3fn's largest finite value
DEFAULT_BLOCK = (128, 128)
# e4m3 code (sign-extended to int16) << 7, masked to sign | exponent | mantissa, is float16 Wq / 2^8.
_F16_SIGN_EXP_MANT = 0xBF80 - 0x10000  # as a signed int16
_F16_TO_E4M3 = 2.0 ** 8


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """[ceil(out / b0), ceil(in / b1)]: the scale_inv shape of a 2-D weight."""
    if len(shape) != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got shape {list(shape)}")
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def expand_scale(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """The per-element scale [out, in]: ``S[i, j] = s[i // b0, j // b1]`` (ragged edges cut off)."""
    rows = scale_inv.repeat_interleave(block[0], dim=0)[: shape[0]]
    return rows.repeat_interleave(block[1], dim=1)[:, : shape[1]]


def dequantize_fp8_blocks(w_fp8: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int] = DEFAULT_BLOCK, dtype: torch.dtype = torch.bfloat16,
                          name: str = "weight") -> torch.Tensor:
    """``W = float32(Wq) * S`` with ``S[i, j] = s[i // b0, j // b1]``, computed in float32, then cast to
    ``dtype``. w_fp8: [out, in] float8_e4m3fn; scale_inv: [ceil(out / b0), ceil(in / b1)].

    Bit-identical to that formula, but computed one block row at a time (ragged edges included) straight
    into the ``dtype`` output, never materializing the per-element scale or a float32 copy: each block row's
    codes are decoded with integer ops as float16 values ``Wq / 2^8`` (exact: e4m3's 4-bit exponent and
    3-bit mantissa fit float16's, its subnormals included, and float16 subnormals convert exactly) and
    multiplied in float32 by ``s * 2^8`` (exact: a power of two), so the float32 product, rounded once, is
    the formula's. A scale row whose ``s * 2^8`` overflows float32 takes the formula itself.
    NaN codes come out as arbitrary values: check the codes first (:func:`fp8_nan_count`).

    Raises ValueError naming ``name`` when the dtypes or the scale shape do not fit the weight.
    """
    return BlockRows(w_fp8, scale_inv, block, name, dtype).materialize()


class BlockRows:
    """An FP8 block weight dequantized one block row at a time into a caller's buffer, bit-identical to
    :func:`dequantize_fp8_blocks` (which is built on it): for consumers that need only a block row at a
    time (per-output-channel quantization), so that the whole weight never exists in a wider dtype.
    ``dtype`` is what :meth:`materialize` gives (the block rows go into any float buffer).
    Raises ValueError naming ``name`` when the dtypes or the scale shape do not fit the weight."""

    def __init__(self, w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                 name: str = "weight", dtype: torch.dtype = torch.bfloat16):
        if w_fp8.dtype != FP8_DTYPE:
            raise ValueError(f"tensor {name!r}: expected {FP8_DTYPE}, got {w_fp8.dtype}")
        if w_fp8.dim() != 2:
            raise ValueError(f"tensor {name!r}: FP8 block weights are 2-D, got shape {list(w_fp8.shape)}")
        want = scale_shape(w_fp8.shape, block)
        if tuple(scale_inv.shape) != want:
            raise ValueError(
                f"tensor {name!r}: scale_inv shape {list(scale_inv.shape)} does not match weight shape "
                f"{list(w_fp8.shape)} with block {list(block)} (expected {list(want)})")
        if not scale_inv.dtype.is_floating_point:
            raise ValueError(f"tensor {name!r}: scale_inv must be floating point, got {scale_inv.dtype}")
        self.w_fp8, self.scale_inv, self.block, self.name = w_fp8, scale_inv, block, name
        self.dtype = dtype  # what the weight dequantizes to (materialize)
        self.shape = tuple(w_fp8.shape)
        self.count = scale_inv.shape[0]
        self._codes = w_fp8.contiguous().view(torch.int8)
        self._scaled = scale_inv.to(torch.float32) * _F16_TO_E4M3  # [r, c], one scale per block
        self._exact = torch.isfinite(self._scaled).all(dim=1).tolist()  # False where s * 2^8 overflowed

    def materialize(self) -> torch.Tensor:
        """The whole weight in ``dtype``: :func:`dequantize_fp8_blocks`."""
        out = torch.empty(self.shape, dtype=self.dtype)
        for i in range(self.count):
            r0, r1 = self.bounds(i)
            self.dequantize(i, out[r0:r1])
        return out

    def bounds(self, i: int) -> tuple[int, int]:
        """The rows [r0, r1) of block row ``i`` (the last one may be short)."""
        return i * self.block[0], min((i + 1) * self.block[0], self.shape[0])

    def dequantize(self, i: int, out: torch.Tensor) -> None:
        """Block row ``i`` into ``out`` ([r1 - r0, cols], any float dtype): see dequantize_fp8_blocks."""
        (r0, r1), cols, b1 = self.bounds(i), self.shape[1], self.block[1]
        if not self._exact[i]:  # the formula itself
            w = self.w_fp8[r0:r1].to(torch.float32)
            out.copy_(w.mul_(self.scale_inv[i].to(torch.float32).repeat_interleave(b1)[:cols]))
            return
        srow = self._scaled[i].repeat_interleave(b1)[:cols]  # the scale of every column of this block row
        half = self._codes[r0:r1].to(torch.int16).bitwise_left_shift_(7).bitwise_and_(_F16_SIGN_EXP_MANT)
        torch.mul(half.view(torch.float16), srow, out=out)


def fp8_nan_count(w_fp8: torch.Tensor) -> int:
    """The number of NaN codes (S.1111.111; e4m3fn has no Inf) in a float8_e4m3fn tensor. Two integer
    max reductions answer "none" (the common case); only then are they counted."""
    if w_fp8.numel() == 0:
        return 0
    codes = w_fp8.contiguous().view(torch.uint8)
    if int(codes.view(torch.int8).max()) != 0x7F and int(codes.max()) != 0xFF:  # +NaN is the largest int8,
        return 0                                                                # -NaN the largest uint8
    return int(((codes & 0x7F) == 0x7F).sum())


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                        name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a 2-D float weight [out, in] the way the release stores it.

    Per block B: ``s_B = amax(|W_B|) / 448`` (float32; 1.0 for an all-zero block, whose values quantize
    to 0 under any scale) and ``Wq_B = e4m3(clamp(W_B / s_B, -448, 448))`` (round to nearest even). The
    block's largest magnitude maps to 448; the clamp only absorbs the last-bit rounding of the division.
    Returns (w_fp8 [out, in] float8_e4m3fn, scale_inv [ceil(out / b0), ceil(in / b1)] float32).
    """
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"tensor {name!r}: expected a 2-D float weight, got {w.dtype} {list(w.shape)}")
    x = w.to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError(f"tensor {name!r}: cannot quantize non-finite values")
    (out, inp), (r, c) = x.shape, scale_shape(x.shape, block)
    padded = torch.zeros(r * block[0], c * block[1], dtype=torch.float32)  # zeros leave amax unchanged
    padded[:out, :inp] = x
    amax = padded.view(r, block[0], c, block[1]).abs().amax(dim=(1, 3))  # [r, c]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / expand_scale(scale_inv, (out, inp), block)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv
