"""Ascend FRACTAL_NZ layout of a row-major matrix (docs/serving.md, "The KV cache").

A row-major ``X[R, C]`` (rows = tokens of a block, columns = channels) is cut into fractals of 16 rows x
``c0`` columns, ``c0 = 32`` for 1-byte dtypes (int8, uint8) and 16 for 2-byte dtypes (bfloat16, float16),
512 bytes per fractal. With ``R' = ceil(R / 16) * 16`` and ``C1 = ceil(C / c0)``::

    NZ.shape == [C1, R', c0]        X[i, j] -> NZ[j // c0, i, j % c0]        padding is zero

Every function accepts leading (batch) dims, which are carried through untouched: a paged cache
``[num_blocks, block_size, C]`` becomes ``[num_blocks, C1, R', c0]``. The conversions are pure
reshapes/permutes (plus a zero pad) and are exact both ways.
"""

from __future__ import annotations

import torch

FRACTAL_ROWS = 16
_C0 = {torch.int8: 32, torch.uint8: 32, torch.bfloat16: 16, torch.float16: 16}


def c0_of(dtype: torch.dtype) -> int:
    """Columns per fractal: 32 for int8/uint8, 16 for bfloat16/float16; ValueError for anything else."""
    try:
        return _C0[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"NZ layout: unsupported dtype {dtype} (supported: int8, uint8 with c0=32; "
                         f"bfloat16, float16 with c0=16)") from None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_dim(name: str, v: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"NZ layout: {name} must be an integer >= 0, got {v!r}")


def nz_shape(rows: int, cols: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(C1, R', c0)`` for an ND matrix of ``rows x cols`` elements of ``dtype``."""
    _check_dim("rows", rows)
    _check_dim("cols", cols)
    c0 = c0_of(dtype)
    return _ceil_div(cols, c0), _ceil_div(rows, FRACTAL_ROWS) * FRACTAL_ROWS, c0


def nd_to_nz(x: torch.Tensor) -> torch.Tensor:
    """``[..., R, C]`` (ND, row-major) -> ``[..., C1, R', c0]`` (NZ), zero-padded, contiguous."""
    if x.dim() < 2:
        raise ValueError(f"nd_to_nz: need a tensor of >= 2 dims [..., rows, cols], got shape {tuple(x.shape)}")
    *lead, rows, cols = x.shape
    c1, rp, c0 = nz_shape(rows, cols, x.dtype)
    padded = x.new_zeros(*lead, rp, c1 * c0)
    padded[..., :rows, :cols] = x
    n = len(lead)
    # [..., R', C1, c0] -> [..., C1, R', c0]
    return padded.view(*lead, rp, c1, c0).permute(*range(n), n + 1, n, n + 2).contiguous()


def _check_nz(fn: str, nz: torch.Tensor) -> tuple[int, int, int]:
    if nz.dim() < 3:
        raise ValueError(f"{fn}: need an NZ tensor of >= 3 dims [..., C1, R', c0], got shape {tuple(nz.shape)}")
    c1, rp, c0 = nz.shape[-3:]
    if c0 != c0_of(nz.dtype):
        raise ValueError(f"{fn}: last dim of an NZ {nz.dtype} tensor must be c0={c0_of(nz.dtype)}, got shape "
                         f"{tuple(nz.shape)}")
    if rp % FRACTAL_ROWS:
        raise ValueError(f"{fn}: NZ row dim R'={rp} is not a multiple of {FRACTAL_ROWS} (shape {tuple(nz.shape)})")
    return c1, rp, c0


def _gather_rows(nz: torch.Tensor, t0: int, t1: int, cols: int) -> torch.Tensor:
    """ND rows [t0, t1), columns [0, cols) of a validated NZ tensor: [..., t1 - t0, cols], contiguous."""
    c1, _, c0 = nz.shape[-3:]
    n = nz.dim() - 3
    lead = nz.shape[:-3]
    part = nz[..., t0:t1, :]                                       # [..., C1, t, c0]
    nd = part.permute(*range(n), n + 1, n, n + 2).reshape(*lead, t1 - t0, c1 * c0)
    return nd[..., :cols].contiguous()


def nz_to_nd(nz: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[..., C1, R', c0]`` (NZ) -> ``[..., rows, cols]`` (ND); the NZ shape must be ``nz_shape(rows, cols)``."""
    _check_nz("nz_to_nd", nz)
    want = nz_shape(rows, cols, nz.dtype)
    if tuple(nz.shape[-3:]) != want:
        raise ValueError(f"nz_to_nd: NZ shape {tuple(nz.shape)} does not hold a {rows}x{cols} {nz.dtype} "
                         f"matrix (expected [..., {want[0]}, {want[1]}, {want[2]}])")
    return _gather_rows(nz, 0, rows, cols)


def nz_rows(nz: torch.Tensor, t0: int, t1: int, cols: int) -> torch.Tensor:
    """ND rows ``[t0, t1)`` (columns ``[0, cols)``) read straight from the NZ tensor, without converting the
    rest: equals ``nz_to_nd(nz, R, cols)[..., t0:t1, :]`` for any R >= t1. Shape ``[..., t1 - t0, cols]``."""
    c1, rp, c0 = _check_nz("nz_rows", nz)
    _check_dim("cols", cols)
    if _ceil_div(cols, c0) != c1:
        raise ValueError(f"nz_rows: cols={cols} does not match the NZ tensor's C1={c1} (c0={c0}, shape "
                         f"{tuple(nz.shape)})")
    for name, v in (("t0", t0), ("t1", t1)):
        _check_dim(name, v)
    if not t0 <= t1 <= rp:
        raise ValueError(f"nz_rows: row range [{t0}, {t1}) is not within [0, {rp}] of shape {tuple(nz.shape)}")
    return _gather_rows(nz, t0, t1, cols)
