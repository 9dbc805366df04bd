"""The engine's int8 linears on the CPU in one C call each (csrc/int8_linear_cpu.c): quantize the rows,
multiply in int32, apply the epilogue, write the output in x's dtype.

The arithmetic is :mod:`pipeline.engine.layers.qlinear`'s op for op (the C file's header lists it): the same
float32 divisions, additions and round-half-even for the activations, the exact int32 product, the same
float64 (``exact``) or float32 (``fast``) epilogue in the same order, the bias added in float32, bf16
rounded to nearest even from the float32 value as ``Tensor.to(torch.bfloat16)`` does; built without FMA
contraction (:data:`pipeline.cbuild.EXACT_FLAGS`). So the output equals the torch path's bit for bit,
for both kinds and both epilogues (the tests check it).

Each linear's weight is packed once (:class:`Packed`: the VNNI layout, 128 * row sums, float32 copies of
the scales), on first use, and again after ``load_state_dict``, a buffer assigned, ``.to()`` / ``.float()``
(the module drops its copy: :func:`drop`) or an in-place change of the weight (its version is compared on
each call); an in-place edit of a scale tensor outside ``load_state_dict`` needs :func:`drop`. A call then
costs a shape/dtype check, one output allocation and the ctypes call, against ~12 torch ops on the torch
path.

The packed copy holds the weight a second time (int8, n rounded up to 64 columns) unless the module is
made *compact* (:func:`compact`, what an engine's loader does): then the pack is the only copy, the
module's ``weight`` buffer is None, and the torch path, ``state_dict()`` and :func:`drop` read the weight
back from the pack (:func:`unpack`: the layout is a permutation of the integers, so they come back
exactly).

The int32 product runs on AVX-512 VNNI (4-row register tiles), or, for calls of 32 rows or more on a CPU
with AMX that the kernel lets use it, on the AMX tiles (tdpbusd, the same u8 x s8 sums: the same int32
bits); the quantization and the epilogue run 16 lanes at a time with the scalar code's operations
(benchmarks/cpu_linear.json).

Which path runs is the module's ``native`` (chosen when it is built: the kernels backend ``native``, the
library built, ``DSQUANT_NATIVE_LINEAR`` not ``0``: pipeline.engine.config) and, for ``kernel="auto"``,
the batch.

Threads: a call splits its work over the library's pool of threads (csrc/pool.h): the output columns in
panels of 64 (each panel's products and epilogue are the same operations whichever thread runs it, so the
bits do not depend on the thread count), the rows' quantization in groups of rows. The pool has
:func:`threads` threads, the caller included: 1 until :func:`set_threads`; an engine's runner keeps it at
torch's intra-op thread count (:func:`follow_torch`), so ``--torch-threads N`` gives the kernels N cores.
At DeepSeek's width a decode step's linears stream hundreds of MB of weights, and one core reaches about
half of the memory's read bandwidth (benchmarks/real_width.json). With the pool as wide as torch's threads
the C kernel takes every batch; with more torch threads than pool threads ``_int_mm`` (oneDNN) catches up
once a call holds about 2^24 multiply-adds, so ``kernel="auto"`` then gives the C kernel at most
:func:`max_rows` rows: 64, fewer for wide weights, 8 at least.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from pipeline.cbuild import EXACT_FLAGS, NativeLibrary
from pipeline.engine.native import hugepages
from pipeline.format.description import W8A8

SOURCE = Path(__file__).with_name("csrc") / "int8_linear_cpu.c"
#: With several torch threads, ``kernel="auto"`` uses the C kernel for at most max_rows(k, n) rows
#: (module docstring): MAX_ROWS, fewer for wide weights (MAX_MACS per call), MIN_ROWS at least.
MAX_ROWS, MIN_ROWS, MAX_MACS = 64, 8, 2 ** 24
PANEL_COLS, K_STEP = 64, 4                 # the packed layout's padding of n and k
MAX_K = (2 ** 31 - 1) // (128 * 128)       # 131071: the int32 product is exact (see the C header)
DTYPES = {torch.float32: 3, torch.bfloat16: 1}   # csrc/dtypes.h's codes
STATIC, DYNAMIC = 0, 1
EPILOGUES = {"exact": 0, "fast": 1}

p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class LinearParams(ctypes.Structure):
    """csrc/int8_linear_cpu.c's ``linear_t``."""
    _fields_ = [("n", i64), ("k", i64), ("np", i64), ("kp", i64), ("wpack", p), ("wsum", p),
                ("kind", i32), ("epilogue", i32), ("in_scale", f32), ("in_offset", f32),
                ("quant_bias", p), ("deq", p), ("wscale", p), ("bias", p)]


