"""Paged absorbed-MLA decode over the int8 (or bf16/float) latent cache, in Triton (flash-decoding).

The arithmetic is ``pipeline.engine.attention.paged``'s: per query row (a head h of sequence b) and cached token t,
with ``s_k = fa_k`` on an int8 latent and ``s_k = 1`` otherwise,

    score[h, t] = softmax_scale * (s_k * <q_abs[h], c[t]> + <q_pe[h], k_pe[t]>)
    o_lat[h]    = s_k * sum_t softmax_t(score[h, :]) * c[t]

Kernel 1 (grid ``(B, ceil(H / BLOCK_H), num_splits)``): a program takes BLOCK_H heads of one sequence and
one contiguous range of its tokens (the split), walks it BLOCK_T tokens at a time through the block table
(token p in slot ``p % block_size`` of block ``table[b, p // block_size]``), loads each latent tile ONCE and
uses it twice -- as the key (``q_abs @ c^T``) and as the value (``p @ c``) -- and keeps its own online
softmax in float32, in base 2 (the scales ``softmax_scale * s_k * log2(e)`` and ``softmax_scale *
log2(e)`` folded into the two score products): running max ``m``, sum ``l`` and unnormalised ``acc``.
Kernel 2 (grid ``(B, H)``) combines the splits: ``M = max_s m_s``, ``w_s = 2^(m_s - M)``,
``o_lat = s_k * sum_s w_s acc_s / sum_s w_s l_s`` (an empty split has ``m = -inf``, ``w = 0``).

Layouts are read in place: ND blocks ``[num_blocks, block_size, D]`` and NZ blocks ``[num_blocks, D1, R',
c0]`` (``pipeline.engine.cache.nz``) are both addressed as ``block * s_block + row * s_row + (j // c0) * s_frac
+ j % c0``; ND is the case ``c0 >= D``, ``s_frac = 0``. The int8 latent and the bf16/float latent are the
same kernel code (the element type is a compile-time property of the pointer).

Precision of the two products (``precision``):

- ``"bf16"`` (the default): tensor-core dots on bfloat16 operands with float32 accumulation. The
  int8 latent is exact in bf16; ``q_abs``, ``q_pe`` and the probabilities ``p`` are rounded to bf16
  (relative error <= 2^-9 each), the flash-attention practice. In the interpreter the rounding is
  emulated exactly (``round_bf16``) and the dot done in float32 (same products, the sum order differs).
- ``"tf32"``: float32 operands through TF32 tensor cores (10-bit mantissas).
- ``"ieee"``: float32 FMA dots, the torch reference's precision up to the summation order.

Nothing else is rounded: the softmax statistics, the accumulator and the split combination are float32.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from pipeline.engine.triton._common import INTERPRET, check_device, num_sms, round_bf16
from pipeline.engine.cache.nz import c0_of

LOG2E = 1.4426950408889634
PRECISIONS = ("bf16", "tf32", "ieee")
_DOT_IEEE, _DOT_TF32, _DOT_BF16, _DOT_BF16_EMULATED = 0, 1, 2, 3
#: Splits are never made shorter than this many tokens (each adds a partial acc of C floats per head).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64


@triton.jit
def _dot(a, b, MODE: tl.constexpr):
    """a [M, K] @ b [K, N] -> float32 under the precision MODE; a, b float32 (bf16 operands in MODE 2)."""
    if MODE == 0:
        return tl.dot(a, b, input_precision="ieee")
    elif MODE == 1:
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b)


@triton.jit
def _operand(x, MODE: tl.constexpr):
    """A loaded tile as a dot operand under MODE: bf16 (MODE 2), bf16-rounded float32 (3), float32 (0, 1)."""
    if MODE == 2:
        return x.to(tl.bfloat16)
    elif MODE == 3:
        return round_bf16(x.to(tl.float32))
    else:
        return x.to(tl.float32)


@triton.jit
def _mla_split_kernel(q_ptr, qpe_ptr, c_ptr, pe_ptr, table_ptr, len_ptr, acc_ptr, m_ptr, l_ptr,
                      sq_b, sq_h, sqp_b, sqp_h,
                      sc_blk, sc_row, sc_frac, sp_blk, sp_row, sp_frac, st_b,
                      H, C, R, block_size, num_splits, qk_scale, pe_scale,
                      BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                      BLOCK_R: tl.constexpr, C0_C: tl.constexpr, C0_R: tl.constexpr, MODE: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    hmask = offs_h < H
    cmask = offs_c < C
    rmask = offs_r < R

    q = tl.load(q_ptr + b * sq_b + offs_h[:, None] * sq_h + offs_c[None, :],
                mask=hmask[:, None] & cmask[None, :], other=0.0)
    qp = tl.load(qpe_ptr + b * sqp_b + offs_h[:, None] * sqp_h + offs_r[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0)
    q = _operand(q, MODE)
    qp = _operand(qp, MODE)
    # in-block column offsets of both layouts (ND: C0 >= width, frac stride 0)
    col_c = (offs_c // C0_C) * sc_frac + offs_c % C0_C
    col_r = (offs_r // C0_R) * sp_frac + offs_r % C0_R

    L = tl.load(len_ptr + b)
    per_split = tl.cdiv(tl.cdiv(L, BLOCK_T), num_splits) * BLOCK_T
    t0 = s * per_split
    t1 = tl.minimum(t0 + per_split, L)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for p in range(t0, t1, BLOCK_T):
        offs_t = p + tl.arange(0, BLOCK_T)
        tmask = offs_t < t1
        blk = tl.load(table_ptr + b * st_b + offs_t // block_size, mask=tmask, other=0).to(tl.int64)
        row = offs_t % block_size
        c = tl.load(c_ptr + (blk * sc_blk + row * sc_row)[:, None] + col_c[None, :],
                    mask=tmask[:, None] & cmask[None, :], other=0)
        pe = tl.load(pe_ptr + (blk * sp_blk + row * sp_row)[:, None] + col_r[None, :],
                     mask=tmask[:, None] & rmask[None, :], other=0.0)
        c = _operand(c, MODE)                       # the one latent tile: key here ...
        pe = _operand(pe, MODE)
        sc = _dot(q, tl.trans(c), MODE) * qk_scale + _dot(qp, tl.trans(pe), MODE) * pe_scale
        sc = tl.where(tmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))      # finite: every step has a valid token
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + _dot(_operand(pr, MODE), c, MODE)     # ... and value here
        m_i = m_new

    part = ((b * H + offs_h) * num_splits + s).to(tl.int64)                # [B, H, S] row index
    tl.store(acc_ptr + part[:, None] * C + offs_c[None, :], acc, mask=hmask[:, None] & cmask[None, :])
    tl.store(m_ptr + part, m_i, mask=hmask)
    tl.store(l_ptr + part, l_i, mask=hmask)


@triton.jit
def _mla_combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, so_b, so_h, H, C, num_splits, out_scale,
                        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b * H + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_splits
    m = tl.load(m_ptr + row + offs_s, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + row + offs_s, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    denom = tl.sum(w * l, 0)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        cmask = offs_c < C
        o = tl.zeros([BLOCK_C], tl.float32)
        for s in range(0, num_splits):
            m_s = tl.load(m_ptr + row + s)
            w_s = tl.where(m_s > float("-inf"), tl.exp2(m_s - m_max), 0.0)
            a = tl.load(acc_ptr + (row + s) * C + offs_c, mask=cmask, other=0.0)
            o += w_s * a
        tl.store(out_ptr + b * so_b + h * so_h + offs_c, o * (out_scale / denom), mask=cmask)


# ----- the wrapper ---------------------------------------------------------------------------------------
def _layout(fn: str, name: str, cache: torch.Tensor, width: int, nz: bool,
            block_size: Optional[int]) -> tuple[int, int, int, int, int, int]:
    """(num_blocks, rows per block as stored, s_block, s_row, s_frac, c0) of a cache tensor; ValueError
    naming it when its shape is not an ND [N, bs, width] or NZ [N, ceil(width / c0), R', c0] block array."""
    if cache.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must have a contiguous last dim, got strides {cache.stride()}")
    if not nz:
        if cache.dim() != 3 or cache.shape[2] != width:
            raise ValueError(f"{fn}: {name} must be ND [num_blocks, block_size, {width}], got {tuple(cache.shape)}")
        if block_size is not None and cache.shape[1] != block_size:
            raise ValueError(f"{fn}: {name} has {cache.shape[1]} rows per block, block_size is {block_size}")
        return cache.shape[0], cache.shape[1], cache.stride(0), cache.stride(1), 0, triton.next_power_of_2(width)
    try:
        c0 = c0_of(cache.dtype)
    except ValueError as e:
        raise ValueError(f"{fn}: {name}: {e}") from None
    if cache.dim() != 4 or cache.shape[1] != -(-width // c0) or cache.shape[3] != c0 or cache.shape[2] % 16:
        raise ValueError(f"{fn}: {name} must be NZ [num_blocks, {-(-width // c0)}, R' (multiple of 16), {c0}] "
                         f"for width {width} in {cache.dtype}, got {tuple(cache.shape)}")
    return cache.shape[0], cache.shape[2], cache.stride(0), cache.stride(2), cache.stride(1), c0


def default_splits(batch: int, heads: int, max_tokens: int, device: torch.device, block_h: int,
                   block_t: int) -> int:
    """Splits per sequence: enough programs for ~2 waves over the device's SMs, no split shorter than
    MIN_SPLIT_TOKENS, at most MAX_SPLITS. Uses the block table's width, never the lengths (no host sync)."""
    programs = batch * triton.cdiv(heads, block_h)
    want = triton.cdiv(2 * num_sms(device), programs)
    return max(1, min(want, triton.cdiv(max_tokens, max(block_t, MIN_SPLIT_TOKENS)), MAX_SPLITS))


def paged_mla_decode(q_abs: torch.Tensor, q_pe: torch.Tensor, c_cache: torch.Tensor, pe_cache: torch.Tensor,
                     block_table: torch.Tensor, lengths: torch.Tensor, softmax_scale: float,
                     fa_k: Union[torch.Tensor, float, None] = None, nz: bool = False,
                     num_splits: Optional[int] = None, *, block_size: Optional[int] = None,
                     precision: Optional[str] = None, check: bool = True, block_h: Optional[int] = None,
                     block_t: Optional[int] = None, num_warps: Optional[int] = None,
                     num_stages: Optional[int] = None) -> torch.Tensor:
    """One decode step of B sequences: ``o_lat`` [B, H, C] float32, the meaning of
    ``pipeline.engine.attention.paged.paged_decode_attention`` (see the module docstring).

    ``q_abs`` [B, H, C], ``q_pe`` [B, H, d_r] (any float dtype); ``c_cache`` the latent blocks (int8 with
    ``fa_k``, or the model dtype with ``fa_k=None``), ``pe_cache`` the k_pe blocks, both ND or both NZ
    (``nz``); ``block_table`` int32 [B, max_blocks] (entries past a sequence's blocks are never read);
    ``lengths`` [B] cached tokens per sequence, each in 1 .. max_blocks * block_size. ``block_size``:
    needed for NZ only when it is not a multiple of 16 (NZ rows are padded to 16; default R').
    ``check``: validate lengths and the block ids they reach (a host sync on CUDA; the engine, which
    built the tables, may pass False). ``precision``: one of PRECISIONS (default "bf16").
    """
    fn = "paged_mla_decode"
    dev = check_device(fn, q_abs=q_abs, q_pe=q_pe, c_cache=c_cache, pe_cache=pe_cache,
                       block_table=block_table, lengths=lengths)
    if q_abs.dim() != 3 or not q_abs.is_floating_point():
        raise ValueError(f"{fn}: q_abs must be a float [B, H, C], got {q_abs.dtype} {tuple(q_abs.shape)}")
    B, H, C = q_abs.shape
    if q_pe.dim() != 3 or q_pe.shape[:2] != (B, H) or not q_pe.is_floating_point():
        raise ValueError(f"{fn}: q_pe must be a float [{B}, {H}, d_r], got {q_pe.dtype} {tuple(q_pe.shape)}")
    R = q_pe.shape[2]
    q_abs, q_pe = q_abs.contiguous(), q_pe.contiguous()
    nb, rows, sc_blk, sc_row, sc_frac, c0c = _layout(fn, "c_cache", c_cache, C, nz, block_size)
    nb_pe, rows_pe, sp_blk, sp_row, sp_frac, c0r = _layout(fn, "pe_cache", pe_cache, R, nz, block_size)
    if nb_pe != nb or rows_pe != rows:
        raise ValueError(f"{fn}: c_cache {tuple(c_cache.shape)} and pe_cache {tuple(pe_cache.shape)} do not "
                         f"hold the same blocks")
    bs = rows if block_size is None else block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or not 1 <= bs <= rows:
        raise ValueError(f"{fn}: block_size must be an integer in 1..{rows}, got {block_size!r}")
    if not pe_cache.is_floating_point():
        raise ValueError(f"{fn}: pe_cache must hold floats, got {pe_cache.dtype}")
    if c_cache.dtype == torch.int8:
        if fa_k is None:
            raise ValueError(f"{fn}: fa_k is required with an int8 c_cache (the layer's FA3 scale)")
        s_k = float(fa_k)
        if not (math.isfinite(s_k) and s_k > 0):
            raise ValueError(f"{fn}: fa_k must be a positive finite scale, got {s_k}")
    elif c_cache.is_floating_point():
        if fa_k is not None:
            raise ValueError(f"{fn}: fa_k given with a {c_cache.dtype} c_cache (only an int8 latent has a scale)")
        s_k = 1.0
    else:
        raise ValueError(f"{fn}: c_cache must be int8 or a float dtype, got {c_cache.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: block_table must be int32 [{B}, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    block_table = block_table.to(torch.int32).contiguous()
    if lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: lengths must be int32/int64 [{B}], got {lengths.dtype} {tuple(lengths.shape)}")
    lengths = lengths.to(torch.int32).contiguous()
    max_tokens = block_table.shape[1] * bs
    if check:
        _check_lengths(fn, lengths, block_table, bs, nb)
    precision = "bf16" if precision is None else precision
    if precision not in PRECISIONS:
        raise ValueError(f"{fn}: precision must be one of {PRECISIONS}, got {precision!r}")
    mode = {"ieee": _DOT_IEEE, "tf32": _DOT_TF32, "bf16": _DOT_BF16_EMULATED if INTERPRET else _DOT_BF16}[precision]

    bh = block_h or 16
    bt = block_t or (16 if INTERPRET else 32)
    S = num_splits if num_splits is not None else default_splits(B, H, max_tokens, dev, bh, bt)
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"{fn}: num_splits must be an integer >= 1, got {num_splits!r}")
    acc = torch.empty(B, H, S, C, dtype=torch.float32, device=dev)
    m = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    l = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    out = torch.empty(B, H, C, dtype=torch.float32, device=dev)
    launch = {} if INTERPRET else {"num_warps": num_warps or 4, "num_stages": num_stages or 2}
    _mla_split_kernel[(B, triton.cdiv(H, bh), S)](
        q_abs, q_pe, c_cache, pe_cache, block_table, lengths, acc, m, l,
        q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1),
        sc_blk, sc_row, sc_frac, sp_blk, sp_row, sp_frac, block_table.stride(0),
        H, C, R, bs, S, softmax_scale * s_k * LOG2E, softmax_scale * LOG2E,
        BLOCK_H=bh, BLOCK_T=bt, BLOCK_C=triton.next_power_of_2(C), BLOCK_R=triton.next_power_of_2(R),
        C0_C=c0c, C0_R=c0r, MODE=mode, **launch)
    _mla_combine_kernel[(B, H)](acc, m, l, out, out.stride(0), out.stride(1), H, C, S, s_k,
                                BLOCK_S=triton.next_power_of_2(S), BLOCK_C=min(triton.next_power_of_2(C), 512))
    return out


def _check_lengths(fn: str, lengths: torch.Tensor, table: torch.Tensor, bs: int, num_blocks: int) -> None:
    """Every length in 1 .. max_blocks * bs and every block id it reaches in 0 .. num_blocks - 1."""
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 1 or hi > table.shape[1] * bs:
        raise ValueError(f"{fn}: lengths must be in 1..{table.shape[1] * bs} (max_blocks {table.shape[1]} x "
                         f"block_size {bs}), got {lo}..{hi}")
    used = torch.arange(table.shape[1], device=table.device)[None, :] < (lengths[:, None] + bs - 1) // bs
    ids = table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"{fn}: block_table refers to block ids {int(ids.min())}..{int(ids.max())}, the cache "
                         f"has 0..{num_blocks - 1}")


