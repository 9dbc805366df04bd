"""Finiteness of large float tensors, cheaply: the checks run on every weight the quantizer reads."""

from __future__ import annotations

import math

import torch


def all_finite(t: torch.Tensor) -> bool:
    """True when the float tensor ``t`` holds no NaN and no +-Inf. One ``aminmax`` pass: NaN propagates
    through min and max, and an Inf is the min or the max; ``isfinite(t).all()`` builds a bool tensor
    first and costs several times more. Empty tensors are finite."""
    if t.numel() == 0:
        return True
    x = t if t.dtype.itemsize > 1 else t.float()  # no min/max kernels for 8-bit floats
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a float tensor: for error messages, once a check has failed."""
    x = t if t.dtype.itemsize > 1 else t.float()
    return int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
