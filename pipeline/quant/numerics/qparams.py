"""Quantization parameters and the integer arithmetic of the W8A8 / W8A8_DYNAMIC / FA3 format.

Pure tensor functions, one formula each (docs/format.md, "The arithmetic"). "md" is the model dtype
(bf16 or fp16; fp32 also works). Parameters are computed in md, as msModelSlim does, so that the output
equals msModelSlim's bit for bit (float32 arithmetic gives a different int8 for ~10% of the weights).
torch evaluates a bf16/fp16 op in float32 and rounds the result to md, so "in md" means "each
operation rounded to md", in this order:

    weights (per output channel, symmetric):
        ws = max(amax_j |W[i, j]| / 127, eps)          W8 = clamp(round(W / ws), -128, 127)
    static activations (per tensor, asymmetric), lo = min(x_min, 0), hi = max(x_max, 0):
        s  = max(hi / 255 - lo / 255, eps)              o  = clamp(round(-lo / s) - 128, -128, 127)
    export:
        deq_scale  = float32(s * ws[:, 0])              (int64 bit pattern unless md is bf16)
        quant_bias = round(bias / deq_scale - o * sum_j W8[:, j])      int32
        y ~= deq_scale * (x_q @ W8.T + quant_bias),     x_q = clamp(round(x / s + o), -128, 127)
    FA3 (per head for Q, per layer for K and V), from float32 window ends (lo, hi):
        scale = md(max(max(-min(lo, 0), max(hi, 0)) / 127, eps))        offset = 0 (int8)

eps = float32 machine epsilon (2^-23), as in msModelSlim's newer pipeline; it is what keeps an
all-zero weight row or activation range finite: the row quantizes to zeros with weight_scale eps (and
dequantizes to exactly 0), an all-zero activation gets input_scale eps and input_offset -128.
Activations are quantized at run time in float32 (x / s in bf16 would itself round by up to half a step).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from pipeline.quant.numerics import native as native_kernels
from pipeline.io.finite import all_finite
from pipeline.io.fp8 import BlockRows

QMIN, QMAX = -128, 127
_BLOCK_ELEMENTS = 1 << 20  # elements per block of rows in quantize_weight_per_channel: a cache-sized buffer
F32_EPS = torch.finfo(torch.float32).eps
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Number = Union[float, int, Tensor]


class QuantError(ValueError):
    """A bad input to the quantizer; the message names the tensor or field."""


# ----- checks --------------------------------------------------------------------------------------
def check_float(t: Tensor, name: str, ndim: Optional[int] = None, dtypes=MODEL_DTYPES,
                finite: bool = True) -> None:
    """Raise QuantError unless ``t`` is a finite (unless ``finite=False``: left to the caller), non-empty
    float tensor of ``ndim`` dims."""
    if not isinstance(t, Tensor):
        raise QuantError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise QuantError(f"{name}: dtype {t.dtype} is not one of {list(dtypes)}")
    if ndim is not None and t.dim() != ndim:
        raise QuantError(f"{name}: expected {ndim} dims, got shape {list(t.shape)}")
    if t.numel() == 0:
        raise QuantError(f"{name}: empty tensor of shape {list(t.shape)}")
    if finite and not all_finite(t):
        _raise_nonfinite(t, name)


def _raise_nonfinite(t: Tensor, name: str) -> None:
    raise QuantError(f"{name}: {int((~torch.isfinite(t)).sum())} non-finite values (NaN/Inf)")


def _check_int8(t: Tensor, name: str, ndim: int) -> None:
    if not isinstance(t, Tensor) or t.dtype != torch.int8 or t.dim() != ndim or t.numel() == 0:
        what = f"{t.dtype} {list(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        raise QuantError(f"{name}: expected a non-empty {ndim}-D int8 tensor, got {what}")


def _eps(md: torch.dtype) -> Tensor:
    return torch.tensor(F32_EPS, dtype=md)


# ----- weights -------------------------------------------------------------------------------------
def quantize_weight_per_channel(w: Union[Tensor, BlockRows], name: str = "weight", *,
                                native: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """W [n, k] (md) -> (int8 [n, k], weight_scale md [n, 1], weight_offset md zeros [n, 1]).

    ws = max(amax_j |W[i, j]| / 127, eps) and W8 = clamp(round(W / ws), -128, 127), every op in md,
    round half to even. All-zero row rule: ws = eps (float32 epsilon in md), int8 row all 0.
    Computed in blocks of rows (each row is independent) through one small buffer; a NaN or Inf in W
    shows in its row's amax, so W is checked through ws.

    W may also be an FP8 block weight not yet dequantized (:class:`pipeline.io.fp8.BlockRows`, md its
    ``dtype``), bit-identical to quantizing ``W.materialize()`` but never holding W in md (the weight
    phase of an FP8 checkpoint), each block row dequantized into a buffer and quantized from there.
    For a bf16 model, with ``native`` (the default), both forms go through the compiled kernels of
    :mod:`pipeline.quant.numerics.native` (one pass per row, same bits) when they are available."""
    if isinstance(w, BlockRows):
        return _quantize_block_rows(w, name, native)
    check_float(w, name, ndim=2, finite=False)
    n, k = w.shape
    if native and w.dtype == torch.bfloat16:
        q, ws32 = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=torch.float32)
        if native_kernels.bf16_to_int8(w, q, ws32):
            return _checked(w, q, ws32.to(torch.bfloat16).view(n, 1), name)
    rows = max(1, _BLOCK_ELEMENTS // k)
    q, ws = torch.empty(n, k, dtype=torch.int8), torch.empty(n, 1, dtype=w.dtype)
    buf = torch.empty(min(rows, n), k, dtype=w.dtype)
    eps = _eps(w.dtype)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        _quantize_rows(w[r0:r1], q[r0:r1], ws[r0:r1], buf[: r1 - r0], eps)
    return _checked(w, q, ws, name)


def _quantize_block_rows(w: BlockRows, name: str, use_native: bool) -> tuple[Tensor, Tensor, Tensor]:
    if w.dtype not in MODEL_DTYPES:
        raise QuantError(f"{name}: dtype {w.dtype} is not one of {list(MODEL_DTYPES)}")
    if 0 in w.shape:
        raise QuantError(f"{name}: empty tensor of shape {list(w.shape)}")
    (n, k), b0 = w.shape, w.block[0]
    q = torch.empty(n, k, dtype=torch.int8)
    if use_native and w.dtype == torch.bfloat16:
        ws32 = torch.empty(n, dtype=torch.float32)
        codes = w.w_fp8.contiguous().view(torch.uint8)
        if native_kernels.fp8_to_int8_bf16(codes, w.scale_inv.to(torch.float32).contiguous(), w.block, q, ws32):
            return _checked(w, q, ws32.to(torch.bfloat16).view(n, 1), name)
    ws = torch.empty(n, 1, dtype=w.dtype)
    x, buf = torch.empty(min(b0, n), k, dtype=w.dtype), torch.empty(min(b0, n), k, dtype=w.dtype)
    eps = _eps(w.dtype)
    for i in range(w.count):
        r0, r1 = w.bounds(i)
        w.dequantize(i, x[: r1 - r0])
        _quantize_rows(x[: r1 - r0], q[r0:r1], ws[r0:r1], buf[: r1 - r0], eps)
    return _checked(w, q, ws, name)


def _quantize_rows(w: Tensor, q: Tensor, ws: Tensor, buf: Tensor, eps: Tensor) -> None:
    """Rows of W (md) into their int8 rows ``q`` and scales ``ws``, through ``buf`` (w's shape, md);
    ``eps``: :func:`_eps` of md."""
    torch.amax(torch.abs(w, out=buf), dim=1, keepdim=True, out=ws)
    torch.maximum(ws.div_(127), eps, out=ws)
    torch.div(w, ws, out=buf).round_().clamp_(QMIN, QMAX)
    q.copy_(buf)


def _checked(w: Union[Tensor, BlockRows], q: Tensor, ws: Tensor, name: str) -> tuple[Tensor, Tensor, Tensor]:
    if not all_finite(ws):
        _raise_nonfinite(w.materialize() if isinstance(w, BlockRows) else w, name)
    return q, ws, torch.zeros_like(ws)


def dequantize_weight(q: Tensor, weight_scale: Tensor) -> Tensor:
    """W8 [n, k] int8, ws [n, 1] -> float32 W8 * ws."""
    return q.float() * weight_scale.float()


# ----- static activations (W8A8) ------------------------------------------------------------------
def _scalar(v: Number, md: torch.dtype, name: str) -> Tensor:
    t = v.detach().reshape(-1) if isinstance(v, Tensor) else torch.tensor([float(v)])
    if t.numel() != 1:
        raise QuantError(f"{name}: expected a scalar, got shape {list(v.shape)}")  # type: ignore[union-attr]
    if not math.isfinite(float(t[0])):
        raise QuantError(f"{name}: not finite ({float(t[0])})")
    return t.to(md)


def static_activation_params(x_min: Number, x_max: Number, md: torch.dtype,
                             name: str = "activation") -> tuple[Tensor, Tensor]:
    """Observed min/max (values of md) -> (input_scale md [1], input_offset md [1], integer-valued).

    lo = min(x_min, 0), hi = max(x_max, 0); s = max(hi/255 - lo/255, eps); o = round(-lo/s) - 128, each
    op in md (exactly msModelSlim's order). o is clamped to [-128, 127]: md rounding of -lo/s can reach
    256 when hi = 0, and runtimes load input_offset into an int8."""
    if md not in MODEL_DTYPES:
        raise QuantError(f"{name}: model dtype {md} is not one of {list(MODEL_DTYPES)}")
    lo, hi = _scalar(x_min, md, f"{name} x_min"), _scalar(x_max, md, f"{name} x_max")
    if float(lo) > float(hi):
        raise QuantError(f"{name}: x_min {float(lo)} > x_max {float(hi)} (no values observed?)")
    lo, hi = torch.clamp(lo, max=0), torch.clamp(hi, min=0)
    scale = torch.maximum(hi / 255 - lo / 255, _eps(md))
    offset = torch.clamp(torch.round(-lo / scale) - 128, QMIN, QMAX)
    return scale, offset


def quantize_static(x: Tensor, input_scale: Tensor, input_offset: Tensor, name: str = "x") -> Tensor:
    """x [..., k] -> int8 clamp(round(x / s + o), -128, 127), in float32."""
    check_float(x, name)
    q = torch.round(x.float() / input_scale.float() + input_offset.float())
    return torch.clamp(q, QMIN, QMAX).to(torch.int8)


def dequantize_static(x_q: Tensor, input_scale: Tensor, input_offset: Tensor) -> Tensor:
    """int8 -> float32 (x_q - o) * s."""
    return (x_q.float() - input_offset.float()) * input_scale.float()


# ----- export --------------------------------------------------------------------------------------
def deq_scale_and_quant_bias(input_scale: Tensor, input_offset: Tensor, weight_int8: Tensor,
                             weight_scale: Tensor, bias: Optional[Tensor] = None,
                             name: str = "linear") -> tuple[Tensor, Tensor]:
    """-> (deq_scale [n], quant_bias int32 [n]).

    deq_scale = float32(s * ws[:, 0]) with the product in md; stored as float32 when md is bf16, else
    (fp16, fp32: msModelSlim's rule) as int64 holding the float32 bit pattern.
    quant_bias = round(bias / deq_scale - o * sum_j W8[:, j]): the correction o * sum_j W8 is an exact
    integer (int64; msModelSlim's float32 equals it while |o * sum| < 2^24, as on every fixture layer),
    the bias term bias / (s * ws) computed in md as msModelSlim does (then float32)."""
    check_float(input_scale, f"{name}.input_scale")
    check_float(input_offset, f"{name}.input_offset")
    _check_int8(weight_int8, f"{name}.weight", 2)
    n = weight_int8.shape[0]
    check_float(weight_scale, f"{name}.weight_scale", ndim=2)
    md = input_scale.dtype
    if input_scale.numel() != 1 or input_offset.numel() != 1:
        raise QuantError(f"{name}: input_scale/input_offset must hold one value, got shapes "
                         f"{list(input_scale.shape)} and {list(input_offset.shape)}")
    if float(input_scale.reshape(-1)[0]) <= 0:
        raise QuantError(f"{name}.input_scale: must be > 0, got {float(input_scale.reshape(-1)[0])}")
    off = float(input_offset.reshape(-1)[0])
    if off != round(off) or not QMIN <= off <= QMAX:
        raise QuantError(f"{name}.input_offset: must be an integer in [-128, 127], got {off}")
    if tuple(weight_scale.shape) != (n, 1) or weight_scale.dtype != md:
        raise QuantError(f"{name}.weight_scale: expected {md} [{n}, 1], got {weight_scale.dtype} "
                         f"{list(weight_scale.shape)}")
    deq = (input_scale.reshape(1) * weight_scale[:, 0]).float()
    correction = int(off) * _row_sums(weight_int8)
    if bias is None:
        qb = -correction
    else:
        check_float(bias, f"{name}.bias", ndim=1)
        if bias.shape[0] != n:
            raise QuantError(f"{name}.bias: expected shape [{n}], got {list(bias.shape)}")
        # msModelSlim's order: the division in md (bias / (s * ws)), then float32, less the correction
        ratio = (bias.to(md) / (input_scale.reshape(1) * weight_scale[:, 0])).float()
        qb = torch.round(ratio.double() - correction.double()).to(torch.int64)
    lim = torch.iinfo(torch.int32)
    if int(qb.min()) < lim.min or int(qb.max()) > lim.max:
        raise QuantError(f"{name}.quant_bias: values outside int32 ({int(qb.min())}..{int(qb.max())})")
    return (deq if md == torch.bfloat16 else deq_scale_to_int64(deq)), qb.to(torch.int32)


def _row_sums(q: Tensor) -> Tensor:
    """Exact int64 row sums of an int8 [n, k]: the native kernel, else torch a block of rows at a time (an
    int64 copy of a whole weight would be eight times its size)."""
    fast = native_kernels.int8_row_sums(q)
    if fast is not None:
        return fast
    rows = max(1, _BLOCK_ELEMENTS // q.shape[1])
    return torch.cat([q[r:r + rows].sum(dim=1, dtype=torch.int64) for r in range(0, q.shape[0], rows)])


def deq_scale_to_int64(deq: Tensor) -> Tensor:
    """float32 [n] -> int64 [n] holding each value's float32 bit pattern (as msModelSlim for fp16)."""
    return deq.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def deq_scale_to_float32(deq: Tensor) -> Tensor:
    """The float32 deq_scale of either stored form (float32, or int64 holding the bit pattern)."""
    if deq.dtype == torch.float32:
        return deq
    if deq.dtype != torch.int64:
        raise QuantError(f"deq_scale: expected float32 or int64, got {deq.dtype}")
    if int(deq.min()) < 0 or int(deq.max()) >= 2 ** 31:
        raise QuantError("deq_scale: int64 values are not positive float32 bit patterns")
    return deq.to(torch.int32).view(torch.float32)


# ----- dynamic activations (W8A8_DYNAMIC) ----------------------------------------------------------
def dynamic_quant_per_token(x: Tensor, name: str = "x") -> tuple[Tensor, Tensor]:
    """x [..., k] -> (x_q int8 [..., k], s_tok float32 [..., 1]) with s_tok = max(max_j |x_j| / 127, eps),
    x_q = round(x / s_tok), in float32."""
    check_float(x, name)
    xf = x.float()
    s = torch.clamp(xf.abs().amax(dim=-1, keepdim=True) / 127, min=F32_EPS)
    return torch.clamp(torch.round(xf / s), QMIN, QMAX).to(torch.int8), s


# ----- reference integer matmul and the runtime linears --------------------------------------------
def int_matmul(x_q: Tensor, w: Tensor) -> Tensor:
    """x_q [..., k] int8, w [n, k] int8 -> exact x_q @ w.T as int64 [..., n].

    Computed in float32 while k * 128 * 128 < 2^24 (k < 1024: every partial sum is an integer float32
    holds exactly, in any summation order), else in float64, exact while k * 128 * 128 < 2^53."""
    _check_int8(w, "w", 2)
    if x_q.dtype != torch.int8 or x_q.shape[-1] != w.shape[1]:
        raise QuantError(f"x_q: expected int8 [..., {w.shape[1]}], got {x_q.dtype} {list(x_q.shape)}")
    if w.shape[1] * 128 * 128 >= 2 ** 53:
        raise QuantError(f"int_matmul: k = {w.shape[1]} too large for exact float64 accumulation")
    exact = torch.float32 if w.shape[1] * 128 * 128 < 2 ** 24 else torch.float64
    return (x_q.to(exact) @ w.to(exact).T).to(torch.int64)


def w8a8_static_linear(x: Tensor, weight: Tensor, input_scale: Tensor, input_offset: Tensor,
                       deq_scale: Tensor, quant_bias: Tensor) -> Tensor:
    """What the runtime computes: deq_scale * (x_q @ W8.T + quant_bias), float32 [..., n]."""
    acc = int_matmul(quantize_static(x, input_scale, input_offset), weight) + quant_bias.to(torch.int64)
    return acc.double().mul(deq_scale_to_float32(deq_scale).double()).float()


def w8a8_dynamic_linear(x: Tensor, weight: Tensor, weight_scale: Tensor) -> Tensor:
    """(x_q @ W8.T) * s_tok * weight_scale.T with per-token x_q, s_tok; float32 [..., n]."""
    x_q, s = dynamic_quant_per_token(x)
    return (int_matmul(x_q, weight).double() * s.double() * weight_scale.double().reshape(1, -1)).float()


# ----- FA3 -----------------------------------------------------------------------------------------
def fa_scale(lo: Tensor, hi: Tensor, md: torch.dtype, name: str = "fa") -> Tensor:
    """Window ends lo, hi [R] -> scale md [R, 1] (fa_q: R = heads; fa_k, fa_v: R = 1):
    max(max(-min(lo, 0), max(hi, 0)) / 127, eps) in float32, rounded to md."""
    for t, what in ((lo, "lo"), (hi, "hi")):
        check_float(t, f"{name} {what}", ndim=1, dtypes=(torch.float32, torch.float64) + MODEL_DTYPES)
    if lo.shape != hi.shape:
        raise QuantError(f"{name}: lo {list(lo.shape)} and hi {list(hi.shape)} differ in shape")
    if bool((lo > hi).any()):
        raise QuantError(f"{name}: lo > hi in some row")
    amax = torch.maximum(-torch.clamp(lo.float(), max=0), torch.clamp(hi.float(), min=0))
    return torch.clamp(amax / 127, min=F32_EPS).to(md).unsqueeze(-1)


def fa_offset(scale: Tensor) -> Tensor:
    """The FA3 offset: int8 zeros shaped like the scale."""
    return torch.zeros(scale.shape, dtype=torch.int8)
