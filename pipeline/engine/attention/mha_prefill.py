"""Prefill chunks in the non-absorbed (MHA) form, as vLLM and FlashMLA run MLA prefill: the cached latent
is decompressed through kv_b_proj's two halves and the chunk attends with per-head keys and values::

    c_deq = s_k * c_q[0 .. start + S)               (the cache's stored latent, dequantized)
    k_nope = c_deq @ W_UK^T,  v = c_deq @ W_UV^T     [T, H, d_n], [T, H, d_v]
    o = softmax(scale * (q_nope . k_nope + q_pe . k_pe), causal) @ v      -> [S, H, d_v]

which is the absorbed form's ``o_lat @ W_UV^T`` reassociated (same values up to float32 rounding), at a
fraction of its work for short contexts: per layer and head, scores and values over d_n + d_r and d_v
columns instead of the latent's C = 512 (the embedded model: ~23 M multiply-adds for a 128-token prompt,
decompression included, against ~67 M), and one fused scaled_dot_product_attention call. The absorbed
path (``attention.paged_prefill_attention``) stays as the reference mode (``ModelRunner(mha_prefill=False)``).

With the ``native`` kernels on the CPU a chunk takes one C call instead (csrc/mha_prefill_cpu.c, given
the layer's :func:`native_weights`): the decompression product on the AMX tiles (bf16 inputs, float32
sums: exact products, as the cached latent's values are bf16 values) or FMA loops, the causal attention
over only the visible keys, without torch's per-op costs and its slow exp of the masked -inf scores. It
agrees with the torch form within
float32 rounding, and a chunk's result never depends on the other chunks of the step. The runner makes
one such call per layer for all of a step's chunks (:func:`native_prefill_chunks`), the cache blocks read
in C (csrc/cache_rows.h, the decode kernel's reader) instead of copied to float32 by torch per chunk
(figures: benchmarks/engine_profile*.json, docs/performance.md)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from pipeline.cbuild import BASE_FLAGS, NativeLibrary
from pipeline.engine.attention.paged import _blocks_of
from pipeline.engine.native.bf16_pack import bf16_representable, pack_bf16
from pipeline.engine.cache.paged_cache import PagedLatentCache
from pipeline.model.mla import causal_mask


#: Up to this many scores (heads x queries x keys, float32) a chunk attends with its scores held whole:
#: one scaled matmul, the causal mask, softmax, one matmul (16 MiB; the embedded model's 128-token prompt
#: holds 65 K). Above it torch's flash CPU kernel tiles them (v zero-padded to the keys' width, which that
#: kernel needs): held whole, a prompt's scores are one GEMM each way, faster than flash's tiles and than
#: the math fallback torch takes for a v narrower than the keys.
WHOLE_SCORES_MAX = 1 << 22


def _declare(dll: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    dll.mha_prefill_has_amx.argtypes, dll.mha_prefill_has_amx.restype = [], i32
    dll.mha_prefill_has_bf16_dot.argtypes, dll.mha_prefill_has_bf16_dot.restype = [], i32
    dll.mha_prefill_vectorized.argtypes, dll.mha_prefill_vectorized.restype = [], i32
    dll.mha_prefill.argtypes = [p, p, i64, i64, i64, i64, i64, p, p, i64, i64, p, f32, f32, i32, p]
    dll.mha_prefill.restype = i32
    dll.mha_prefill_paged.argtypes = [p, p, i64, i64, i64, i64, i64, p, i32, i64, i64, i64, i64, p, i32, i64, i64, i64,
                                      i64, i64, i64, i64, p, p, i64, p, f32, f32, i32, p]
    dll.mha_prefill_paged.restype = i32


_LIB = NativeLibrary(Path(__file__).parents[1] / "native" / "csrc" / "mha_prefill_cpu.c", _declare, BASE_FLAGS,
                     what="native MHA prefill (torch ops give the same within float32 rounding)")


def library() -> Optional[ctypes.CDLL]:
    return _LIB.library()


def serving_library() -> Optional[ctypes.CDLL]:
    """The library where the engine should serve with it: built with its AVX-512 or AVX2 + FMA loops
    (faster than torch's ops). Built with neither its loops are plain C (the tests still check them),
    slower than torch's ops, so the engine keeps torch (benchmarks/engine_profile*.json)."""
    dll = _LIB.library()
    return dll if dll is not None and dll.mha_prefill_vectorized() else None


def native_weights(w_kv: torch.Tensor) -> Optional[torch.Tensor]:
    """:func:`kv_weights` [H, C, d_n + d_v] as the C call reads them (a [H * (d_n + d_v), C] weight's
    packed bf16 bits, :func:`pipeline.engine.native.bf16_pack.pack_bf16`); None when its values are not all bf16
    values (the torch form then runs)."""
    H, C, w = w_kv.shape
    lin = w_kv.permute(0, 2, 1).reshape(H * w, C)
    return pack_bf16(lin, "kv_b_proj") if bf16_representable(lin) else None


def native_prefill_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: PagedLatentCache, blocks,
                             start: int, w_pack: torch.Tensor, d_v: int, softmax_scale: float,
                             amx: bool = True) -> torch.Tensor:
    """:func:`mha_prefill_attention` in one C call (module docstring); ``w_pack``: :func:`native_weights`;
    ``amx=False``: the FMA loops even where bf16 dot products could run (the AMX tiles, or AVX512-BF16's
    vdpbf16ps without AMX; tests compare the two). RuntimeError
    when the library is not available."""
    lib = _LIB.loaded()
    if lib is None:
        raise RuntimeError(f"native MHA prefill unavailable: {_LIB.status()}")
    S, H, d_n = q_nope.shape
    T = start + S
    c, pe = cache.read_f32(_blocks_of(blocks, cache, T, "mha_prefill_attention"), T)
    if w_pack.dtype != torch.int32 or w_pack.dim() != 3 or w_pack.shape[0] * 16 < H * (d_n + d_v) \
            or w_pack.shape[1] * 2 < cache.C or q_pe.shape != (S, H, cache.d_r):
        raise ValueError(f"native MHA prefill: w_pack {w_pack.dtype} {tuple(w_pack.shape)}, q_nope "
                         f"{tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)} for C={cache.C}, d_v={d_v}")
    q_nope, q_pe = q_nope.float().contiguous(), q_pe.float().contiguous()
    c, pe = c.contiguous(), pe.contiguous()
    o = torch.empty(S, H, d_v, dtype=torch.float32)
    amx_ok = amx and (cache.is_int8 or cache.c.dtype == torch.bfloat16)   # the latent's values: bf16 values
    rc = lib.mha_prefill(q_nope.data_ptr(), q_pe.data_ptr(), S, H, d_n, cache.d_r, d_v, c.data_ptr(),
                         pe.data_ptr(), start, cache.C, w_pack.data_ptr(),
                         cache.scale_value if cache.is_int8 else 1.0, softmax_scale, int(amx_ok), o.data_ptr())
    if rc:
        raise MemoryError("native MHA prefill: out of memory")
    return o


