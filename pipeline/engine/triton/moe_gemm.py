"""The routed experts of an int8 MoE as two grouped int8 GEMMs over tokens sorted by expert, in Triton.

``fused_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)`` computes what
``pipeline.engine.layers.moe.Int8MoE`` computes for its routed experts (W8A8_DYNAMIC, FAST epilogue), with the
model dtype ``dtype`` (default x.dtype) for the roundings the torch path makes:

    x_q, s_tok = quantize_per_token(x)                                     (torch: one pass over N rows)
    for each slot (token n, choice k) with expert e = topk_ids[n, k]:
        g, u = round(float32(x_q[n] @ w13[e].T) * s_tok[n] * w13_scale[e])      split at I: gate | up
        h    = round(round(silu(g)) * u)                                         (SiLU in float32)
        h_q, s_h = per-token quantization of h                                   (fused in kernel 2)
        y    = round(float32(h_q @ w2[e].T) * s_h * w2_scale[e]) * topk_weights[n, k]
    out[n] = sum over n's slots, in expert order (index_add)            -> float32 [N, H]

``round`` is to ``dtype`` (round to nearest even; float32: nothing). Slots are sorted by expert (stable),
each expert's run padded to a multiple of BLOCK_M rows; tile t of BLOCK_M rows belongs to one expert.
Kernel 1 (grid ``(tiles, ceil(I / BLOCK_N))``) gathers the tile's int8 rows of x_q and runs the gate and the
up GEMM in the same K loop (each x tile loaded once, used for both), SiLU-mul fused in the epilogue.
Kernel 2 (grid ``(tiles, ceil(H / BLOCK_N))``) quantizes h per row (a max pass, then the K loop) and runs
the down GEMM, the routing weight fused in the epilogue. Padding rows are never stored from kernel 1 and
add zero into a spare row in the combine.

What is exact: x_q, s_tok and every int32 accumulator (gate, up, down) equal the torch path's; h_q and s_h
are qlinear's per-token quantization of the kernel's h bit for bit. SiLU's exp is the device's: h can
differ from torch's by one ulp of ``dtype`` now and then, which moves h_q by at most 1 in that row; the
tests bound the output's error against Int8MoE. The combine's order is the torch path's; on CUDA
``index_add_`` uses atomics (the order of the few adds per token is not fixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from pipeline.engine.triton._common import (INTERPRET, check_device, per_token_scale, quantize_rows_dynamic,
                                             round_kind, round_to)
from pipeline.engine.triton.int8_gemm import MAX_K


@triton.jit
def _gate_up_kernel(xq_ptr, stok_ptr, slot_ptr, tile_e_ptr, w_ptr, ws_ptr, out_ptr,
                    K, I, num_slots, sw_e, sw_n, sws_e, so_m,
                    TOP_K: tl.constexpr, ACC_OUT: tl.constexpr, ROUND: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    if e < 0:
        return
    offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slot_ptr + offs_m)
    valid = slot < num_slots
    tok = tl.where(valid, slot // TOP_K, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + e.to(tl.int64) * sw_e + offs_n.to(tl.int64)[None, :] * sw_n
    w_up = w_gate + I * sw_n
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        xq = tl.load(xq_ptr + tok[:, None] * K + kk[None, :], mask=valid[:, None] & kmask[None, :], other=0)
        wmask = kmask[:, None] & nmask[None, :]
        acc_g = tl.dot(xq, tl.load(w_gate + kk[:, None], mask=wmask, other=0), acc_g, out_dtype=tl.int32)
        acc_u = tl.dot(xq, tl.load(w_up + kk[:, None], mask=wmask, other=0), acc_u, out_dtype=tl.int32)
    omask = valid[:, None] & nmask[None, :]
    rows = offs_m.to(tl.int64)[:, None] * so_m
    if ACC_OUT:
        tl.store(out_ptr + rows + offs_n[None, :], acc_g, mask=omask)
        tl.store(out_ptr + rows + I + offs_n[None, :], acc_u, mask=omask)
    else:
        s = tl.load(stok_ptr + tok, mask=valid, other=0.0)
        ws_g = tl.load(ws_ptr + e * sws_e + offs_n, mask=nmask, other=0.0)
        ws_u = tl.load(ws_ptr + e * sws_e + I + offs_n, mask=nmask, other=0.0)
        g = round_to(acc_g.to(tl.float32) * s[:, None] * ws_g[None, :], ROUND)
        u = round_to(acc_u.to(tl.float32) * s[:, None] * ws_u[None, :], ROUND)
        act = round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), ROUND)
        tl.store(out_ptr + rows + offs_n[None, :], round_to(act * u, ROUND), mask=omask)


@triton.jit
def _down_kernel(h_ptr, slot_ptr, tile_e_ptr, topw_ptr, w_ptr, ws_ptr, out_ptr,
                 K, N, num_slots, sw_e, sw_n, sws_e, sh_m, so_m,
                 ACC_OUT: tl.constexpr, ROUND: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t)
    if e < 0:
        return
    offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slot_ptr + offs_m)
    valid = slot < num_slots
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + offs_m.to(tl.int64)[:, None] * sh_m
    amax = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        ht = tl.load(h_rows + kk[None, :], mask=valid[:, None] & (kk < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(ht), 1))
    s_h = per_token_scale(amax)
    w_cols = w_ptr + e.to(tl.int64) * sw_e + offs_n.to(tl.int64)[None, :] * sw_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        hmask = valid[:, None] & kmask[None, :]
        ht = tl.load(h_rows + kk[None, :], mask=hmask, other=0.0)
        hq = tl.where(hmask, quantize_rows_dynamic(ht, s_h), 0).to(tl.int8)
        acc = tl.dot(hq, tl.load(w_cols + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0), acc,
                     out_dtype=tl.int32)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * so_m + offs_n[None, :]
    omask = nmask[None, :] & (offs_m >= 0)[:, None]          # padding rows written too (as zeros)
    if ACC_OUT:
        tl.store(out, tl.where(valid[:, None], acc, 0), mask=omask)
    else:
        ws = tl.load(ws_ptr + e * sws_e + offs_n, mask=nmask, other=0.0)
        wr = tl.load(topw_ptr + slot, mask=valid, other=0.0)
        y = round_to(acc.to(tl.float32) * s_h[:, None] * ws[None, :], ROUND) * wr[:, None]
        tl.store(out, tl.where(valid[:, None], y, 0.0), mask=omask)


# ----- routing --------------------------------------------------------------------------------------------
@dataclass
class Routing:
    """Slots sorted by expert, in tiles of ``block_m`` rows of one expert each.

    ``slots`` int32 [tiles * block_m]: the slot (n * top_k + k) of each row, ``num_slots`` on padding rows;
    ``tile_expert`` int32 [tiles]: the expert of each tile, -1 for tiles past the last (there are
    ``ceil(num_slots / block_m) + min(E, num_slots)`` tiles, a bound that needs no host sync);
    ``load`` int64 [E]: slots per expert (``Int8MoE.last_load``)."""

    slots: torch.Tensor
    tile_expert: torch.Tensor
    load: torch.Tensor
    num_slots: int
    top_k: int
    block_m: int


def route(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """The :class:`Routing` of router choices ``topk_ids`` [N, top_k] (the order of ``combine_experts``:
    experts ascending, each expert's slots in slot order)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"route: topk_ids must be int32/int64 [N, top_k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    dev = topk_ids.device
    flat = topk_ids.flatten().long()
    ns = flat.numel()
    load = torch.bincount(flat, minlength=num_experts)
    if load.numel() != num_experts:
        raise ValueError(f"route: topk_ids has expert ids >= num_experts={num_experts}")
    padded = (load + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = flat.argsort(stable=True)
    e_sorted = flat[order]
    first = torch.cumsum(load, 0) - load                        # each expert's first sorted index
    pos = (ends - padded)[e_sorted] + torch.arange(ns, device=dev) - first[e_sorted]
    tiles = triton.cdiv(ns, block_m) + min(num_experts, ns)
    slots = torch.full((tiles * block_m,), ns, dtype=torch.int32, device=dev)
    slots[pos] = order.to(torch.int32)
    starts = torch.arange(tiles, device=dev) * block_m
    te = torch.searchsorted(ends, starts, right=True)
    tile_expert = torch.where(starts < ends[-1], te, -1).to(torch.int32)
    return Routing(slots, tile_expert, load, ns, topk_ids.shape[1], block_m)


# ----- the wrapper -----------------------------------------------------------------------------------------
def _blocks(rows: int) -> tuple[int, int, int, dict]:
    if INTERPRET:
        return 16, 16, 32, {}
    bm = 16 if rows <= 1024 else 64
    return bm, 64 if bm == 16 else 128, 128, {"num_warps": 4 if bm == 16 else 8, "num_stages": 3}


def _check(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale) -> tuple[int, int, int, int]:
    fn = "fused_moe"
    check_device(fn, x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w13_scale=w13_scale,
                 w2=w2, w2_scale=w2_scale)
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{fn}: x must be a float [N, H], got {x.dtype} {tuple(x.shape)}")
    N, H = x.shape
    if w13.dtype != torch.int8 or w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2:
        raise ValueError(f"{fn}: w13 must be int8 [E, 2I, {H}] (gate rows then up rows), got {w13.dtype} "
                         f"{tuple(w13.shape)}")
    E, I = w13.shape[0], w13.shape[1] // 2
    if w2.dtype != torch.int8 or tuple(w2.shape) != (E, H, I):
        raise ValueError(f"{fn}: w2 must be int8 [{E}, {H}, {I}], got {w2.dtype} {tuple(w2.shape)}")
    for name, t, shape in (("w13_scale", w13_scale, (E, 2 * I)), ("w2_scale", w2_scale, (E, H))):
        if t.numel() != shape[0] * shape[1] or not t.is_floating_point():
            raise ValueError(f"{fn}: {name} must be float [{shape[0]}, {shape[1]}], got {t.dtype} {tuple(t.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != N or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{fn}: topk_ids and topk_weights must both be [{N}, top_k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if max(H, I) > MAX_K:
        raise ValueError(f"{fn}: inner dims {H}, {I} could overflow the int32 accumulator (<= {MAX_K})")
    return N, H, E, I


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
              w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
              dtype: Optional[torch.dtype] = None, x_q: Optional[torch.Tensor] = None,
              s_tok: Optional[torch.Tensor] = None, return_parts: bool = False):
    """The routed-expert sum (module docstring): float32 [N, H]; plus the Routing (for ``last_load``).

    ``x`` [N, H] float; ``topk_ids``/``topk_weights`` [N, top_k] (the router's); ``w13`` int8 [E, 2I, H] (each
    expert's gate rows then its up rows) with ``w13_scale`` float32 [E, 2I]; ``w2`` int8 [E, H, I] with
    ``w2_scale`` [E, H]. ``x_q``/``s_tok``: x already quantized per token (shared with the shared expert);
    ``dtype``: the model dtype of the intermediate roundings (default x.dtype). ``return_parts``: instead, a
    dict of the int32 accumulators for tests: ``gate_up`` [rows, 2I] (padding rows 0), ``down`` [rows, H]
    (from the kernel's own h), ``h`` [rows, I] float32 and the Routing."""
    N, H, E, I = _check(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    rk = round_kind(dtype or x.dtype, "fused_moe")
    if x_q is None:
        from pipeline.engine.int8_arith import quantize_per_token
        x_q, s_tok = quantize_per_token(x)
    x_q, s_tok = x_q.contiguous(), s_tok.reshape(N).float().contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    ws13 = w13_scale.reshape(E, 2 * I).float().contiguous()
    ws2 = w2_scale.reshape(E, H).float().contiguous()
    bm, bn, bk, opts = _blocks(topk_ids.numel())
    r = route(topk_ids, E, bm)
    rows, tiles = r.slots.numel(), r.tile_expert.numel()
    topw = topk_weights.reshape(-1).float().contiguous()
    h = torch.zeros(rows, I, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(tiles, triton.cdiv(I, bn))](
        x_q, s_tok, r.slots, r.tile_expert, w13, ws13, h, H, I, r.num_slots, w13.stride(0), w13.stride(1),
        ws13.stride(0), h.stride(0), TOP_K=r.top_k, ACC_OUT=False, ROUND=rk,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **opts)
    y = torch.zeros(rows, H, dtype=torch.int32 if return_parts else torch.float32, device=x.device)
    _down_kernel[(tiles, triton.cdiv(H, bn))](
        h, r.slots, r.tile_expert, topw, w2, ws2, y, I, H, r.num_slots, w2.stride(0), w2.stride(1),
        ws2.stride(0), h.stride(0), y.stride(0), ACC_OUT=return_parts, ROUND=rk,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **opts)
    if return_parts:
        gu = torch.zeros(rows, 2 * I, dtype=torch.int32, device=x.device)
        _gate_up_kernel[(tiles, triton.cdiv(I, bn))](
            x_q, s_tok, r.slots, r.tile_expert, w13, ws13, gu, H, I, r.num_slots, w13.stride(0),
            w13.stride(1), ws13.stride(0), gu.stride(0), TOP_K=r.top_k, ACC_OUT=True, ROUND=rk,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **opts)
        return {"gate_up": gu, "down": y, "h": h, "routing": r}
    tok = torch.where(r.slots < r.num_slots, r.slots // r.top_k, N).long()   # padding -> spare row N
    out = torch.zeros(N + 1, H, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y)
    return out[:N], r


@dataclass
class StackedExperts:
    """An ``Int8MoE``'s routed experts as the stacked tensors ``fused_moe`` takes (built once, kept)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @classmethod
    def of(cls, moe) -> "StackedExperts":
        """From a ``pipeline.engine.layers.moe.Int8MoE`` (its experts' gate_up and down_proj linears)."""
        ex = list(moe.experts)
        return cls(torch.stack([e.gate_up.weight for e in ex]).contiguous(),
                   torch.stack([e.gate_up.weight_scale.reshape(-1).float() for e in ex]).contiguous(),
                   torch.stack([e.down_proj.weight for e in ex]).contiguous(),
                   torch.stack([e.down_proj.weight_scale.reshape(-1).float() for e in ex]).contiguous())


def int8_moe_forward(moe, stacked: StackedExperts, x: torch.Tensor) -> torch.Tensor:
    """``Int8MoE.forward`` through the kernels: router, one per-token quantization, ``fused_moe`` for the
    routed experts, the shared expert through torch as Int8MoE does, ``moe.last_load`` set. Output in
    x.dtype, shape of x."""
    from pipeline.engine.int8_arith import quantize_per_token

    shape, dtype = x.shape, x.dtype
    flat = x.reshape(-1, shape[-1])
    weights, idx = moe.gate(flat)
    x_q, s_tok = quantize_per_token(flat)
    out, r = fused_moe(flat, idx, weights, stacked.w13, stacked.w13_scale, stacked.w2, stacked.w2_scale,
                       dtype=dtype, x_q=x_q, s_tok=s_tok)
    moe.last_load = r.load
    out = out.to(dtype)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts.forward_quantized(x_q, s_tok, dtype)
    return out.view(shape)
