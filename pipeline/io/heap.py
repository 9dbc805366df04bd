"""The process heap (glibc malloc) of a CPU engine process and of the layer-by-layer jobs.

:func:`tune` (an engine process): keep freed memory instead of handing it back. An engine step allocates
and frees activations of megabytes per layer (a 2048-token prefill: ~6 MB per [2048, 768] float32 tensor).
glibc serves such blocks with mmap, or trims them off the heap's top, so the next step faults the same
pages in again, zero-filled by the kernel: a large prefill step takes measurably longer than with the
settings below. vLLM's CPU build preloads tcmalloc for the same reason (its docs); here glibc's own
knobs, set once per process:

  M_MMAP_THRESHOLD  32 MiB (glibc's ceiling): smaller blocks come from the heap
  M_TRIM_THRESHOLD  1 GiB: the heap's free top is kept up to that much
  M_TOP_PAD         64 MiB: the heap grows in steps this large

``DSQUANT_MALLOC_TUNING=0`` leaves malloc as it is. Other C libraries (musl, macOS): nothing is done.

Loading and quantizing layer by layer are the other way round: a layer's temporaries (blocks under glibc's
mmap threshold, which it raises as large blocks are freed) come from the heap and, freed between blocks
still held, stay in the process, so the next layer's peak stacks on them. :func:`release` hands such free
pages back (malloc_trim), what the engine's loader and the quantize job's layer loop call after each layer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}

_applied: bool | None = None
_libc = None


def tune() -> bool:
    """Apply :data:`SETTINGS` once per process (glibc only); True when they are in effect."""
    global _applied
    if _applied is None:
        _applied = False
        libc = _glibc() if os.environ.get("DSQUANT_MALLOC_TUNING", "1") != "0" else None
        if libc is not None:
            try:
                _applied = all(libc.mallopt(k, v) == 1 for k, v in SETTINGS.items())
            except AttributeError:
                pass
    return _applied


def release() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing)."""
    libc = _glibc()
    if libc is not None:
        try:
            libc.malloc_trim(0)
        except AttributeError:
            pass


def _glibc():
    """glibc (ctypes), or None for another C library or where it cannot be opened."""
    global _libc
    if _libc is None:
        _libc = False
        if platform.libc_ver()[0] == "glibc":
            try:
                _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            except OSError:
                pass
    return _libc or None