def native_prefill_chunks(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: PagedLatentCache, chunks,
                          w_pack: torch.Tensor, d_v: int, softmax_scale: float, out: torch.Tensor,
                          amx: bool = True) -> None:
    """:func:`native_prefill_attention` for every prefill chunk of a layer's step in ONE C call that reads
    the cache blocks itself (no float32 copy of them made by torch, no call per chunk): ``chunks`` lists
    (blocks, start, a, b): the chunk's rows a .. b-1 of ``q_nope`` [N, H, d_n] / ``q_pe`` [N, H, d_r]
    (float32) at positions start .., its blocks; their outputs go to the same rows of ``out`` [N, H, d_v]
    (float32, contiguous). The same values as :func:`native_prefill_attention` chunk by chunk (the same
    rows, exactly converted, through the same C code). RuntimeError without the library; ValueError for
    bad shapes or blocks."""
    lib = _LIB.loaded()
    if lib is None:
        raise RuntimeError(f"native MHA prefill unavailable: {_LIB.status()}")
    from pipeline.engine.native.cpu_attention import _dtype, _strides

    N, H, d_n = q_nope.shape
    if q_pe.shape != (N, H, cache.d_r) or out.shape != (N, H, d_v) or out.dtype != torch.float32 \
            or not out.is_contiguous() or w_pack.dtype != torch.int32 or w_pack.shape[0] * 16 < H * (d_n + d_v):
        raise ValueError(f"native MHA prefill: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, out "
                         f"{tuple(out.shape)} {out.dtype}, w_pack {tuple(w_pack.shape)} for d_r={cache.d_r}, d_v={d_v}")
    W = max(len(blocks) for blocks, _, _, _ in chunks)
    table = torch.full((len(chunks), W), -1, dtype=torch.long)
    spec = torch.empty(len(chunks), 3, dtype=torch.long)
    for i, (blocks, start, a, b) in enumerate(chunks):
        table[i, :len(blocks)] = torch.as_tensor(blocks, dtype=torch.long)
        spec[i, 0], spec[i, 1], spec[i, 2] = a, b - a, start
    q_nope, q_pe = q_nope.float().contiguous(), q_pe.float().contiguous()
    c, pe = cache.c, cache.pe
    amx_ok = amx and (cache.is_int8 or c.dtype == torch.bfloat16)
    rc = lib.mha_prefill_paged(q_nope.data_ptr(), q_pe.data_ptr(), H, d_n, cache.d_r, d_v, cache.C,
                               c.data_ptr(), _dtype(c, "the cache latent"), *_strides(c, cache.nz),
                               pe.data_ptr(), _dtype(pe, "the cache k_pe"), *_strides(pe, cache.nz),
                               cache.block_size, cache.num_blocks, len(chunks), spec.data_ptr(), table.data_ptr(), W,
                               w_pack.data_ptr(), cache.scale_value if cache.is_int8 else 1.0, softmax_scale,
                               int(amx_ok), out.data_ptr())
    if rc == 1:
        raise MemoryError("native MHA prefill: out of memory")
    if rc:
        raise ValueError("native MHA prefill: " + ("a chunk does not fit its blocks" if rc == 2 else
                                                    f"a block outside the cache's {cache.num_blocks}"))


