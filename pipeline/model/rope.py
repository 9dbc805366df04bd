"""Interleaved rotary position embedding with DeepSeek's YaRN frequencies.

DeepSeek rotates interleaved pairs ``(x[2i], x[2i+1])`` as complex numbers (never NeoX half-split), and
the HF weights need no permutation. YaRN blends each frequency between extrapolation (``f``) and
interpolation (``f / factor``) with a linear ramp over the pair index i::

    f_i   = theta ** (-2i / d)                                   # d = qk_rope_head_dim
    low   = floor(corr(beta_fast)), high = ceil(corr(beta_slow)),  corr(b) = d*ln(L / (2*pi*b)) / (2*ln(theta))
    ramp  = clamp((i - low) / (high - low), 0, 1)                # L = original_max_position_embeddings
    f'_i  = f_i / factor * ramp + f_i * (1 - ramp)

cos/sin are multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1.0 for V3).
"""

from __future__ import annotations

import math

import torch

from pipeline.config import DeepseekV3Config, yarn_mscale


def inv_frequencies(cfg: DeepseekV3Config) -> torch.Tensor:
    """The d/2 rotation frequencies (float32), YaRN-adjusted when configured; computed on the CPU whatever
    device is in force (a model built on the meta device included: see causal_lm.embedding)."""
    d, theta = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    ys = cfg.rope_scaling
    if ys is None or ys.factor <= 1:
        return freqs

    def corr(beta: float) -> float:
        return d * math.log(ys.original_max_position_embeddings / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(ys.beta_fast)), 0)
    high = min(math.ceil(corr(ys.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    return freqs / ys.factor * ramp + freqs * (1 - ramp)


def cos_sin_multiplier(cfg: DeepseekV3Config) -> float:
    ys = cfg.rope_scaling
    if ys is None:
        return 1.0
    return yarn_mscale(ys.factor, ys.mscale) / yarn_mscale(ys.factor, ys.mscale_all_dim)


class Rotary:
    """Rotation angles of a model: ``cos_sin(positions)`` with positions of any shape [...] (int64)
    returns float32 (cos, sin) of shape [..., d/2]. Angles are computed on the fly (cheap next to the
    projections), so there is no table to size for 163840 positions."""

    def __init__(self, cfg: DeepseekV3Config, device=None):
        self.inv_freq = inv_frequencies(cfg).to(device)
        self.multiplier = cos_sin_multiplier(cfg)
        self.max_positions = cfg.max_position_embeddings

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(positions.max())} is beyond max_position_embeddings ({self.max_positions})")
        angles = positions.to(self.inv_freq.device).float().unsqueeze(-1) * self.inv_freq
        return angles.cos() * self.multiplier, angles.sin() * self.multiplier

    def to(self, device) -> "Rotary":
        self.inv_freq = self.inv_freq.to(device)
        return self


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` [..., S, (heads,) d] by (cos, sin) [..., S, d/2].

    Output stays interleaved: ``out[2i] = x[2i]*cos_i - x[2i+1]*sin_i``, ``out[2i+1] = x[2i+1]*cos_i + x[2i]*sin_i``.
    cos/sin broadcast over a head dimension when x has one more dim than they do (minus the last).
    Computed in float32 and cast back to x's dtype.
    """
    if x.dim() == cos.dim() + 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)
