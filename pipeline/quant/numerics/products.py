"""How the calibration forward multiplies in a reduced model dtype (bf16, fp16): ``Recipe.calib_products``.

A bf16 (fp16) GEMM takes bf16 operands, forms exact products (8 x 8 significand bits fit fp32's 24; fp16's
11 x 11 too), sums them in fp32 and rounds once to bf16. Only the order of the sums belongs to the backend,
and backends differ: cuBLAS, oneDNN (on CPUs with AVX-512 BF16 or AMX) and torch's own fallback kernel
(every other CPU) each sum in their own order, so the reference "model dtype" forward is already not one
set of bits across machines.

    fp32   every ``F.linear`` and ``torch.einsum`` whose operands are all bf16 (all fp16) runs as the fp32
           GEMM of the upcast operands, rounded to the dtype: the same products, fp32 sums in the fp32
           GEMM's order, the same single rounding. Measured on an AVX2 CPU (no AVX-512, torch 2.13, one
           thread): a bf16 linear 5.5 GFLOP/s against 28 in fp32.
    model  torch's own matmuls in the model dtype: the reference mode, what earlier versions ran.
    auto   (the default) fp32 where torch has no native kernel for the dtype (a CPU without AVX-512 BF16 /
           AMX: :func:`has_native_gemm`), model elsewhere (oneDNN's AMX bf16 GEMMs and accelerators are
           faster than fp32). The job logs and records which ran (``job.calib_products``).

Measured (scripts/bench_calibration.py, benchmarks/calibration.json; this AVX2 VM, 2 threads): the
calibration forward of the embedded model's default job 7.9 -> 5.1 s, of a DeepSeek-V3-shaped bf16
checkpoint (4 layers, hidden 7168, 16 texts, FA3) 552 -> 162 s: fp32 GEMMs at ~50 GFLOP/s against
~13 in bf16. Both modes give the same weights and dynamic scales (no forward involved; unless ``smooth``,
whose factors come from the forward) and, on both checkpoints, the same static linears' parameters. An
FA3 statistic moves where an fp32 sum lands on the other side of a bf16 rounding and the 0.9999-window's
ends sit among a few extreme values: on the embedded model 2 of its 24 query scales (0.6%, 2.9%), on the
V3-shaped one (random weights) 196 of 512 query scales by up to 7.9% and one latent scale by 0.7%. Any
change of backend (oneDNN's AMX kernels, cuBLAS) moves them alike; tests/test_calib_products.py bounds
the change on the embedded model, and msModelSlim's fixture parity holds in both modes. Float32 models
are unaffected (nothing to upcast).

Upcasting costs a pass over the weight: each weight (``nn.Parameter``) is upcast once per activation of
the mode and kept, up to $DSQUANT_CALIB_FP32_KEEP_GB (16 GiB; a V3 layer's 256 routed experts are 45 GB
in fp32: the rest is upcast per call). The layer-wise job activates it once per layer (all samples reuse
it); a distributed job's stage keeps them across its samples until its weights change (``KeptWeights``).
Kept or not, the values and so the bits are the same.

The mode is a ``TorchFunctionMode`` (thread-local): only the calibration forward, on its own thread, sees it.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipeline.quant.numerics.qparams import QuantError

AUTO, FP32, MODEL = "auto", "fp32", "model"
PRODUCTS = (AUTO, FP32, MODEL)
REDUCED = (torch.bfloat16, torch.float16)
KEEP_ENV, KEEP_GB = "DSQUANT_CALIB_FP32_KEEP_GB", 16.0


def _reduced(tensors) -> torch.dtype | None:
    """The operands' common reduced dtype, or None (mixed, float32, or not all tensors)."""
    dtypes = {t.dtype if isinstance(t, torch.Tensor) else None for t in tensors}
    if len(dtypes) != 1:
        return None
    (dt,) = dtypes
    return dt if dt in REDUCED else None


