"""Weights the C kernels stream, in memory backed by transparent huge pages.

A decode step at DeepSeek's width reads hundreds of MB of packed weights once each; with 4 KiB pages every
4 KiB of a stream costs a TLB miss and a page walk, and on a kernel whose transparent huge pages are
``madvise`` (the common default) torch's allocations never get 2 MiB pages. :func:`empty` gives a tensor
whose storage starts on a 2 MiB boundary and is marked ``MADV_HUGEPAGE`` before anything touches it, so
the kernel backs it with huge pages where it can (`scripts/membw.c` measures the difference on a machine).
Below :data:`HUGE` bytes, or where ``madvise`` is not available, it is a plain ``torch.empty``. The values
are whatever the caller writes: nothing else changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

import torch

HUGE = 2 << 20
MADV_HUGEPAGE = 14
_libc: list = []


def _madvise():
    if not _libc:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            fn = lib.madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _libc.append(fn)
    return _libc[0]


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` / ``dtype``, huge-page backed where it is large
    enough (module docstring)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    madvise: Optional[object] = _madvise() if nbytes >= HUGE else None
    if madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE
    madvise(raw.data_ptr() + off, nbytes // 4096 * 4096, MADV_HUGEPAGE)   # failure: plain pages, same values
    return raw[off:off + nbytes].view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous huge-page backed copy of ``t`` (same values)."""
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out
