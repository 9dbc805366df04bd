"""The float model's weights as the CPU's bf16 GEMM reads them (csrc/bf16_gemm.h; used by
:mod:`pipeline.engine.native.cpu_float` for the linears and :mod:`pipeline.engine.native.cpu_float_ffn` for the MLPs
and MoEs).

The float model on the CPU computes in float32 from the checkpoint's bf16 values widened (exact), so a
float32 weight [n, k] holds bf16 values only (:func:`bf16_representable`); its bf16 bits carry all of it
in half the bytes. :func:`pack_bf16` lays them out in blocks of 16 output columns x 2 inputs: int32
[ceil(n/16), ceil(k/2), 16], the word for (column c, pair s) holding W[c, 2s] in its low half and
W[c, 2s+1] in its high half, zero padded.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pipeline.engine.native import hugepages


def bf16_representable(w: torch.Tensor) -> bool:
    """Whether a float32 tensor holds bf16 values only (widening its bf16 rounding gives it back)."""
    return w.dtype == torch.float32 and torch.equal(w.to(torch.bfloat16).float(), w)


def packed_shape(n: int, k: int) -> tuple[int, int, int]:
    return -(-n // 16), -(-k // 2), 16


def pack_bf16(w: torch.Tensor, name: str = "weight", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A float32 [n, k] weight of bf16 values, or a bf16 one, -> its packed bf16 bits (module docstring),
    int32, contiguous, on the CPU; written into ``out`` (contiguous int32 of :func:`packed_shape`, e.g. one
    slot of a stack) when given. ValueError naming ``name`` for another shape or dtype, or float32 values
    that are not bf16 values."""
    if w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16) or 0 in w.shape:
        raise ValueError(f"{name}: a float32 or bf16 [n, k] weight is needed, got {w.dtype} {tuple(w.shape)}")
    w = w.detach().cpu()
    if w.dtype == torch.float32 and not bf16_representable(w):
        raise ValueError(f"{name}: float32 values that are not bf16 values (the packed form holds bf16 bits)")
    n, k = w.shape
    nb, kh, _ = packed_shape(n, k)
    bits = w.to(torch.bfloat16).view(torch.int16)
    if (n, k) != (16 * nb, 2 * kh):                          # (no padded copy of a weight that needs none)
        bits = F.pad(bits, (0, 2 * kh - k, 0, 16 * nb - n))
    if out is None:
        out = hugepages.empty((nb, kh, 16), torch.int32)     # huge-page backed: the GEMMs stream it
    elif out.shape != (nb, kh, 16) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"{name}: the packed form is int32 {[nb, kh, 16]}, got {out.dtype} {list(out.shape)}")
    out.view(torch.int16).view(nb, kh, 16, 2).copy_(bits.view(nb, 16, kh, 2).permute(0, 2, 1, 3))
    return out


def unpack_bf16(bits: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float32 [n, k] weight that :func:`pack_bf16` packed into ``bits`` (a new tensor; exact: the bf16
    values widened)."""
    nb, kh, _ = packed_shape(n, k)
    w = bits.view(torch.int16).view(nb, kh, 16, 2).permute(0, 2, 1, 3).reshape(16 * nb, 2 * kh)[:n, :k]
    return w.contiguous().view(torch.bfloat16).float()
