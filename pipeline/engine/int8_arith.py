"""The arithmetic under the int8 linears (:mod:`pipeline.engine.layers.qlinear`): activation quantization
(static and per token, the quantizer's formulas op for op), the two stored forms of ``deq_scale``, and
the exact integer product ``x_q @ W8.T`` on the torch kernels.

Kernels (:func:`select_kernel`; a module's ``kernel`` forces one, ``last_kernel`` says which ran; the fused C
forward, ``native``, is the module's: qlinear's docstring):

- ``int_mm``: ``torch._int_mm`` (int8 x int8 -> int32), the default on every device when k and n are multiples of 8 and
  k <= 131071 (|acc| <= 128 * 128 * k stays inside int32); on CUDA, fewer than 17 rows are zero-padded to
  32 (its kernel refuses them; the CPU's takes any number of rows). The shape rule holds on every device
  (on the CPU, torch 2.13's ``_int_mm`` returns garbage for k = 1).
- ``fp32_chunked``: the CPU fallback for shapes ``_int_mm`` refuses. fp32 GEMMs over K-chunks of 1024 columns: every
  partial sum of a chunk is an integer of magnitude <= 128 * 128 * 1024 = 2^24, all of which float32 holds exactly,
  so each chunk's product is exact whatever order the GEMM sums in; chunks are summed in float64 (exact below 2^53).
- ``float64``: one float64 GEMM, exact for k < 2^39; CUDA's fallback for shapes ``_int_mm`` refuses.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

QMIN, QMAX = -128, 127
F32_EPS = torch.finfo(torch.float32).eps
INT_MM, FP32_CHUNKED, FLOAT64 = "int_mm", "fp32_chunked", "float64"
KERNELS = (INT_MM, FP32_CHUNKED, FLOAT64)         # int8_matmul's
MAX_ABS_PRODUCT = 128 * 128                       # |x_q * w| <= 2^14
FP32_EXACT_CHUNK = 2 ** 24 // MAX_ABS_PRODUCT     # 1024: every partial sum of a chunk is an exact float32
INT_MM_MAX_K = (2 ** 31 - 1) // MAX_ABS_PRODUCT   # 131071: the int32 accumulator cannot overflow
INT_MM_MIN_ROWS = 17                              # torch._int_mm on CUDA needs more than 16 rows
INT_MM_PAD_ROWS = 32
FLOAT64_MAX_K = 2 ** 53 // MAX_ABS_PRODUCT
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DeviceLike = Union[str, torch.device]


class Int8LinearError(ValueError):
    """A bad stored tensor, type or input of an int8 linear; the message names the linear and the tensor."""


# ----- activation quantization ---------------------------------------------------------------------
def quantize_static(x: Tensor, input_scale: Tensor, input_offset: Tensor) -> Tensor:
    """x [..., k] -> int8 clamp(round(x / s + o), -128, 127), computed in float32 (round half to even):
    the quantizer's (qparams.quantize_static) formula, op for op."""
    q = torch.round(x.float() / input_scale.float() + input_offset.float())
    return torch.clamp(q, QMIN, QMAX).to(torch.int8)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., k] -> (x_q int8 [..., k], s_tok float32 [..., 1]): s_tok = max(max_j |x_j| / 127, eps),
    x_q = clamp(round(x / s_tok), -128, 127), in float32 (qparams.dynamic_quant_per_token's formula)."""
    xf = x.float()
    return quantize_with_absmax(xf, xf.abs().amax(dim=-1, keepdim=True))


def quantize_with_absmax(xf: Tensor, absmax: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`quantize_per_token` of float32 ``xf`` given its rows' absmax [..., 1] (a row-parallel linear
    holds a slice of each row and all-reduces the slices' maxima first: the same scale, the same int8)."""
    s = torch.clamp(absmax / 127, min=F32_EPS)
    return torch.clamp(torch.round(xf / s), QMIN, QMAX).to(torch.int8), s


# ----- deq_scale -----------------------------------------------------------------------------------
def decode_deq_scale(deq: Tensor, name: str = "deq_scale") -> Tensor:
    """The float32 deq_scale of either stored form: float32 as is; int64 -> its low 32 bits read as a
    float32 bit pattern. The high 32 bits must be zero or the sign extension of bit 31 (how
    ``view(int32).to(int64)`` writes it); anything else is not a bit pattern. The values must be finite
    and >= 0 (deq_scale = input_scale * weight_scale)."""
    if not isinstance(deq, Tensor):
        raise Int8LinearError(f"{name}: expected a tensor, got {type(deq).__name__}")
    if deq.dtype == torch.float32:
        out = deq
    elif deq.dtype == torch.int64:
        if deq.numel() and (int(deq.min()) < -2 ** 31 or int(deq.max()) >= 2 ** 32):
            raise Int8LinearError(f"{name}: int64 values outside [-2^31, 2^32) are not float32 bit patterns "
                                  f"(min {int(deq.min())}, max {int(deq.max())})")
        out = _bits_to_float32(deq)
    else:
        raise Int8LinearError(f"{name}: dtype {deq.dtype}; expected float32, or int64 holding float32 bit "
                              f"patterns (fp16 models)")
    if out.numel() and not bool(torch.isfinite(out).all()):
        raise Int8LinearError(f"{name}: {int((~torch.isfinite(out)).sum())} non-finite values")
    if out.numel() and bool((out < 0).any()):
        raise Int8LinearError(f"{name}: negative values (min {float(out.min())})")
    return out


def _bits_to_float32(deq: Tensor) -> Tensor:
    """int64 -> float32 read from the low 32 bits (no checks; float32 passes through)."""
    if deq.dtype == torch.float32:
        return deq
    low = deq & 0xFFFFFFFF                                            # [0, 2^32)
    return torch.where(low >= 2 ** 31, low - 2 ** 32, low).to(torch.int32).view(torch.float32)


# ----- the exact integer product -------------------------------------------------------------------
def select_kernel(device: DeviceLike, n: int, k: int) -> str:
    """The kernel a linear with weight [n, k] uses on ``device``: ``int_mm`` when k % 8 == 0, n % 8 == 0
    and k <= INT_MM_MAX_K (on CUDA and on the CPU, where torch 2.13's ``_int_mm`` beats ``fp32_chunked`` at
    every row count: benchmarks/cpu_linear.json); otherwise ``float64`` on CUDA and ``fp32_chunked``
    elsewhere."""
    if k % 8 == 0 and n % 8 == 0 and 0 < k <= INT_MM_MAX_K:
        return INT_MM
    return FLOAT64 if torch.device(device).type == "cuda" else FP32_CHUNKED


def int8_matmul(x_q: Tensor, w: Tensor, kernel: str, w_f32: Optional[Tensor] = None,
                chunk: int = FP32_EXACT_CHUNK) -> Tensor:
    """x_q int8 [m, k] @ w int8 [n, k].T, exactly: float64 [m, n] holding the true integers.

    ``kernel`` is one of KERNELS (see the module docstring for why each is exact). ``w_f32``: w as float32
    (a cache, for ``fp32_chunked``). ``chunk`` (<= FP32_EXACT_CHUNK) is the K-chunk of ``fp32_chunked``."""
    if x_q.dtype != torch.int8 or w.dtype != torch.int8 or x_q.dim() != 2 or w.dim() != 2:
        raise Int8LinearError(f"int8_matmul: expected int8 [m, k] and [n, k], got {x_q.dtype} "
                              f"{list(x_q.shape)} and {w.dtype} {list(w.shape)}")
    m, k = x_q.shape
    if w.shape[1] != k:
        raise Int8LinearError(f"int8_matmul: inner dims differ: x_q {list(x_q.shape)}, w {list(w.shape)}")
    if kernel == INT_MM:
        return _int_mm(x_q, w)
    if kernel == FP32_CHUNKED:
        if not 0 < chunk <= FP32_EXACT_CHUNK:
            raise Int8LinearError(f"int8_matmul: chunk {chunk} not in [1, {FP32_EXACT_CHUNK}]: inexact")
        if w_f32 is None:
            w_f32 = w.float()
        elif w_f32.dtype != torch.float32 or w_f32.shape != w.shape:
            raise Int8LinearError(f"int8_matmul: w_f32 must be float32 {list(w.shape)}, got {w_f32.dtype} "
                                  f"{list(w_f32.shape)}")
        return _fp32_chunked(x_q, w_f32, chunk)
    if kernel == FLOAT64:
        if k >= FLOAT64_MAX_K:
            raise Int8LinearError(f"int8_matmul: k = {k} too large for an exact float64 GEMM")
        return x_q.double() @ w.double().T
    raise Int8LinearError(f"int8_matmul: unknown kernel {kernel!r} (known: {', '.join(KERNELS)})")


def _int_mm(x_q: Tensor, w: Tensor) -> Tensor:
    return _int_mm_int32(x_q, w).double()


def _int_mm_int32(x_q: Tensor, w: Tensor) -> Tensor:
    """The int32 accumulator of ``torch._int_mm`` (shape rules checked; CUDA's small row counts padded)."""
    m, k = x_q.shape
    n = w.shape[0]
    if k > INT_MM_MAX_K:
        raise Int8LinearError(f"int8_matmul: k = {k} could overflow int_mm's int32 accumulator")
    if k % 8 or n % 8 or k == 0:  # CUDA's rule, kept on every device: torch 2.13's CPU _int_mm is wrong for k = 1
        raise Int8LinearError(f"int8_matmul: int_mm needs k and n multiples of 8, got k={k}, n={n}")
    a = x_q.contiguous()
    if m < INT_MM_MIN_ROWS and a.is_cuda:  # CUDA refuses <= 16 rows; zero rows add nothing to the rows kept
        a = torch.cat([a, a.new_zeros(INT_MM_PAD_ROWS - m, k)])
        return torch._int_mm(a, w.t())[:m]
    return torch._int_mm(a, w.t())


def _fp32_chunked(x_q: Tensor, w_f32: Tensor, chunk: int) -> Tensor:
    xf = x_q.float()
    k = xf.shape[1]
    acc: Optional[Tensor] = None
    for c0 in range(0, k, chunk):
        part = torch.mm(xf[:, c0:c0 + chunk], w_f32[:, c0:c0 + chunk].T)  # exact integers |.| <= 2^24
        acc = part.double() if acc is None else acc.add_(part)
    if acc is None:  # k == 0
        acc = xf.new_zeros(xf.shape[0], w_f32.shape[0], dtype=torch.float64)
    return acc