def _declare(dll: ctypes.CDLL) -> None:
    dll.native_has_vnni.argtypes, dll.native_has_vnni.restype = [], ctypes.c_int
    dll.native_has_amx.argtypes, dll.native_has_amx.restype = [], ctypes.c_int
    dll.int8_pack.argtypes, dll.int8_pack.restype = [p, i64, i64, i64, i64, p, p], None
    dll.int8_linear.argtypes, dll.int8_linear.restype = [p, p, i64, i64, i32, p], ctypes.c_int
    dll.int8_linear_q.argtypes, dll.int8_linear_q.restype = [p, p, p, i64, p], ctypes.c_int
    moe = [p, p, i32, i64, i64, p, p, p]
    dll.moe_gate_up.argtypes, dll.moe_gate_up.restype = moe + [p], ctypes.c_int
    dll.moe_down.argtypes, dll.moe_down.restype = moe + [p], ctypes.c_int


_LIB = NativeLibrary(SOURCE, _declare, EXACT_FLAGS, switch="DSQUANT_NATIVE_LINEAR",
                     what="native int8 linear kernel (torch ops give the same bits)")


def library() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None (the reason in :func:`status`); reads the switches (a decision point)."""
    return _LIB.library()


def status() -> str:
    """``native (<path>, vnni=..., amx=...)`` or ``torch ops (<why>)``, for logs and benchmark records."""
    lib = _LIB.library()
    if lib is None:
        return _LIB.status()
    return f"{_LIB.status()[:-1]}, vnni={bool(lib.native_has_vnni())}, amx={bool(lib.native_has_amx())})"


def max_rows(k: int, n: int) -> int:
    """The most rows ``kernel="auto"`` gives the C kernel when torch runs several threads."""
    return max(MIN_ROWS, min(MAX_ROWS, MAX_MACS // max(1, k * n)))


def loaded() -> Optional[ctypes.CDLL]:
    """The library for a module that chose it when it was built (no switch read)."""
    return _LIB.loaded()


def reset() -> None:
    """Forget the loaded library (tests that flip the switch variables)."""
    _LIB.reset()


def set_threads(n: int) -> int:
    """Threads for the kernels' pool, the caller included (1 .. 256); returns the count set (1 when the
    library is not built)."""
    return _LIB.set_threads(n)


def threads() -> int:
    """The pool's thread count (module docstring)."""
    return _LIB.threads()


def follow_torch() -> int:
    """The pools as wide as torch's intra-op threads now: this library's, the decode attention's and the bf16
    linears' (an engine's runner calls it once per step)."""
    n = torch.get_num_threads()
    if n != _LIB.threads():
        from pipeline.engine.native import cpu_attention, cpu_float

        cpu_attention.set_threads(n)
        cpu_float.set_threads(n)
        set_threads(n)
    return n


