"""The engine's float work besides attention and the int8 linears as C kernels on the CPU
(csrc/float_ops_cpu.c), swapped in by :func:`pipeline.engine.layers.native_swap.use_native_float_ops` where the
kernels backend is ``native``:

- :class:`NativeLinear` (alias ``NativeHeadLinear``) for the lm_head (and the MTP layer's ``shared_head.head``)
  of any model, and for every other bias-free float linear (a float model's attention projections,
  kv_b_proj, o_proj, the MTP layer's eh_proj; a quantized model's float MTP layer's linears too: torch's
  GEMM on an AVX-512 CPU gives a row other bits for another row count, which made a prefix-cache hit's
  MTP cache entries differ from the prompt's own; a float model's dense MLP and MoE linears run inside
  cpu_float_ffn's C calls): a float32 ``nn.Linear``
  whose weight is exactly a bf16 tensor widened (the checkpoint's bf16 values; checked) keeps that weight
  and its bf16 bits packed (half the bytes read per decode GEMV) and computes ``x @ W.T`` in float32 from
  them for up to LINEAR_C_ROWS rows: the bf16 -> float32 shift is exact, so the products are the float32
  model's; only the sum's order differs from torch's GEMM (outputs agree within float32 rounding of that
  order; a row's result never depends on the other rows of the call). On a CPU with AMX, every call with
  k a multiple of 32 runs on the tiles (csrc/bf16_gemm.h: x split into three bf16 pieces that sum to it
  exactly, the same exact products): 2-2.5x the FMA chains' speed from 4 rows up (benchmarks/cpu_float.json),
  as fast at one row.
- :class:`NativeRMSNorm` for every ``RMSNorm``: one C call, the same formula and casts (x and weight float32
  or bf16); the sum of squares in another order.
- :class:`pipeline.engine.native.cpu_float_ffn.NativeFloatMoE` for every MoE of a float model (its routed and
  shared experts in one C call) and ``NativeFloatMLP`` for its dense MLPs (see there).
- :class:`NativeRouter` for every MoE's ``gate``: ``Router.forward``'s weights and expert ids in one call
  (the expert order is torch.topk's, descending biased score; ties, which torch leaves unspecified, go to
  the lower index), from the logits of torch's F.linear (Router.forward's own op: a row's logits never
  depend on the call's other rows); C's ``expf`` can move a score by an ulp.

Each module falls back to its torch formula for inputs the C code does not take (another dtype or
device). The library is built on first use (pipeline.cbuild); without it (no compiler, ``DSQUANT_NATIVE=0``
or ``DSQUANT_NATIVE_FLOAT=0``) nothing is swapped and the torch modules run (:func:`status`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.cbuild import EXACT_FLAGS, NativeLibrary
from pipeline.engine.native.bf16_pack import bf16_representable, pack_bf16, packed_shape, unpack_bf16
from pipeline.model.ffn import Router
from pipeline.model.norm import RMSNorm
from pipeline.model.rope import apply_rope

CSRC = Path(__file__).with_name("csrc")
SWITCH = "DSQUANT_NATIVE_FLOAT"             # 0: none of these swaps (the other native kernels stay on)
_DT = {torch.bfloat16: 1, torch.float32: 3}   # csrc/dtypes.h
_ERRORS = {1: "out of memory", 2: "bad sizes"}
#: The linears: above LINEAR_C_ROWS rows F.linear over the
#: float32 weight (the same products; MKL's blocked GEMM). On the embedded model's shapes the C kernel is
#: no slower than MKL up to 512 rows and a little slower at 1024 (the FMA chains; the AMX tiles are faster
#: than those at every size from 4 rows): benchmarks/cpu_float.json. 2048 is a served
#: engine's max_batched_tokens (actors.serving.serve_config.DEFAULT_ENGINE; the engine's own default is 256), so
#: every step's rows take the C path (a row's result then never depends on the step it was computed in:
#: prefill and decode, prefix-cache hits and recomputed entries agree), at that cost for big prefills.
LINEAR_C_ROWS = 2048


def _declare(dll: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    dll.bf16_linear.argtypes = [p, i64, i64, i64, p, i64, p]
    dll.bf16_linear_has_amx.argtypes = []
    dll.rms_norm.argtypes = [p, i32, i64, i64, i64, p, i32, f32, p, i32]
    dll.moe_router.argtypes = [p, i64, i64, p, i64, i64, i64, i32, f32, p, p]
    dll.rope.argtypes = [p, i32, i64, i64, i64, i64, i64, p, p, p]
    dll.argmax_rows.argtypes = [p, i64, i64, i64, p]
    for f in (dll.bf16_linear, dll.bf16_linear_has_amx, dll.rms_norm, dll.moe_router, dll.rope, dll.argmax_rows):
        f.restype = i32


_LIB = NativeLibrary(CSRC / "float_ops_cpu.c", _declare, EXACT_FLAGS, switch=SWITCH,
                     what="native float linears / RMSNorm / router (torch ops give the same within float32 rounding)")


def library() -> Optional[ctypes.CDLL]:
    return _LIB.library()


def status() -> str:
    return f"float ops: {_LIB.status()}"


def set_threads(n: int) -> int:
    """Threads for the bf16 linears' pool (csrc/pool.h: column tasks; the bits do not depend on it), the caller
    included; returns the count set (1 when the library is not built)."""
    return _LIB.set_threads(n)


def reset() -> None:
    _LIB.reset()


def _check(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"native {what}: {_ERRORS.get(rc, f'error {rc}')}")


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x [..., k] -> (x or a contiguous copy, rows, row stride in elements): no copy when the last dim is
    contiguous and the rows are evenly spaced (e.g. a column slice of a wider output)."""
    k = x.shape[-1]
    if x.stride(-1) == 1 or k == 1:
        rows, stride = 1, None
        for size, st in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
            if size == 1:
                continue
            if stride is None:
                rows, stride = size, st
            elif st == stride * rows:
                rows *= size
            else:
                break
        else:
            if stride is None or stride >= k:
                return x, rows, k if stride is None else stride
    x = x.contiguous()
    return x, x.numel() // max(k, 1), k