class KeptWeights:
    """Upcast weights (``nn.Parameter``: constant while kept) kept for reuse, up to ``budget`` bytes (default:
    :func:`keep_budget`). One per activation of the mode, or one for longer (a pipeline stage runs every
    sample through its layers in a separate activation): its owner calls :meth:`clear` whenever the weights
    change in place or go."""

    def __init__(self, budget: int | None = None):
        self.entries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.budget = keep_budget() if budget is None else budget
        self.left = self.budget

    def upcast(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            return t.float()
        hit = self.entries.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        up = t.float()
        if up.nbytes <= self.left:           # the entry holds ``t``: its id cannot be reused meanwhile
            self.entries[id(t)] = (t, up)
            self.left -= up.nbytes
        return up

    def clear(self) -> None:
        self.entries.clear()
        self.left = self.budget


class _Fp32Products(TorchFunctionMode):
    """Upcasts reduced-precision operands, weights through ``kept``."""

    def __init__(self, kept: KeptWeights, auto: bool):
        super().__init__()
        self.kept, self.auto = kept, auto

    def _upcast(self, dt: torch.dtype | None, device: torch.device) -> bool:
        return dt is not None and not (self.auto and has_native_gemm(dt, device))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            dt = _reduced([x, w] if b is None else [x, w, b])
            if self._upcast(dt, x.device):
                return F.linear(x.float(), self.kept.upcast(w), None if b is None else self.kept.upcast(b)).to(dt)
        elif func is torch.einsum and not kwargs and len(args) >= 2 and isinstance(args[0], str):
            ops = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            dt = _reduced(ops)
            if self._upcast(dt, ops[0].device if dt is not None else None):
                return torch.einsum(args[0], *[self.kept.upcast(t) for t in ops]).to(dt)
        return func(*args, **kwargs)


def keep_budget() -> int:
    """Bytes of upcast weights a KeptWeights keeps: $DSQUANT_CALIB_FP32_KEEP_GB (default 16)."""
    raw = os.environ.get(KEEP_ENV, str(KEEP_GB))
    try:
        gb = float(raw)
    except ValueError:
        raise QuantError(f"{KEEP_ENV}: expected a number of GB, got {raw!r}") from None
    if gb < 0:
        raise QuantError(f"{KEEP_ENV}: must be >= 0, got {raw!r}")
    return int(gb * 1024 ** 3)


@functools.lru_cache(maxsize=None)
def has_native_gemm(dtype: torch.dtype, device: torch.device) -> bool:
    """Does torch multiply ``dtype`` natively on ``device``? Accelerators do; a CPU does through oneDNN
    when it has the instructions (AVX-512 BF16 / FP16, AMX), else torch's slow fallback kernel runs."""
    if device.type != "cpu":
        return True
    mkldnn = torch.ops.mkldnn
    return bool(mkldnn._is_mkldnn_bf16_supported() if dtype == torch.bfloat16 else mkldnn._is_mkldnn_fp16_supported())


def resolved(mode: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> str:
    """What ``mode`` does for a model of ``dtype`` on ``device``, in words (the job's log and manifest)."""
    check_products(mode)
    device, name = torch.device(device), str(dtype).replace("torch.", "")
    if dtype not in REDUCED:
        return f"{name} model (nothing to upcast)"
    if mode == MODEL or (mode == AUTO and has_native_gemm(dtype, device)):
        return f"{MODEL} ({'auto: ' if mode == AUTO else ''}torch's {name} matmuls on {device.type})"
    why = f"auto: torch has no native {name} GEMM on this {device.type}" if mode == AUTO else "asked"
    return f"{FP32} ({why})"


def check_products(mode: str, name: str = "calib_products") -> None:
    if mode not in PRODUCTS:
        raise QuantError(f"recipe: field '{name}' must be one of {PRODUCTS}, got {mode!r}")


@contextmanager
def calibration_products(mode: str, kept: KeptWeights | None = None) -> Iterator[None]:
    """While active (this thread only), reduced-precision products are computed as ``mode`` says; upcast
    weights are kept in ``kept`` (default: a new KeptWeights for this activation)."""
    check_products(mode)
    with (nullcontext() if mode == MODEL else _Fp32Products(kept if kept is not None else KeptWeights(),
                                                            auto=mode == AUTO)):
        yield
