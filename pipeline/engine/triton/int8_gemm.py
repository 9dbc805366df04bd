"""Scaled int8 GEMMs with the activation quantization and the epilogue fused, in Triton.

The arithmetic is ``pipeline.engine.layers.qlinear``'s, for an int8 weight ``W8`` [N, K] and an input ``x`` [M, K]:

- static (W8A8): ``x_q = clamp(round(x / input_scale + input_offset), -128, 127)`` in float32 (round half
  to even, the division rounded to nearest), quantized tile by tile inside the GEMM's K loop;
  ``y = float32(acc + quant_bias) * deq_scale``;
- dynamic (W8A8_DYNAMIC): a first pass over the program's rows gives ``s_tok = max(max_j |x_j| / 127,
  eps)``, the K loop quantizes ``x_q = clamp(round(x / s_tok), -128, 127)``; ``y = float32(acc) * s_tok *
  weight_scale`` (left to right);
- pre-quantized (``Int8Linear.apply_quantized``): ``x_q``, ``s_tok`` given, the dynamic epilogue.

What is exact: ``x_q`` and ``s_tok`` are qlinear's bit for bit (the same float32 operations, each rounded
to nearest); ``acc = x_q @ W8.T`` is the exact int32 (``tl.dot`` of int8 into int32; |acc| <= 2^14 * K <
2^31 for K <= 131071); ``acc + quant_bias`` is int32. The float32 output is the FAST epilogue's
(``qlinear.FAST``) bit for bit -- the same one conversion and one or two IEEE multiplies -- hence within
``qlinear.FAST_EPILOGUE_ULPS`` (4) ulps of the EXACT (float64) epilogue. Outputs are float32; the caller
casts to the model dtype (and, for a dynamic linear with a bias, adds it first, as qlinear does).

The dynamic fused path reads each row tile of x twice (max pass, then the K loop) in every N-tile
program; at decode sizes x is a few KiB and stays in L2, the weight dominates the traffic.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pipeline.engine.int8_arith import INT_MM_MAX_K
from pipeline.engine.triton._common import INTERPRET, check_device, per_token_scale, quantize_rows_dynamic, rint_f32

MAX_K = INT_MM_MAX_K                           # 131071: the int32 accumulator cannot overflow
_IN_INT8, _IN_STATIC, _IN_DYNAMIC = 0, 1, 2   # how x arrives
_EPI_ACC, _EPI_STATIC, _EPI_DYNAMIC = 0, 1, 2  # what is written


@triton.jit
def _int8_gemm_kernel(x_ptr, w_ptr, out_ptr, in_scale_ptr, in_offset_ptr, stok_ptr, qb_ptr, deq_ptr, ws_ptr,
                      M, N, K, sx_m, sw_n, so_m,
                      IN: tl.constexpr, EPI: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * sx_m
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * sw_n

    if IN == 1:
        in_scale = tl.load(in_scale_ptr)
        in_offset = tl.load(in_offset_ptr)
    if IN == 2:                                    # per-row scale: a max pass over the row tile
        amax = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            xt = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & (kk < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xt.to(tl.float32)), 1))
        s_tok = per_token_scale(amax)
    if IN == 0 and EPI == 2:
        s_tok = tl.load(stok_ptr + offs_m, mask=mmask, other=1.0)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        xmask = mmask[:, None] & kmask[None, :]
        if IN == 0:
            xq = tl.load(x_rows + kk[None, :], mask=xmask, other=0)
        else:
            xt = tl.load(x_rows + kk[None, :], mask=xmask, other=0.0).to(tl.float32)
            if IN == 1:
                v = tl.math.div_rn(xt, in_scale) + in_offset
                v = tl.minimum(tl.maximum(v, -129.0), 128.0)
                xq = tl.minimum(tl.maximum(rint_f32(v), -128.0), 127.0).to(tl.int8)
            else:
                xq = quantize_rows_dynamic(xt, s_tok)
            xq = tl.where(xmask, xq, 0).to(tl.int8)          # padded k (and rows) contribute nothing
        wt = tl.load(w_cols + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0)
        acc = tl.dot(xq, wt, acc, out_dtype=tl.int32)

    out = out_ptr + offs_m.to(tl.int64)[:, None] * so_m + offs_n[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if EPI == 0:
        tl.store(out, acc, mask=omask)
    elif EPI == 1:
        qb = tl.load(qb_ptr + offs_n, mask=nmask, other=0)
        deq = tl.load(deq_ptr + offs_n, mask=nmask, other=0.0)
        tl.store(out, (acc + qb[None, :]).to(tl.float32) * deq[None, :], mask=omask)
    else:
        ws = tl.load(ws_ptr + offs_n, mask=nmask, other=0.0)
        tl.store(out, acc.to(tl.float32) * s_tok[:, None] * ws[None, :], mask=omask)


def _blocks(M: int, N: int, K: int) -> tuple[int, int, int, dict]:
    """Tile sizes (and launch options) by shape: decode-sized M gets 16-row tiles."""
    if INTERPRET:
        return 16, 32, 32, {}
    bm = 16 if M <= 16 else (32 if M <= 32 else (64 if M <= 128 else 128))
    bn = 64 if M <= 32 else 128
    bk = 128 if K >= 128 else 64
    return bm, bn, bk, {"num_warps": 4 if bm * bn <= 64 * 64 else 8, "num_stages": 3}


def _check_weight(fn: str, w: torch.Tensor, K: int) -> None:
    if w.dtype != torch.int8 or w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"{fn}: w must be int8 [N, {K}], got {w.dtype} {tuple(w.shape)}")
    if w.stride(1) != 1:
        raise ValueError(f"{fn}: w must be contiguous in K, got strides {w.stride()}")
    if K > MAX_K:
        raise ValueError(f"{fn}: K = {K} could overflow the int32 accumulator (K <= {MAX_K})")


def _per_channel(fn: str, name: str, t: torch.Tensor, N: int, dtype=torch.float32) -> torch.Tensor:
    if t.numel() != N or (t.dtype != dtype and not (dtype == torch.float32 and t.is_floating_point())):
        raise ValueError(f"{fn}: {name} must be {dtype} with {N} values, got {t.dtype} {tuple(t.shape)}")
    return t.reshape(N).to(dtype).contiguous()


def _flat(fn: str, x: torch.Tensor, want_float: bool) -> torch.Tensor:
    ok = x.is_floating_point() if want_float else x.dtype == torch.int8
    if not ok or x.dim() < 1:
        raise ValueError(f"{fn}: x must be {'a float' if want_float else 'an int8'} tensor [..., K], got "
                         f"{x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, w, out, IN, EPI, in_scale=None, in_offset=None, stok=None, qb=None, deq=None, ws=None):
    M, K = x2.shape
    N = w.shape[0]
    if M == 0:
        return out
    bm, bn, bk, opts = _blocks(M, N, K)
    dummy = out
    _int8_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x2, w, out, dummy if in_scale is None else in_scale, dummy if in_offset is None else in_offset,
        dummy if stok is None else stok, dummy if qb is None else qb, dummy if deq is None else deq,
        dummy if ws is None else ws, M, N, K, x2.stride(0), w.stride(0), out.stride(0),
        IN=IN, EPI=EPI, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **opts)
    return out


def int8_matmul_acc(x_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact int32 accumulator ``x_q @ w.T``: x_q int8 [..., K], w int8 [N, K] -> int32 [..., N]."""
    fn = "int8_matmul_acc"
    check_device(fn, x_q=x_q, w=w)
    x2 = _flat(fn, x_q, want_float=False)
    _check_weight(fn, w, x2.shape[1])
    out = torch.empty(x2.shape[0], w.shape[0], dtype=torch.int32, device=x2.device)
    return _launch(x2, w, out, _IN_INT8, _EPI_ACC).reshape(*x_q.shape[:-1], w.shape[0])