def block_table_tensor(tables: Sequence[Union[Sequence[int], object]], lengths: Sequence[int], block_size: int,
                       device: Union[str, torch.device, None] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 [B, max_blocks] block table, int32 [B] lengths) from per-sequence block id lists or
    ``BlockTable`` objects (their ``.blocks``), padded with block 0 (never read)."""
    if len(tables) != len(lengths):
        raise ValueError(f"block_table_tensor: {len(tables)} table(s) but {len(lengths)} length(s)")
    rows = []
    for i, (t, n) in enumerate(zip(tables, lengths)):
        blocks, need = list(getattr(t, "blocks", t)), -(-int(n) // block_size)
        if len(blocks) < need:
            raise ValueError(f"block_table_tensor: sequence {i} has {n} token(s), which need {need} block(s) "
                             f"of {block_size}; its table has {len(blocks)}")
        rows.append(blocks[:need])
    width = max((len(r) for r in rows), default=0) or 1
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return table.to(device), torch.tensor([int(n) for n in lengths], dtype=torch.int32, device=device)


def paged_mla_decode_cache(q_abs: torch.Tensor, q_pe: torch.Tensor, cache, block_table: torch.Tensor,
                           lengths: torch.Tensor, softmax_scale: float, **kw) -> torch.Tensor:
    """``paged_mla_decode`` over a ``pipeline.engine.cache.paged_cache.PagedLatentCache`` (its tensors, scale,
    layout and block size)."""
    fa_k = None if cache.scale is None else float(cache.scale)
    return paged_mla_decode(q_abs, q_pe, cache.c, cache.pe, block_table, lengths, softmax_scale, fa_k=fa_k,
                            nz=cache.nz, block_size=cache.block_size, **kw)