def _cpu(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in ts)


def _autograd(*ts: torch.Tensor) -> bool:
    """Whether autograd would record the op (then the torch formula runs: the C code has no backward)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


class NativeLinear(nn.Linear):
    """Drop-in for a bias-free ``nn.Linear`` with a float32 weight [n, k] of bf16 values: the same
    ``weight`` parameter (same state dict), plus its bf16 bits packed for the C GEMM (bf16_pack: half the
    bytes; re-packed when the weight changes, in place or replaced). forward: float32 x [..., k] on the CPU
    with at most LINEAR_C_ROWS rows -> x @ W.T in C (float32 accumulation, csrc/bf16_gemm.h); anything else
    (more rows, another dtype or device, autograd, torch.compile tracing, a weight no longer of bf16
    values) -> F.linear with the float32 weight, nn.Linear's own op.

    :meth:`compact` (what an engine's loader does: native_swap.use_kernels) makes the packed bits the only
    copy, 2 bytes a value instead of 4 + 2: the ``weight`` parameter is released and ``weight`` reads it
    back from the bits on each access (float32, a new tensor, exactly the values it held: the torch
    path's F.linear and ``state_dict()`` then pay that widening, the C path never does); loading a state
    dict, assigning a weight or ``.to()`` make the module a plain one again."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        w = linear.weight
        if linear.bias is not None or w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"{type(self).__name__}: a bias-free linear whose weight is float32 on the CPU is "
                             f"needed (weight {w.dtype} {tuple(w.shape)} on {w.device}, bias {linear.bias is not None})")
        self.weight = w
        self._start(w, pack_bf16(w, f"{type(self).__name__} weight"))    # ValueError: not bf16 values

    @classmethod
    def from_bf16(cls, weight: torch.Tensor, name: str = "weight") -> "NativeLinear":
        """A compact module (:meth:`compact`) of the bf16 [n, k] ``weight`` (a checkpoint's, as read): its bits
        packed straight from it, never widened to float32; the same module as NativeLinear of the widened
        weight, compacted."""
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"{name}: a bf16 weight is needed, got {weight.dtype}")
        return cls.from_bits(pack_bf16(weight, name), weight.shape)

    @classmethod
    def from_bits(cls, bits: torch.Tensor, shape: tuple[int, int]) -> "NativeLinear":
        """A compact module (:meth:`compact`) of the [n, k] weight ``shape`` whose packed bf16 bits are
        ``bits`` (bf16_pack's layout, held as given: e.g. a view into a stack of experts' packs)."""
        if tuple(bits.shape) != packed_shape(*shape) or bits.dtype != torch.int32 or not bits.is_contiguous():
            raise ValueError(f"NativeLinear: bits for {list(shape)} are int32 {list(packed_shape(*shape))}, "
                             f"got {bits.dtype} {list(bits.shape)}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod._start(None, bits, torch.Size(shape))
        mod.__dict__["_compact"] = True
        return mod

    def _start(self, w: Optional[torch.Tensor], bits: torch.Tensor, shape: Optional[torch.Size] = None) -> None:
        self.out_features, self.in_features = w.shape if w is not None else shape
        self.register_parameter("bias", None)
        self._packed = (w, None if w is None else w._version, bits)
        self.register_state_dict_post_hook(_with_weight)
        self.register_load_state_dict_pre_hook(_loading)

    def __getattr__(self, name: str):
        if name == "weight" and self.__dict__.get("_compact"):
            return unpack_bf16(self._packed[2], self.out_features, self.in_features)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":                    # a weight assigned: a plain module again
            self.__dict__.pop("_compact", None)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        self.expand()                           # .to(), .float(), ...: on the float32 parameter
        return super()._apply(fn, recurse)

    def is_compact(self) -> bool:
        return bool(self.__dict__.get("_compact"))

    def compact(self) -> bool:
        """Keep the packed bits as the only copy of the weight (class docstring); False (nothing done) where
        the weight holds other values than bf16's (then there are no bits to keep)."""
        if self.is_compact():
            return True
        if self.packed() is None:
            return False
        del self._parameters["weight"]
        self._packed = (None, None, self._packed[2])
        self.__dict__["_compact"] = True
        return True

    def expand(self) -> None:
        """A compact module's weight back as its float32 parameter (a plain module again)."""
        if self.is_compact():
            self.weight = nn.Parameter(self.weight, requires_grad=False)
            self._packed = (self._parameters["weight"], self._parameters["weight"]._version, self._packed[2])

    def packed(self) -> Optional[torch.Tensor]:
        """The weight's packed bf16 bits, None when it holds other values (then forward is F.linear)."""
        src, version, bits = self._packed
        if self.is_compact():
            return bits
        w = self.weight
        if src is not w or version != w._version:
            wd = w.detach()
            ok = wd.dtype == torch.float32 and wd.device.type == "cpu" and bf16_representable(wd)
            bits = pack_bf16(wd) if ok else None
            self._packed = (w, w._version, bits)
        return bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, w = self.in_features, self._parameters.get("weight")     # (None when compact: no gradient)
        if x.dtype != torch.float32 or not x.is_cpu or x.shape[-1] != k or torch.compiler.is_compiling() \
                or (torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad))):
            return F.linear(x, self.weight)
        if x.is_contiguous():
            m, ldx = x.numel() // k, k
        else:
            x, m, ldx = _rows(x)
        bits = self.packed() if m <= LINEAR_C_ROWS else None
        lib = _LIB.loaded() if bits is not None else None
        if lib is None:
            return F.linear(x, self.weight)
        out = torch.empty(x.shape[:-1] + (self.out_features,), dtype=torch.float32)
        if m:
            _check(lib.bf16_linear(*self.call_args(x, m, ldx, bits, out)), "linear")
        return out

    def call_args(self, x: torch.Tensor, m: int, ldx: int, bits: torch.Tensor, out: torch.Tensor) -> tuple:
        """``bf16_linear``'s arguments for float32 rows ``x`` (m of them, row stride ldx) into ``out``."""
        return x.data_ptr(), m, self.in_features, ldx, bits.data_ptr(), self.out_features, out.data_ptr()

    def bind(self, x: torch.Tensor, out: torch.Tensor) -> Optional[tuple]:
        """(C function, arguments, the packed weight to hold) computing forward(x) into ``out`` (contiguous
        float32, x's rows) as forward would, for the tensors' current storage (pipeline.engine.worker.decode_graph);
        None where forward would not run the C kernel on x as it is."""
        if x.dtype != torch.float32 or not x.is_cpu or x.shape[-1] != self.in_features or x.stride(-1) != 1:
            return None
        x2, m, ldx = _rows(x)
        bits = self.packed() if m <= LINEAR_C_ROWS and x2 is x else None
        lib = _LIB.loaded() if bits is not None else None
        if lib is None or out.dtype != torch.float32 or not out.is_contiguous() \
                or out.shape != x.shape[:-1] + (self.out_features,):
            return None
        return lib.bf16_linear, self.call_args(x, m, ldx, bits, out), (bits,)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False, C=bf16 bits"