def int8_gemm_static(x: torch.Tensor, w: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor,
                     quant_bias: torch.Tensor, deq_scale: torch.Tensor, return_acc: bool = False) -> torch.Tensor:
    """W8A8: float32 [..., N] ``float32(x_q @ w.T + quant_bias) * deq_scale`` with x quantized inside
    (module docstring). ``deq_scale`` float32 [N] (decode the int64 form with ``qlinear.decode_deq_scale``
    first); ``quant_bias`` int32 [N]; ``input_scale``/``input_offset`` one value each (tensors: no host
    sync). ``return_acc``: the int32 accumulator ``x_q @ w.T`` [..., N] instead (the same fused quantization)."""
    fn = "int8_gemm_static"
    check_device(fn, x=x, w=w, input_scale=input_scale, input_offset=input_offset, quant_bias=quant_bias,
                 deq_scale=deq_scale)
    x2 = _flat(fn, x, want_float=True)
    _check_weight(fn, w, x2.shape[1])
    N = w.shape[0]
    for name, t in (("input_scale", input_scale), ("input_offset", input_offset)):
        if t.numel() != 1:
            raise ValueError(f"{fn}: {name} must hold one value, got shape {tuple(t.shape)}")
    if deq_scale.dtype != torch.float32:
        raise ValueError(f"{fn}: deq_scale must be float32 [N] (decode int64 bit patterns with "
                         f"qlinear.decode_deq_scale), got {deq_scale.dtype}")
    qb = _per_channel(fn, "quant_bias", quant_bias, N, torch.int32)
    deq = _per_channel(fn, "deq_scale", deq_scale, N)
    s = input_scale.reshape(1).float()
    o = input_offset.reshape(1).float()
    out = torch.empty(x2.shape[0], N, dtype=torch.int32 if return_acc else torch.float32, device=x2.device)
    _launch(x2, w, out, _IN_STATIC, _EPI_ACC if return_acc else _EPI_STATIC, in_scale=s, in_offset=o, qb=qb, deq=deq)
    return out.reshape(*x.shape[:-1], N)


