"""The engine's float work besides attention and the int8 linears as C kernels on the CPU
(csrc/float_ops_cpu.c), swapped in by :func:`use_native_float_ops` where the kernels backend is ``native``:

- :class:`NativeHeadLinear` for the lm_head (and the MTP layer's ``shared_head.head``): a bias-free float32
  ``nn.Linear`` whose weight is exactly a bf16 tensor widened (the checkpoint's bf16 values; checked) keeps
  only the bf16 bits (half the bytes: the decode GEMV is memory-bound) and computes ``x @ W.T`` in float32
  from them: the bf16 -> float32 shift is exact, so the products are the float32 model's; only the sum's
  order differs from torch's GEMM (logits agree within float32 rounding of that order).
- :class:`NativeRMSNorm` for every ``RMSNorm``: one C call, the same formula and casts (x and weight float32
  or bf16); the sum of squares in another order.
- :class:`NativeRouter` for every MoE's ``gate``: ``Router.forward``'s weights and expert ids in one call
  (the expert order is torch.topk's, descending biased score; ties, which torch leaves unspecified, go to
  the lower index). The logits' order of summation and C's ``expf`` can move a score by an ulp. (For
  more than ROUTER_C_ROWS rows the logits are torch's F.linear, the rest C.)

Each module falls back to its torch formula for inputs the C code does not take (another dtype or
device). The library is built on first use (pipeline.cbuild); without it (no compiler, ``DSQUANT_NATIVE=0``
or ``DSQUANT_NATIVE_FLOAT=0``) nothing is swapped and the torch modules run (:func:`status`).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.cbuild import EXACT_FLAGS, NativeLibrary
from pipeline.model.ffn import Router
from pipeline.model.norm import RMSNorm

CSRC = Path(__file__).with_name("csrc")
SWITCH = "DSQUANT_NATIVE_FLOAT"             # 0: none of these swaps (the other native kernels stay on)
_DT = {torch.bfloat16: 1, torch.float32: 3}   # csrc/dtypes.h
_ERRORS = {1: "out of memory", 2: "bad sizes"}
#: Above this many rows the router's logits come from torch's GEMM (F.linear, as Router.forward) and the
#: C call does the rest: the C logits read W once per 16 rows; measured (load ~5) at 256 x 7168 the C
#: logits win up to 16 rows, torch's from 32. The lm_head likewise: above HEAD_C_ROWS rows (a full-sequence
#: forward) F.linear over the widened weight (the same products; a blocked GEMM).
ROUTER_C_ROWS, HEAD_C_ROWS = 0, 128
log = logging.getLogger("dsquant.kernels")


def _declare(dll: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    dll.bf16_gemv.argtypes = [p, i64, i64, i64, p, i64, p]
    dll.rms_norm.argtypes = [p, i32, i64, i64, i64, p, i32, f32, p, i32]
    dll.moe_router.argtypes = [p, i32, i64, i64, i64, p, i32, i64, p, i64, i64, i64, i32, f32, p, p, p]
    for f in (dll.bf16_gemv, dll.rms_norm, dll.moe_router):
        f.restype = i32


_LIB = NativeLibrary(CSRC / "float_ops_cpu.c", _declare, EXACT_FLAGS, switch=SWITCH,
                     what="native lm_head / RMSNorm / router (torch ops give the same within float32 rounding)")


def library() -> Optional[ctypes.CDLL]:
    return _LIB.library()


def status() -> str:
    return f"float ops: {_LIB.status()}"


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


def bf16_representable(w: torch.Tensor) -> bool:
    """Whether a float32 tensor holds bf16 values only (widening its bf16 rounding gives it back)."""
    return w.dtype == torch.float32 and torch.equal(w.to(torch.bfloat16).float(), w)


class NativeHeadLinear(nn.Module):
    """Drop-in for a bias-free ``nn.Linear`` with a bf16-representable float32 weight [n, k], holding its
    bf16 bits only (``weight_bits``, int16: ``.to(dtype)`` leaves it alone). ``weight`` widens them on
    access (float32, exact; the state dict keeps the ``weight`` key). forward: float32 x [..., k] on the CPU
    -> x @ W.T in C (float32 accumulation); anything else: F.linear with the widened weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight
        if linear.bias is not None or w.dim() != 2 or not bf16_representable(w.detach()):
            raise ValueError("NativeHeadLinear: a bias-free linear whose weight is float32 holding bf16 values "
                             f"is needed (weight {w.dtype} {tuple(w.shape)}, bias {linear.bias is not None})")
        self.out_features, self.in_features = w.shape
        self.bias = None
        self.register_buffer("weight_bits", self._bits(w.detach()), persistent=False)

    @staticmethod
    def _bits(w: torch.Tensor) -> torch.Tensor:
        return w.to(torch.bfloat16).contiguous().view(torch.int16)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_bits.view(torch.bfloat16).float()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        w = state_dict.get(prefix + "weight")
        if w is None:
            missing.append(prefix + "weight")
        elif tuple(w.shape) != tuple(self.weight_bits.shape) or not bf16_representable(w.float()):
            errors.append(f"{prefix}weight: {tuple(w.shape)} {w.dtype}: a {tuple(self.weight_bits.shape)} weight "
                          "of bf16 values is needed")
        else:
            self.weight_bits = self._bits(w.float()).to(self.weight_bits.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = _LIB.library()
        bits = self.weight_bits
        if lib is None or x.dtype != torch.float32 or not _cpu(x, bits) or x.shape[-1] != self.in_features \
                or x.numel() > HEAD_C_ROWS * self.in_features:
            return F.linear(x, self.weight)
        x, m, ldx = _rows(x)
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
        if m:
            _check(lib.bf16_gemv(x.data_ptr(), m, self.in_features, ldx, bits.data_ptr(), self.out_features,
                                 out.data_ptr()), "lm_head")
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False, weight=bf16"


class NativeRMSNorm(RMSNorm):
    """RMSNorm (same parameters, same state dict) computed in one C call: r = 1/sqrt(sum x^2 / dim + eps)
    in float32, y = weight * (x * r).to(x.dtype) in torch's promoted dtype (bf16 rounded to nearest even)."""

    def __init__(self, norm: RMSNorm):
        nn.Module.__init__(self)
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib, w = _LIB.library(), self.weight
        if lib is None or x.dtype not in _DT or w.dtype not in _DT or not _cpu(x, w) or w.dim() != 1 \
                or x.dim() == 0 or x.shape[-1] != w.shape[0] or _autograd(x, w):
            return super().forward(x)
        out_dtype = torch.promote_types(x.dtype, w.dtype)
        shape = x.shape
        x, rows, ldx = _rows(x)
        w = w.detach().contiguous()
        out = torch.empty(shape, dtype=out_dtype)
        if rows:
            _check(lib.rms_norm(x.data_ptr(), _DT[x.dtype], rows, shape[-1], ldx, w.data_ptr(), _DT[w.dtype],
                                self.eps, out.data_ptr(), _DT[out_dtype]), "RMSNorm")
        return out


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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lib, w, b = _LIB.library(), self.weight, self.e_score_correction_bias
        if lib is None or x.dtype not in _DT or w.dtype not in _DT or not _cpu(x, w, b) or x.dim() != 2 \
                or x.shape[1] != w.shape[1] or _autograd(x, w):
            return super().forward(x)
        x, n, ldx = _rows(x)
        w, b = w.detach().contiguous(), b.detach().float().contiguous()
        # many rows: the logits by torch's GEMM (Router.forward's own op), the rest in C
        logits = F.linear(x.float(), w.float()).contiguous() if n > ROUTER_C_ROWS else None
        top_k = self.top_k
        weights = torch.empty(n, top_k, dtype=torch.float32)
        idx = torch.empty(n, top_k, dtype=torch.int64)
        if n:
            _check(lib.moe_router(x.data_ptr(), _DT[x.dtype], n, w.shape[1], ldx, w.data_ptr(), _DT[w.dtype],
                                  w.shape[0], b.data_ptr(), self.n_group, self.topk_group, top_k,
                                  int(bool(self.norm_topk_prob)), self.scaling,
                                  None if logits is None else logits.data_ptr(), weights.data_ptr(),
                                  idx.data_ptr()), "router")
        return weights, idx


def _is_head(name: str) -> bool:
    return name == "lm_head" or name.endswith("shared_head.head")


def use_native_float_ops(model: nn.Module) -> dict[str, int]:
    """Swap the C modules into ``model`` (in place): the lm_head / MTP head when a float32 linear of bf16
    values, every RMSNorm of a float32 or bf16 weight, every Router that fits (groups of >= 2 experts);
    the counts per kind. Nothing when the library is not available (:func:`status` says why)."""
    counts = {"lm_head": 0, "rms_norm": 0, "router": 0}
    if _LIB.library() is None:
        return counts
    swaps = []
    for name, mod in model.named_modules():
        if not name:
            continue
        if type(mod) is nn.Linear and _is_head(name) and mod.bias is None and bf16_representable(mod.weight.detach()):
            swaps.append((name, NativeHeadLinear(mod), "lm_head"))
        elif type(mod) is RMSNorm and mod.weight.dtype in _DT:
            swaps.append((name, NativeRMSNorm(mod), "rms_norm"))
        elif type(mod) is Router and mod.weight.dtype in _DT:
            try:
                swaps.append((name, NativeRouter(mod), "router"))
            except ValueError as e:
                log.info("%s stays torch: %s", name, e)
    for name, new, kind in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        counts[kind] += 1
    log.info("native float ops: %s", counts)
    return counts
