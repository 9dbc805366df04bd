"""Large uninitialized buffers from anonymous memory mappings, on transparent huge pages where the kernel
offers them for the asking (``/sys/kernel/mm/transparent_hugepage/enabled`` = madvise or always).

The weight phase allocates and fills gigabytes of fresh memory (each read unit, each int8 weight); with
4 KiB pages the kernel's page faults dominate that (measured on the 2-vCPU VM: a fresh 300 MiB bytearray
~0.15 s, torch.empty + fill ~0.09 s, a huge-page mapping + fill ~0.05 s). A mapping is returned to the
system when the last object viewing it (a tensor made with ``torch.frombuffer`` keeps its buffer alive)
is gone. Small sizes use ordinary allocations. torch is imported only by :func:`empty`: pipeline.storage
uses this module, and the corpus reader imports storage in a process that must not load torch (it
changes standard-library docstrings).
"""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAPPED_MIN_BYTES = 8 << 20


def empty_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``nbytes`` (contents undefined for large ones, zeros for small ones)."""
    if nbytes < MAPPED_MIN_BYTES:
        return bytearray(nbytes)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:  # huge pages disabled or not supported: ordinary pages
            pass
    return m


def empty(shape: tuple[int, ...], dtype: "torch.dtype") -> "torch.Tensor":
    """``torch.empty(shape, dtype=dtype)`` on the CPU, from :func:`empty_buffer` when large."""
    import torch

    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(empty_buffer(nbytes), dtype=dtype, count=numel).view(shape)