def int8_gemm_dynamic(x: torch.Tensor, w: torch.Tensor, weight_scale: torch.Tensor,
                      return_acc: bool = False) -> torch.Tensor:
    """W8A8_DYNAMIC: float32 [..., N] ``float32(x_q @ w.T) * s_tok * weight_scale`` with the per-token
    quantization of x fused (module docstring); no bias. ``return_acc``: the int32 accumulator instead."""
    fn = "int8_gemm_dynamic"
    check_device(fn, x=x, w=w, weight_scale=weight_scale)
    x2 = _flat(fn, x, want_float=True)
    _check_weight(fn, w, x2.shape[1])
    N = w.shape[0]
    ws = _per_channel(fn, "weight_scale", weight_scale, N)
    out = torch.empty(x2.shape[0], N, dtype=torch.int32 if return_acc else torch.float32, device=x2.device)
    _launch(x2, w, out, _IN_DYNAMIC, _EPI_ACC if return_acc else _EPI_DYNAMIC, ws=ws)
    return out.reshape(*x.shape[:-1], N)


def int8_gemm_quantized(x_q: torch.Tensor, s_tok: torch.Tensor, w: torch.Tensor,
                        weight_scale: torch.Tensor) -> torch.Tensor:
    """``Int8Linear.apply_quantized``'s FAST epilogue: x_q int8 [M, K] and s_tok float32 [M, 1] already
    quantized -> float32 [M, N] ``float32(x_q @ w.T) * s_tok * weight_scale``."""
    fn = "int8_gemm_quantized"
    check_device(fn, x_q=x_q, s_tok=s_tok, w=w, weight_scale=weight_scale)
    x2 = _flat(fn, x_q, want_float=False)
    _check_weight(fn, w, x2.shape[1])
    M, N = x2.shape[0], w.shape[0]
    st = _per_channel(fn, "s_tok", s_tok, M)
    ws = _per_channel(fn, "weight_scale", weight_scale, N)
    out = torch.empty(M, N, dtype=torch.float32, device=x2.device)
    return _launch(x2, w, out, _IN_INT8, _EPI_DYNAMIC, stok=st, ws=ws)


def int8_linear(module, x: torch.Tensor, deq_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 output [..., N] of a ``qlinear.W8A8StaticLinear`` or ``W8A8DynamicLinear`` on ``x``
    through these kernels: the module's FAST epilogue bit for bit (a dynamic linear's bias added in float32,
    as the module adds it); the caller casts to x.dtype. ``deq_scale``: the module's decoded float32
    deq_scale, if the caller caches it (else decoded here from its stored form)."""
    from pipeline.engine.int8_arith import _bits_to_float32
    from pipeline.format.description import W8A8, W8A8_DYNAMIC

    kind = getattr(module, "kind", None)
    if kind == W8A8:
        deq = _bits_to_float32(module.deq_scale) if deq_scale is None else deq_scale
        return int8_gemm_static(x, module.weight, module.input_scale, module.input_offset, module.quant_bias, deq)
    if kind == W8A8_DYNAMIC:
        y = int8_gemm_dynamic(x, module.weight, module.weight_scale)
        return y if module.bias is None else y + module.bias.float()
    raise TypeError(f"int8_linear: expected a W8A8StaticLinear or W8A8DynamicLinear, got {type(module).__name__}")
