"""RMSNorm as DeepSeek-V3 runs it: normalise in float32, cast back to the input dtype, then scale.

A norm may carry a float32 ``bias`` (msModelSlim's iter_smooth folds its channel shift into one): it is added
to the scaled output and the sum rounded to the input dtype once, as msModelSlim's shifted norm computes."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype) [+ bias, rounded to x.dtype]; x: [..., dim]."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(x.dtype)
        return y if self.bias is None else (y + self.bias).to(x.dtype)