def padded(n: int, k: int) -> tuple[int, int]:
    return -(-n // PANEL_COLS) * PANEL_COLS, -(-k // K_STEP) * K_STEP


def pack_weight(w: torch.Tensor, pack: Optional[torch.Tensor] = None,
                wsum: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [n, k] -> (packed int8 [np * kp], 128 * row sums int32 [np]) in the C kernel's layout, into
    ``pack`` / ``wsum`` where given (contiguous, of those sizes: a slice of a stacked buffer), else into new
    tensors (the pack huge-page backed: :mod:`pipeline.engine.native.hugepages`)."""
    lib = _LIB.loaded()
    if lib is None:
        raise RuntimeError(f"pack_weight: {status()}")
    w = w.contiguous()
    n, k = w.shape
    np_, kp = padded(n, k)
    pack = hugepages.empty(np_ * kp, torch.int8) if pack is None else pack
    wsum = torch.empty(np_, dtype=torch.int32) if wsum is None else wsum
    if pack.numel() != np_ * kp or wsum.numel() != np_ or not (pack.is_contiguous() and wsum.is_contiguous()):
        raise ValueError(f"pack_weight: buffers of {np_ * kp} int8 and {np_} int32 needed for [{n}, {k}]")
    lib.int8_pack(w.data_ptr(), n, k, np_, kp, pack.data_ptr(), wsum.data_ptr())
    return pack, wsum


def unpack(pack: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 weight [n, k] that :func:`pack_weight` packed into ``pack`` (a new tensor; exact): the
    layout is blocks of 16 output columns, each k step of 4 inputs of those columns together
    (csrc/int8_linear_cpu.c's int8_pack)."""
    np_, kp = padded(n, k)
    return pack.view(np_ // 16, kp // K_STEP, 16, K_STEP).permute(0, 2, 1, 3).reshape(np_, kp)[:n, :k].contiguous()


def weight_of(mod) -> torch.Tensor:
    """``mod``'s int8 weight [n, k]: its buffer, or for a compact module the pack read back (a new tensor
    per call: the torch path of a compact module pays that; the C path never calls this)."""
    w = mod._buffers["weight"]
    if w is not None:
        return w
    pk = mod.__dict__.get("_native_packed")
    if pk is None:
        raise RuntimeError(f"{mod.name}: neither a weight nor its packed copy")
    return unpack(pk.pack, mod.out_features, mod.in_features)


def is_compact(mod) -> bool:
    return mod._buffers.get("weight") is None and "_native_packed" in mod.__dict__


def compact(mod, pk: Optional["Packed"] = None) -> None:
    """Make the packed copy ``mod``'s only copy of its weight (module docstring): pack it now (or take
    ``pk``, packed into a slice of a stacked buffer) and release the module's int8 buffer."""
    if is_compact(mod):
        return
    pk = pk or packed(mod)
    pk.weight = pk.version = None
    mod.__dict__["_native_packed"] = pk
    mod._buffers["weight"] = None            # (not through __setattr__: that drops the pack)


def drop(mod, *hook_args) -> None:
    """Forget ``mod``'s packed copy (the next call repacks): Int8Linear calls it when a buffer is assigned,
    on ``.to()`` / ``.float()`` (``_apply``) and after ``load_state_dict`` (a post hook). A compact module
    first gets its weight back from the pack."""
    if is_compact(mod):
        mod._buffers["weight"] = weight_of(mod)
    mod.__dict__.pop("_native_packed", None)


class Packed:
    """A linear's packed weight and float32 scales and the ``LinearParams`` pointing at them; packed into
    ``pack`` / ``wsum`` when given (slices of a stacked buffer: cpu_moe), else into new tensors."""

    def __init__(self, mod, pack: Optional[torch.Tensor] = None, wsum: Optional[torch.Tensor] = None):
        w = weight_of(mod)
        self.weight = mod._buffers["weight"]          # held: its identity and version are the key
        self.version = None if self.weight is None else self.weight._version
        n, k = mod.out_features, mod.in_features
        self.pack, self.wsum = pack_weight(w, pack, wsum)
        prm = LinearParams(n=n, k=k, wpack=self.pack.data_ptr(), wsum=self.wsum.data_ptr(),
                           epilogue=EPILOGUES[mod.epilogue])
        prm.np, prm.kp = padded(n, k)
        self.keep: list[torch.Tensor] = []
        if mod.kind == W8A8:                           # qlinear.W8A8StaticLinear (not imported: it imports us)
            prm.kind = STATIC
            prm.in_scale = float(mod.input_scale.float().reshape(()))
            prm.in_offset = float(mod.input_offset.float().reshape(()))
            prm.quant_bias = self._hold(mod.quant_bias.to(torch.int32))
            prm.deq = self._hold(mod.deq_float32().float())
        else:
            prm.kind = DYNAMIC
            prm.wscale = self._hold(mod.weight_scale.float().reshape(-1))
            prm.bias = self._hold(mod.bias.float()) if mod.bias is not None else None
        self.params = prm
        self.ref = ctypes.addressof(prm)

    def _hold(self, t: torch.Tensor) -> int:
        t = t.contiguous()
        self.keep.append(t)
        return t.data_ptr()


def packed(mod) -> Packed:
    """``mod``'s :class:`Packed`, made on first use, after :func:`drop` and when the weight tensor was
    replaced or changed in place (its version)."""
    pk = mod.__dict__.get("_native_packed")
    w = mod._buffers["weight"]
    if w is None and pk is not None:                  # compact: the pack is the weight
        return pk
    if pk is None or pk.weight is not w or pk.version != w._version:
        if not 0 < mod.in_features <= MAX_K:
            raise ValueError(f"{mod.name}: in_features {mod.in_features} outside 1 .. {MAX_K} for the C kernel")
        pk = mod.__dict__["_native_packed"] = Packed(mod)
    return pk


def _check(rc: int, what: str) -> None:
    if rc:
        raise MemoryError(f"{what}: the C kernel could not allocate its scratch")


def forward(mod, x: torch.Tensor) -> torch.Tensor:
    """The linear of float32 / bf16 ``x`` [..., k] (any strides): [..., n] in x's dtype, bias included:
    qlinear's ``forward``. A contiguous x is read in place, without a reshape."""
    pk, k = packed(mod), mod.in_features
    if x.is_contiguous():
        m, ldx, x2 = x.numel() // k, k, x
    else:
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m, ldx = x2.shape[0], x2.stride(0)
    y = torch.empty(x.shape[:-1] + (mod.out_features,), dtype=x.dtype)
    if m:
        _check(_LIB.loaded().int8_linear(pk.ref, x2.data_ptr(), m, ldx, DTYPES[x.dtype], y.data_ptr()), mod.name)
    return y


def bind(mod, x: torch.Tensor, out: torch.Tensor) -> Optional[tuple]:
    """(C function, arguments, the pack to hold) computing qlinear's forward of contiguous ``x`` [..., k]
    into ``out`` (contiguous, x's dtype, [..., n]) for the tensors' current storage
    (pipeline.engine.worker.decode_graph); None where that forward would not call this kernel."""
    if not x.is_contiguous() or not out.is_contiguous() or out.dtype != x.dtype \
            or out.shape != x.shape[:-1] + (mod.out_features,) or not mod._native(x):
        return None
    pk, k = packed(mod), mod.in_features
    return _LIB.loaded().int8_linear, (pk.ref, x.data_ptr(), x.numel() // k, k, DTYPES[x.dtype], out.data_ptr()), (pk,)


def apply_quantized(mod, x_q: torch.Tensor, s_tok: Optional[torch.Tensor]) -> torch.Tensor:
    """int8 rows ``x_q`` [m, k]: the exact product int32 [m, n] (``s_tok`` None: ``_acc``), or with the
    per-token scales float32 [m, 1] the dynamic epilogue, float32 [m, n] without bias (``apply_quantized``)."""
    pk = packed(mod)
    x_q = x_q.contiguous()
    m = x_q.shape[0]
    if s_tok is None:
        y, s_ptr = torch.empty(m, mod.out_features, dtype=torch.int32), None
    else:
        s_tok = s_tok.contiguous()
        if s_tok.dtype != torch.float32 or s_tok.numel() != m:
            raise ValueError(f"{mod.name}: s_tok must be float32 [{m}, 1], got {s_tok.dtype} {list(s_tok.shape)}")
        y, s_ptr = torch.empty(m, mod.out_features, dtype=torch.float32), s_tok.data_ptr()
    if m:
        _check(_LIB.loaded().int8_linear_q(pk.ref, x_q.data_ptr(), s_ptr, m, y.data_ptr()), mod.name)
    return y
