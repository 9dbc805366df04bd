"""What the kernel modules share: the device rule and three exact float32 helpers written in Triton.

The helpers are plain float32 / integer arithmetic so that they give the same bits on a GPU and in Triton's
interpreter (whose bf16 casts truncate instead of rounding to nearest even, and whose libdevice has no
``rint``):

- ``rint_f32(v)``: round half to even, exact for |v| < 2^22 (callers clamp first): adding and subtracting
  1.5 * 2^23 leaves the integer nearest to v, ties to even, in IEEE float32 round-to-nearest;
- ``round_bf16(v)``: v rounded to the nearest bfloat16 (ties to even), returned as float32 (NaN not
  preserved: callers never pass one);
- ``round_to(v, KIND)``: v rounded to the model dtype (ROUND_NONE float32, ROUND_BF16, ROUND_FP16).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: True when triton runs kernels through its interpreter (TRITON_INTERPRET=1 when the kernels were defined).
INTERPRET = bool(getattr(getattr(getattr(triton, "knobs", None), "runtime", None), "interpret",
                         os.environ.get("TRITON_INTERPRET", "0") == "1"))

ROUND_NONE, ROUND_BF16, ROUND_FP16 = 0, 1, 2
_ROUND_KIND = {torch.float32: ROUND_NONE, torch.bfloat16: ROUND_BF16, torch.float16: ROUND_FP16}


def round_kind(dtype: torch.dtype, what: str) -> int:
    """The ``round_to`` kind of a model dtype; ValueError naming ``what`` for anything else."""
    try:
        return _ROUND_KIND[dtype]
    except KeyError:
        raise ValueError(f"{what}: dtype {dtype} not supported (float32, bfloat16 or float16)") from None


def check_device(fn: str, **tensors: torch.Tensor) -> torch.device:
    """The one device of ``tensors``: CUDA, or the CPU when running through the interpreter. ValueError
    naming the tensor on another device; RuntimeError on a CPU without TRITON_INTERPRET=1."""
    dev = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
        if dev is None:
            dev, first = t.device, name
        elif t.device != dev:
            raise ValueError(f"{fn}: {name} is on {t.device} but {first} is on {dev}")
    if dev is not None and dev.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"{fn}: Triton kernels need a CUDA device, got {dev}; on a CPU set "
                           f"TRITON_INTERPRET=1 before importing pipeline.engine.triton modules (slow: tests only)")
    return dev


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for the interpreter: the split heuristics only)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@triton.jit
def rint_f32(v):
    """Round half to even of float32 ``v`` with |v| < 2^22."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def round_bf16(v):
    """float32 ``v`` rounded to the nearest bfloat16 (ties to even), as float32."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def round_to(v, KIND: tl.constexpr):
    """float32 ``v`` rounded to the model dtype KIND (ROUND_NONE, ROUND_BF16, ROUND_FP16), as float32."""
    if KIND == 1:
        return round_bf16(v)
    elif KIND == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def quantize_rows_dynamic(x, s):
    """``clamp(round(x / s), -128, 127)`` as int8 for float32 ``x`` [M, K] and per-row ``s`` [M]
    (qlinear.quantize_per_token's formula; the division rounded to nearest as torch's)."""
    v = tl.math.div_rn(x, s[:, None])
    v = tl.minimum(tl.maximum(v, -129.0), 128.0)
    return tl.minimum(tl.maximum(rint_f32(v), -128.0), 127.0).to(tl.int8)


@triton.jit
def per_token_scale(amax):
    """``max(amax / 127, eps_f32)``: qlinear.quantize_per_token's s_tok from a row's max |x|."""
    return tl.maximum(tl.math.div_rn(amax, 127.0), 1.1920928955078125e-07)
