"""How the calibration forward multiplies in a reduced model dtype (bf16, fp16): ``Recipe.calib_products``.

A bf16 (fp16) GEMM takes bf16 operands, forms exact products (8 x 8 significand bits fit fp32's 24; fp16's
11 x 11 too), sums them in fp32 and rounds once to bf16. Only the order of the sums belongs to the backend,
and backends differ: cuBLAS, oneDNN (on CPUs with AVX-512 BF16 or AMX) and torch's own fallback kernel
(every other CPU) each sum in their own order, so the reference "model dtype" forward is already not one
set of bits across machines.

    fp32   (the default) every ``F.linear`` and ``torch.einsum`` whose operands are all bf16 (all fp16)
           runs as the fp32 GEMM of the upcast operands, rounded to the dtype: the same products, fp32
           sums in the fp32 GEMM's order, the same single rounding. Measured on an AVX2 CPU (no AVX-512,
           torch 2.13, one thread): a bf16 linear 5.5 GFLOP/s against 28 in fp32; the embedded model's
           calibration forward 14.5 -> 7 s.
    model  torch's own matmuls in the model dtype: the reference mode, what earlier versions ran.

The two modes give the same weights and dynamic scales (no forward involved; without ``smooth``, whose
factors come from the forward) and, on the embedded model
(its 64 calibration texts, an AVX2 CPU), the same static linears' parameters; a statistic moves when an
fp32 sum lands on the other side of a bf16 rounding: of the 8 FA3 query scales of layers 1 and 2 one
moved by a bf16 ulp and one by 2.9% (its head's window shifted where two candidate windows were
near-tied); tests/test_calib_products.py bounds the change, and msModelSlim's fixture parity holds in
both. Float32 models are unaffected (nothing to upcast).

The mode is a ``TorchFunctionMode`` (thread-local): only the calibration forward, on its own thread, sees it.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipeline.quant.qparams import QuantError

FP32, MODEL = "fp32", "model"
PRODUCTS = (FP32, MODEL)
REDUCED = (torch.bfloat16, torch.float16)


def _reduced(tensors) -> torch.dtype | None:
    """The operands' common reduced dtype, or None (mixed, float32, or not all tensors)."""
    dtypes = {t.dtype if isinstance(t, torch.Tensor) else None for t in tensors}
    if len(dtypes) != 1:
        return None
    (dt,) = dtypes
    return dt if dt in REDUCED else None


class _Fp32Products(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            dt = _reduced([x, w] if b is None else [x, w, b])
            if dt is not None:
                return F.linear(x.float(), w.float(), None if b is None else b.float()).to(dt)
        elif func is torch.einsum and not kwargs and len(args) >= 2 and isinstance(args[0], str):
            ops = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            dt = _reduced(ops)
            if dt is not None:
                return torch.einsum(args[0], *[t.float() for t in ops]).to(dt)
        return func(*args, **kwargs)


def check_products(mode: str, name: str = "calib_products") -> None:
    if mode not in PRODUCTS:
        raise QuantError(f"recipe: field '{name}' must be one of {PRODUCTS}, got {mode!r}")


@contextmanager
def calibration_products(mode: str) -> Iterator[None]:
    """While active (this thread only), reduced-precision products are computed as ``mode`` says."""
    check_products(mode)
    with (_Fp32Products() if mode == FP32 else nullcontext()):
        yield