def _with_weight(module: NativeLinear, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post hook: a compact module's weight, read back from its packed bits."""
    if module.is_compact():
        state_dict[prefix + "weight"] = module.weight


def _loading(module: NativeLinear, state_dict, prefix: str, *args) -> None:
    """load_state_dict pre hook: a compact module loads into its weight parameter like any other."""
    module.expand()


#: The lm_head's former name (the same module: every bias-free bf16-valued float linear).
NativeHeadLinear = NativeLinear


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``pipeline.model.rope.apply_rope`` in one C call, the same bits: x [..., S, (heads,) d] float32 or bf16
    (any strides that give evenly spaced rows and heads, e.g. the q_pe part of q), cos / sin [..., S, d/2]
    float32 of x's leading shape; anything else goes to apply_rope."""
    lib = _LIB.loaded()
    if not _rope_takes(lib, x, cos, sin) or _autograd(x) or torch.compiler.is_compiling():
        return apply_rope(x, cos, sin)
    heads, d = x.shape[-2] if x.dim() == cos.dim() + 1 else 1, x.shape[-1]
    try:
        xs = x.view(-1, heads, d)
    except RuntimeError:                        # leading dims not evenly spaced: a copy that is
        xs = x.reshape(-1, heads, d)
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    if xs.shape[0]:
        _check(lib.rope(*_rope_args(x, xs, cos, sin, out)), "rope")
    return out


def _rope_takes(lib, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the C rope takes x / cos / sin (rope's and bind_rope's condition, autograd and tracing apart)."""
    lead = x.shape[:-2] if x.dim() == cos.dim() + 1 else x.shape[:-1]
    return lib is not None and x.dtype in _DT and cos.dtype == torch.float32 and sin.dtype == torch.float32 \
        and _cpu(x, cos, sin) and not x.shape[-1] % 2 and cos.shape == lead + (x.shape[-1] // 2,) \
        and sin.shape == cos.shape and x.stride(-1) == 1


def _rope_args(x: torch.Tensor, xs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> tuple:
    return (xs.data_ptr(), _DT[x.dtype], xs.shape[0], xs.shape[1], xs.stride(0), xs.stride(1), x.shape[-1],
            cos.data_ptr(), sin.data_ptr(), out.data_ptr())


def bind_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> Optional[tuple]:
    """(C function, arguments, tensors to hold) computing rope(x, cos, sin) into ``out`` (contiguous, x's
    shape and dtype) for the tensors' current storage; None where :func:`rope` would not call C (or would
    copy x first)."""
    lib = _LIB.loaded()
    if not _rope_takes(lib, x, cos, sin) or not (cos.is_contiguous() and sin.is_contiguous() and out.is_contiguous()) \
            or out.shape != x.shape or out.dtype != x.dtype:
        return None
    try:
        xs = x.view(-1, x.shape[-2] if x.dim() == cos.dim() + 1 else 1, x.shape[-1])
    except RuntimeError:
        return None
    return lib.rope, _rope_args(x, xs, cos, sin, out), ()


def argmax_rows(x: torch.Tensor, native: bool = True) -> list[int]:
    """``x.argmax(-1).tolist()`` of float32 rows x [R, V] (the greedy rows' logits) in one C call: the first
    index of each row's maximum, a NaN counting as the maximum (torch's argmax); anything else, without
    the library, or not ``native`` (the engine's float ops are torch's), torch's argmax itself."""
    lib = _LIB.loaded() if native else None
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu or x.shape[1] < 1 \
            or x.stride(1) != 1 or torch.compiler.is_compiling():
        return x.argmax(-1).tolist()
    out = (ctypes.c_int64 * x.shape[0])()
    _check(lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out), "argmax")
    return list(out)


