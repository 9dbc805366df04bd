"""The engine's C kernels for decode attention over the paged MLA latent cache and for the step's cache
write, on the CPU (``pipeline.engine.worker.kernels`` backend ``"native"``).

:func:`decode_attention` computes, for every decode row of a step in ONE C call (csrc/mla_decode_cpu.c),
what :func:`pipeline.engine.attention.batched.batched_decode_attention` computes::

    scores[b, h, t] = softmax_scale * (s_k * <q_abs[b, h], c[b, t]> + <q_pe[b, h], k_pe[b, t]>),  t < L_b
    o_lat[b, h]     = s_k * sum_t softmax_t(scores[b, h, :]) * c[b, t]

reading the int8 / bf16 / fp16 / float32 latent and k_pe straight from the cache storage (ND or NZ)
through the block table, each token converted to float32 once per layer and used for all heads' scores
and the V sum while in cache; online softmax in float32 over tiles of ``tile`` tokens. Given the layer's
absorbed weights it also does the absorption around it (``q_abs = q_nope @ W_UK`` before, ``o = o_lat @
W_UV^T`` after, each a small GEMM over all the rows of a head): the engine's decode rows take one call per
layer from q_nope to o. It agrees with the torch path within float32 rounding (the sums run in another
order), not bit for bit; a head's and a row's bits never depend on the other heads or rows of the call. Why: the torch
path is bound by per-op overhead and the float32 copy of each tile; this one is bound by its FMAs
(scripts/bench_cpu_attention.py: ~4-8x faster per layer at the embedded model's shapes).

:func:`write_slots` stores a step's latents (quantized exactly as ``paged_cache._to_int8`` does) and k_pe
into their ND or NZ slots in one C call (csrc/latent_write_cpu.c, built without FMA contraction): the
bytes are identical to the torch code's.

Both libraries are built on first use by :class:`pipeline.cbuild.NativeLibrary`; when one cannot be
built (no compiler, ``DSQUANT_NATIVE=0``) the callers keep their torch code (:func:`library` is None).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from pipeline.cbuild import BASE_FLAGS, EXACT_FLAGS, NativeLibrary

CSRC = Path(__file__).with_name("csrc")
#: Tokens per tile: 32 x C=512 float32 is 64 KiB, held in L2 between the scores and the V sum.
DEFAULT_TILE = 32
_DTYPES = {torch.int8: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)     # the absorbed weights
_ERRORS = {1: "out of memory", 2: "a length outside 1 .. W * block_size (or a slot outside the cache)",
           3: "a block id outside the cache"}


def _declare_attention(dll: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    dll.mla_decode.argtypes = [p, p, i64, i64, i64, i64, p, i32, i64, i64, i64, i64, p, i32, i64, i64, i64, i64,
                               p, i64, p, i64, i64, f32, f32, i64, p]
    dll.mla_decode.restype = i32
    dll.mla_decode_absorbed.argtypes = [p, i64, p, p, i32, i64] + dll.mla_decode.argtypes[1:]
    dll.mla_decode_absorbed.restype = i32
    dll.mla_decode_vectorized.argtypes, dll.mla_decode_vectorized.restype = [], i32


def _declare_write(dll: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    dll.latent_write.argtypes = [p, i32, i64, i64, p, i64, p, i32, i64, i64, i64, i64, i64, f32]
    dll.latent_write.restype = i32


_ATTENTION = NativeLibrary(CSRC / "mla_decode_cpu.c", _declare_attention, BASE_FLAGS,
                           what="native decode attention (torch ops give the same within float32 rounding)")
_WRITE = NativeLibrary(CSRC / "latent_write_cpu.c", _declare_write, EXACT_FLAGS,
                       what="native cache write (torch ops give the same bytes)")


def library() -> Optional[ctypes.CDLL]:
    """The decode attention library, or None (why in :func:`status`)."""
    return _ATTENTION.library()


def serving_library() -> Optional[ctypes.CDLL]:
    """The decode attention library where the engine should serve with it: built with its AVX-512 or its
    AVX2 + FMA loops (several times faster than torch's ops: benchmarks/engine_profile*.json). Built for a
    CPU with neither its loops are plain C (the tests still check them), slower than torch's ops, so the
    engine keeps torch."""
    dll = _ATTENTION.library()
    return dll if dll is not None and dll.mla_decode_vectorized() else None


def write_library() -> Optional[ctypes.CDLL]:
    """The cache write library, or None."""
    return _WRITE.library()


def status() -> str:
    dll = _ATTENTION.library()
    plain = " (plain C: the engine serves with torch's ops)" if dll is not None and not dll.mla_decode_vectorized() else ""
    return f"attention: {_ATTENTION.status()}{plain}; cache write: {_WRITE.status()}"


def set_threads(n: int) -> int:
    """Threads for the decode attention's pool (csrc/pool.h: the heads in groups; the bits do not depend on
    it), the caller included; returns the count set (1 when the library is not built)."""
    return _ATTENTION.set_threads(n)


def reset() -> None:
    """Forget the loaded libraries (tests that flip DSQUANT_NATIVE)."""
    _ATTENTION.reset()
    _WRITE.reset()


def _strides(store: torch.Tensor, nz: bool) -> tuple[int, int, int, int]:
    """(per block, per token, per column chunk, chunk width) in elements of an ND [nb, bs, cols] or NZ
    [nb, C1, R', c0] store (contiguous)."""
    if nz:
        _, c1, rp, c0 = store.shape
        return c1 * rp * c0, c0, rp * c0, c0
    _, bs, cols = store.shape
    return bs * cols, cols, 0, cols


def _dtype(t: torch.Tensor, what: str) -> int:
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise ValueError(f"native kernels: {what} has dtype {t.dtype}; int8, bfloat16, float16 or float32 "
                         f"expected") from None


def decode_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, cache, batch, softmax_scale: float,
                     tile: int = DEFAULT_TILE, w_uk: Optional[torch.Tensor] = None,
                     w_uv_t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``q_abs`` [B, H, C], ``q_pe`` [B, H, d_r] float32 of ``batch``'s rows (a DecodeBatch) -> ``o_lat``
    [B, H, C] float32 (module docstring). With the absorbed weights ``w_uk`` [H, d_n, C] and ``w_uv_t``
    [H, C, d_v] (float32, as ModelRunner keeps them) the absorption is folded into the same call: the first
    argument is then ``q_nope`` [B, H, d_n] (q_abs = q_nope @ W_UK per head, computed in C) and the result
    ``o`` = o_lat @ W_UV^T [B, H, d_v]. RuntimeError when the library is not available."""
    lib = _ATTENTION.loaded()
    if lib is None:
        raise RuntimeError(f"native decode attention unavailable: {_ATTENTION.status()}")
    B, H, width = q_abs.shape
    table, lengths = batch.table, batch.lengths
    absorbed = w_uk is not None
    if absorbed != (w_uv_t is not None):
        raise ValueError("native decode attention: w_uk and w_uv_t go together")
    C, name = (w_uk.shape[2], "q_nope") if absorbed else (width, "q_abs")
    if C != cache.C or q_pe.shape != (B, H, cache.d_r) or table.shape[0] != B or lengths.shape != (B,):
        raise ValueError(f"native decode attention: {name} {tuple(q_abs.shape)}, q_pe {tuple(q_pe.shape)}, table "
                         f"{tuple(table.shape)}, lengths {tuple(lengths.shape)} for C={cache.C}, d_r={cache.d_r}")
    if absorbed and (w_uk.shape != (H, width, C) or w_uv_t.dim() != 3 or w_uv_t.shape[:2] != (H, C)
                     or w_uk.dtype not in _WEIGHT_DTYPES or w_uv_t.dtype != w_uk.dtype):
        raise ValueError(f"native decode attention: w_uk {tuple(w_uk.shape)} {w_uk.dtype} / w_uv_t "
                         f"{tuple(w_uv_t.shape)} {w_uv_t.dtype} for {name} {tuple(q_abs.shape)}: float32 or bf16 "
                         f"[H, d_n, C] and [H, C, d_v] (one dtype) expected")
    if q_abs.device.type != "cpu" or cache.c.device.type != "cpu":
        raise ValueError(f"native decode attention: CPU tensors needed, got {name} on {q_abs.device}, the "
                         f"cache on {cache.c.device}")
    if q_abs.dtype != torch.float32 or q_pe.dtype != torch.float32:
        raise ValueError(f"native decode attention: {name} / q_pe must be float32, got {q_abs.dtype} / "
                         f"{q_pe.dtype}")
    if table.dtype != torch.long or lengths.dtype != torch.long:
        raise ValueError("native decode attention: the block table and lengths must be int64")
    if not isinstance(tile, int) or tile < 1:
        raise ValueError(f"native decode attention: tile must be an integer >= 1, got {tile!r}")
    q_abs, q_pe, table, lengths = q_abs.contiguous(), q_pe.contiguous(), table.contiguous(), lengths.contiguous()
    if absorbed:
        w_uk, w_uv_t = w_uk.contiguous(), w_uv_t.contiguous()
        out = torch.empty(B, H, w_uv_t.shape[2], dtype=torch.float32)
    else:
        out = torch.empty(B, H, C, dtype=torch.float32)
    fn, head, tail = _decode_parts(lib, q_abs, q_pe, cache, softmax_scale, tile, w_uk, w_uv_t, out)
    rc = fn(*head, table.data_ptr(), table.shape[1], lengths.data_ptr(), *tail)
    if rc:
        raise ValueError(f"native decode attention: {_ERRORS.get(rc, f'error {rc}')}")
    return out


def _decode_parts(lib, q: torch.Tensor, q_pe: torch.Tensor, cache, softmax_scale: float, tile: int,
                  w_uk: Optional[torch.Tensor], w_uv_t: Optional[torch.Tensor], out: torch.Tensor) -> tuple:
    """(the C function, its arguments before the block table's three, those after) for contiguous float32
    ``q`` (q_abs, or q_nope with the absorbed weights), ``q_pe`` and ``out``."""
    B, H, width = q.shape
    c, pe = cache.c, cache.pe
    head = (q_pe.data_ptr(), B, H, cache.C, cache.d_r,
            c.data_ptr(), _dtype(c, "the cache latent"), *_strides(c, cache.nz),
            pe.data_ptr(), _dtype(pe, "the cache k_pe"), *_strides(pe, cache.nz))
    tail = (cache.block_size, cache.num_blocks, cache.scale_value, softmax_scale, tile, out.data_ptr())
    if w_uk is None:
        return lib.mla_decode, (q.data_ptr(), *head), tail
    return lib.mla_decode_absorbed, (q.data_ptr(), width, w_uk.data_ptr(), w_uv_t.data_ptr(),
                                     _DTYPES[w_uk.dtype], w_uv_t.shape[2], *head), tail


def bind_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, cache, softmax_scale: float, w_uk: torch.Tensor,
                w_uv_t: torch.Tensor, out: torch.Tensor, tile: int = DEFAULT_TILE) -> Optional[tuple]:
    """(C function, arguments before the block table, arguments after it, tensors to hold) of
    :func:`decode_attention` with the absorbed weights into ``out`` [B, H, d_v], for the tensors' current
    storage: a call passes ``(table pointer, table width, lengths pointer)`` between the two (a step's
    DecodeBatch); None where the engine would not serve decode attention with C on these tensors."""
    lib = _ATTENTION.loaded()               # (the engine chose the C decode when it was built)
    B, H, d_n = q_nope.shape
    ok = (lib is not None and all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
                                  for t in (q_nope, q_pe, out))
          and w_uk.dtype in _WEIGHT_DTYPES and w_uv_t.dtype == w_uk.dtype
          and all(t.is_cpu and t.is_contiguous() for t in (w_uk, w_uv_t))
          and cache.c.is_cpu and cache.c.dtype in _DTYPES and cache.pe.dtype in _DTYPES
          and q_pe.shape == (B, H, cache.d_r) and w_uk.shape == (H, d_n, cache.C)
          and w_uv_t.dim() == 3 and w_uv_t.shape[:2] == (H, cache.C) and out.shape == (B, H, w_uv_t.shape[2]))
    if not ok:
        return None
    fn, head, tail = _decode_parts(lib, q_nope, q_pe, cache, softmax_scale, tile, w_uk, w_uv_t, out)
    return fn, head, tail, (w_uk, w_uv_t)


def _put_args(rows: torch.Tensor, slots: torch.Tensor, store: torch.Tensor, cache, scale: float) -> tuple:
    return (rows.data_ptr(), _DTYPES[rows.dtype], rows.shape[0], rows.shape[1], slots.data_ptr(),
            cache.num_blocks * cache.block_size, store.data_ptr(), _DTYPES[store.dtype], cache.block_size,
            *_strides(store, cache.nz), scale)


def _put(lib, rows: torch.Tensor, slots: torch.Tensor, store: torch.Tensor, cache, scale: float) -> None:
    rc = lib.latent_write(*_put_args(rows, slots, store, cache, scale))
    if rc:
        raise ValueError("write_slots: a slot outside the cache's "
                         f"{cache.num_blocks} x {cache.block_size} slots")


def write_slots(cache, slots: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> bool:
    """PagedLatentCache.write_slots in one C call per store (shapes already checked by the caller); False
    (nothing written) when the library is not available or the tensors are not CPU ones of kernel
    dtypes. Dtype casts other than the int8 quantization (a float latent or k_pe in another dtype than
    the cache's) are done by torch first, so the stored bytes are torch's."""
    lib = _WRITE.loaded()
    if not _write_takes(lib, cache, slots, c, k_pe):
        return False
    if not cache.is_int8:
        c = c.to(cache.c.dtype)                 # (no copy when it is the cache's dtype already)
    pe = k_pe.to(cache.pe.dtype)
    slots, c, pe = slots.contiguous(), c.contiguous(), pe.contiguous()
    _put(lib, c, slots, cache.c, cache, cache.scale_value if cache.is_int8 else 1.0)
    _put(lib, pe, slots, cache.pe, cache, 1.0)
    return True


def _write_takes(lib, cache, slots: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> bool:
    """Whether the C write takes these tensors (write_slots' and bind_write's condition)."""
    return lib is not None and c.dtype in _DTYPES and c.dtype != torch.int8 and slots.dtype == torch.long \
        and cache.c.device.type == c.device.type == k_pe.device.type == slots.device.type == "cpu"


def bind_write(cache, slots: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> Optional[list]:
    """:func:`write_slots` as a list of (function, arguments, tensors to hold) for the tensors' current
    storage (contiguous ``slots`` int64 [S], ``c`` [S, C], ``k_pe`` [S, d_r]): torch's casts into buffers
    of the cache's dtypes where write_slots casts (functions returning None), then the C calls; None where
    write_slots would not call C."""
    lib = _WRITE.loaded()
    if not _write_takes(lib, cache, slots, c, k_pe) \
            or not (slots.is_contiguous() and c.is_contiguous() and k_pe.is_contiguous()):
        return None
    ops = []

    def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.dtype == dtype:
            return t
        buf = torch.empty(t.shape, dtype=dtype)
        ops.append((buf.copy_, (t,), ()))
        return buf
    if not cache.is_int8:
        c = cast(c, cache.c.dtype)
    pe = cast(k_pe, cache.pe.dtype)
    ops.append((lib.latent_write, _put_args(c, slots, cache.c, cache, cache.scale_value if cache.is_int8 else 1.0),
                (c,)))
    ops.append((lib.latent_write, _put_args(pe, slots, cache.pe, cache, 1.0), (pe,)))
    return ops
