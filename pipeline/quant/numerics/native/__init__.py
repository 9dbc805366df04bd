"""Native kernels for the weight phase, compiled on first use with the machine's C compiler and loaded
with ctypes; when there is no compiler (or ``DSQUANT_NATIVE=0``), callers use their torch code instead,
which computes the same bits.

Why: on a CPU the per-channel quantization of an FP8 weight through torch ops takes about 1.1 s per
billion weights on one core (ten elementwise passes, most on bf16, which this kind of CPU has no
instructions for); the kernels (:file:`fp8_int8.c`: from FP8 codes, from bf16 weights, int8 row sums)
do it in one vectorized pass per row, ~0.3 s, so the weight phase is bound by reading, hashing and
writing, not by arithmetic.

Built and loaded by :class:`pipeline.cbuild.NativeLibrary` (compiled on first use, cached per CPU and
compiler). ctypes releases the GIL during the call: the reader and writer threads keep running.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from pipeline.cbuild import BASE_FLAGS, NativeLibrary, compiler

SOURCE = Path(__file__).with_name("fp8_int8.c")
FLAGS = BASE_FLAGS
_compiler = compiler  # the C compiler the build uses (tests ask whether there is one)


def _declare(dll: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dll.fp8_to_int8_bf16.argtypes = [p, i64, i64, p, i64, i64, p, p, ctypes.c_float, p]
    dll.fp8_to_int8_bf16.restype = None
    dll.bf16_to_int8.argtypes = [p, i64, i64, p, p, ctypes.c_float]
    dll.bf16_to_int8.restype = None
    dll.int8_row_sums.argtypes = [p, i64, i64, p]
    dll.int8_row_sums.restype = None


_LIB = NativeLibrary(SOURCE, _declare, FLAGS, what="native weight kernel (same results with torch ops, slower)")


def library() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None (the reason in :func:`status`); built once per process."""
    return _LIB.library()


def status() -> str:
    """Which implementation the weight phase uses, for logs and benchmark records."""
    return _LIB.status()


def fp8_to_int8_bf16(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], q: torch.Tensor,
                     ws: torch.Tensor) -> bool:
    """Per-channel int8 of an FP8 block weight for a bf16 model into ``q`` (int8 [n, k]) and ``ws``
    (float32 [n], bf16 values): see fp8_int8.c. ``codes``: its uint8 view [n, k]; ``scales``: float32
    [ceil(n / b0), ceil(k / b1)]. Returns False (nothing written) when the kernel is not available."""
    lib = library()
    if lib is None:
        return False
    n, k = codes.shape
    tensors = (codes, scales, q, ws)
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
        raise ValueError("fp8_to_int8_bf16 needs contiguous CPU tensors")
    if (codes.dtype, scales.dtype, q.dtype, ws.dtype) != (torch.uint8, torch.float32, torch.int8, torch.float32):
        raise ValueError("fp8_to_int8_bf16: dtypes must be uint8 codes, float32 scales, int8 q, float32 ws")
    if tuple(q.shape) != (n, k) or ws.numel() != n or tuple(scales.shape) != (-(-n // block[0]), -(-k // block[1])):
        raise ValueError("fp8_to_int8_bf16: shapes do not fit")
    srow = torch.empty(k, dtype=torch.float32)
    lib.fp8_to_int8_bf16(codes.data_ptr(), n, k, scales.data_ptr(), block[0], block[1], q.data_ptr(),
                         ws.data_ptr(), ctypes.c_float(torch.finfo(torch.float32).eps), srow.data_ptr())
    return True


def bf16_to_int8(w: torch.Tensor, q: torch.Tensor, ws: torch.Tensor) -> bool:
    """Per-channel int8 of a bf16 weight [n, k] into ``q`` (int8 [n, k]) and ``ws`` (float32 [n], bf16
    values), as quantize_weight_per_channel computes it; False (nothing written) when the kernel is not
    available or the tensors are not contiguous CPU ones."""
    lib = library()
    if lib is None or not all(t.is_contiguous() and t.device.type == "cpu" for t in (w, q, ws)):
        return False
    n, k = w.shape
    if (w.dtype, q.dtype, ws.dtype) != (torch.bfloat16, torch.int8, torch.float32) or tuple(q.shape) != (n, k) \
            or ws.numel() != n:
        raise ValueError("bf16_to_int8: expected bf16 w [n, k], int8 q [n, k], float32 ws [n]")
    lib.bf16_to_int8(w.data_ptr(), n, k, q.data_ptr(), ws.data_ptr(), ctypes.c_float(torch.finfo(torch.float32).eps))
    return True


def int8_row_sums(q: torch.Tensor) -> Optional[torch.Tensor]:
    """Exact int64 row sums of a contiguous int8 [n, k] CPU tensor (k < 2^24), or None when the kernel
    is not available (torch's integer reductions run ~1-3 s per billion elements on one core here)."""
    lib = library()
    if lib is None or q.dim() != 2 or q.dtype != torch.int8 or not q.is_contiguous() or q.device.type != "cpu" \
            or q.shape[1] >= 1 << 24:
        return None
    out = torch.empty(q.shape[0], dtype=torch.int64)
    lib.int8_row_sums(q.data_ptr(), q.shape[0], q.shape[1], out.data_ptr())
    return out