class NativeRMSNorm(RMSNorm):
    """RMSNorm (same parameters, same state dict) computed in one C call: r = 1/sqrt(sum x^2 / dim + eps)
    in float32, y = weight * (x * r).to(x.dtype) in torch's promoted dtype (bf16 rounded to nearest even)."""

    def __init__(self, norm: RMSNorm):
        nn.Module.__init__(self)
        self.weight, self.eps = norm.weight, norm.eps
        self.register_parameter("bias", norm.bias)      # a biased norm is never swapped; kept for the torch path

    def _takes(self, lib, x: torch.Tensor) -> bool:
        """Whether the C call takes x (forward's and bind's condition, autograd apart)."""
        w = self.weight
        return lib is not None and self.bias is None and x.dtype in _DT and w.dtype in _DT and _cpu(x, w) \
            and w.dim() == 1 \
            and x.dim() > 0 and x.shape[-1] == w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib, w = _LIB.loaded(), self.weight
        if not self._takes(lib, x) or _autograd(x, w):
            return super().forward(x)
        out_dtype = torch.promote_types(x.dtype, w.dtype)
        shape = x.shape
        x, rows, ldx = _rows(x)
        w = w.detach().contiguous()
        out = torch.empty(shape, dtype=out_dtype)
        if rows:
            _check(lib.rms_norm(*self._args(x, rows, shape[-1], ldx, w, out)), "RMSNorm")
        return out

    def _args(self, x, rows: int, dim: int, ldx: int, w: torch.Tensor, out: torch.Tensor) -> tuple:
        return (x.data_ptr(), _DT[x.dtype], rows, dim, ldx, w.data_ptr(), _DT[w.dtype], self.eps, out.data_ptr(),
                _DT[out.dtype])

    def bind(self, x: torch.Tensor, out: torch.Tensor) -> Optional[tuple]:
        """(C function, arguments, the weight held) computing forward(x) into ``out`` (contiguous, x's
        shape, the promoted dtype) for the tensors' current storage; None where forward would not call C
        on x as it is (pipeline.engine.worker.decode_graph)."""
        lib, w = _LIB.loaded(), self.weight
        if not self._takes(lib, x) or not out.is_contiguous() or out.shape != x.shape \
                or out.dtype != torch.promote_types(x.dtype, w.dtype):
            return None
        x2, rows, ldx = _rows(x)
        if x2 is not x:
            return None
        w = w.detach().contiguous()
        return lib.rms_norm, self._args(x, rows, x.shape[-1], ldx, w, out), (w,)