def kv_weights(w_uk: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
    """[W_UK^T | W_UV^T]: [H, C, d_n + d_v] float32, contiguous (one decompression product per chunk)."""
    return torch.cat([w_uk.transpose(1, 2), w_uv_t], dim=2).float().contiguous()


def mha_prefill_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: PagedLatentCache, blocks,
                          start: int, w_uk: torch.Tensor, w_uv_t: torch.Tensor, softmax_scale: float,
                          w_kv: torch.Tensor | None = None) -> torch.Tensor:
    """``q_nope`` [S, H, d_n], ``q_pe`` [S, H, d_r] (float32) of S tokens at positions ``start ..`` whose
    latents are in the cache; ``w_uk`` [H, d_n, C], ``w_uv_t`` [H, C, d_v] float32 (``w_kv``: their
    :func:`kv_weights`, when the caller keeps it). Returns o [S, H, d_v]."""
    S, H, d_n = q_nope.shape
    T = start + S
    ids = _blocks_of(blocks, cache, T, "mha_prefill_attention")
    c, pe = cache.read_f32(ids, T)                                   # [T, C], [T, d_r]
    if cache.is_int8:
        c = c.mul_(cache.scale_value)
    # per head (a batched product over heads: a rank holding H / tp heads computes each the same way)
    w_kv = kv_weights(w_uk, w_uv_t) if w_kv is None else w_kv
    k_nope, v = torch.matmul(c, w_kv).split([d_n, w_kv.shape[2] - d_n], dim=-1)   # [H, T, d_n], [H, T, d_v]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)                           # [H, S, d_n + d_r]
    k = torch.cat([k_nope, pe.unsqueeze(0).expand(H, T, pe.shape[1])], dim=-1)
    if H * S * T <= WHOLE_SCORES_MAX:
        scores = torch.baddbmm(torch.empty(H, S, T, device=q.device), q, k.transpose(1, 2), beta=0,
                               alpha=softmax_scale)
        scores.masked_fill_(~causal_mask(S, T, start, q.device), float("-inf"))     # key 0 is always visible
        return torch.bmm(torch.softmax(scores, dim=-1), v).transpose(0, 1)        # [S, H, d_v]
    d_v, d_qk = v.shape[-1], q.shape[-1]
    if d_v < d_qk:
        v = F.pad(v, (0, d_qk - d_v))
    mask = None if start == 0 else causal_mask(S, T, start, q.device)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=start == 0,
                                       scale=softmax_scale)[0, ..., :d_v]
    return o.transpose(0, 1)                                                        # [S, H, d_v]
