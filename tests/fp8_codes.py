"""Test helpers for bit-exact comparisons of FP8 and quantized tensors."""

from __future__ import annotations

import math

import torch

from pipeline.io.fp8 import FP8_DTYPE

NAN_CODES = (0x7F, 0xFF)  # e4m3fn S.1111.111


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (an integer view of the same size), for exact equality of floats."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.itemsize])


def every_code(shape: tuple[int, int]) -> torch.Tensor:
    """float8_e4m3fn of ``shape`` cycling through the 254 non-NaN codes."""
    codes = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)
    return codes.repeat(math.ceil(math.prod(shape) / len(codes)))[:math.prod(shape)].view(FP8_DTYPE).view(shape)