class NativeRouter(Router):
    """Router (same parameters and buffer, same state dict) whose forward is one C call (module docstring):
    x [N, hidden] float32 or bf16, weight float32 or bf16 -> (weights [N, top_k] float32, ids int64)."""

    def __init__(self, router: Router):
        nn.Module.__init__(self)
        self.weight = router.weight
        self.register_buffer("e_score_correction_bias", router.e_score_correction_bias)
        for a in ("n_group", "topk_group", "top_k", "norm_topk_prob", "scaling"):
            setattr(self, a, getattr(router, a))
        E = self.weight.shape[0]
        gs = E // self.n_group if self.n_group else 0
        if not (self.n_group >= 1 and E % self.n_group == 0 and gs >= 2 and 1 <= self.topk_group <= self.n_group
                and 1 <= self.top_k <= self.topk_group * gs):
            raise ValueError(f"NativeRouter: n_group={self.n_group}, topk_group={self.topk_group}, top_k="
                             f"{self.top_k} do not fit {E} experts (groups of >= 2, top_k within the kept groups)")

    def _takes(self, lib, x: torch.Tensor) -> bool:
        """Whether the C call takes x (forward's and bind's condition, autograd apart)."""
        w = self.weight
        return lib is not None and x.dtype in _DT and w.dtype in _DT and _cpu(x, w, self.e_score_correction_bias) \
            and x.dim() == 2 and x.shape[1] == w.shape[1]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lib, w, b = _LIB.loaded(), self.weight, self.e_score_correction_bias
        if not self._takes(lib, x) or _autograd(x, w):
            return super().forward(x)
        n = x.shape[0]
        weights = torch.empty(n, self.top_k, dtype=torch.float32)
        idx = torch.empty(n, self.top_k, dtype=torch.int64)
        if n:
            _check(self._route(lib, x, w.detach().float(), b.detach().float().contiguous(), weights, idx), "router")
        return weights, idx

    def _route(self, lib, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, weights: torch.Tensor,
               idx: torch.Tensor) -> int:
        logits = F.linear(x.float(), w).contiguous()      # Router.forward's own op
        return lib.moe_router(logits.data_ptr(), x.shape[0], w.shape[0], b.data_ptr(), self.n_group,
                              self.topk_group, self.top_k, int(bool(self.norm_topk_prob)), self.scaling,
                              weights.data_ptr(), idx.data_ptr())

    def bind(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> Optional[tuple]:
        """(a function returning the C call's status, no arguments, tensors to hold) routing ``x`` [N, hidden]
        into ``weights`` float32 / ``idx`` int64 [N, top_k] (contiguous) as forward does; None where forward
        would not call C."""
        lib, w, b = _LIB.loaded(), self.weight, self.e_score_correction_bias
        if not self._takes(lib, x) or weights.shape != (x.shape[0], self.top_k) or idx.shape != weights.shape \
                or weights.dtype != torch.float32 or idx.dtype != torch.int64 \
                or not (weights.is_contiguous() and idx.is_contiguous()):
            return None
        w, b = w.detach().float(), b.detach().float().contiguous()
        return (lambda: self._route(lib, x, w, b, weights, idx)), (), (w, b)
