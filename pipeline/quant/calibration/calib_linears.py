"""How each linear behaves in the passes of msModelSlim's layer-by-layer calibration (docs/recipes.md,
"Calibration"), every operation in the model dtype md:

    FloatLinears      F.linear as it is (the anti-outlier steps' forward); observed inputs on request
    CalibLinears      the linears' calibration pass: a W8A8 linear takes the running min / max of its input
                      over the samples so far (this call's included), derives (s, o) from it, fake-quantizes
                      its input with them and its weight per channel; a W8A8_DYNAMIC linear fake-quantizes
                      its input symmetric per call over the whole tensor
    DeployedLinears   after the pass: W8A8 with the final (s, o); W8A8_DYNAMIC per input channel over the
                      call's rows (what msModelSlim's deployed dynamic module computes)

A fake-quantized value is ``(clamp(round(x / s + o), -128, 127) - o) * s`` in md; weights are
``int8 * weight_scale`` in md with dsquant's own per-channel quantizer (bit-identical to msModelSlim's).
FLOAT linears (kv_b_proj, anything no rule quantizes) run as they are in every pass.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.format.description import W8A8, W8A8_DYNAMIC
from pipeline.quant.numerics.observers import MinMax
from pipeline.quant.numerics.qparams import F32_EPS, quantize_weight_per_channel, static_activation_params


def fake_quant(x: Tensor, s: Tensor, o: Tensor) -> Tensor:
    q = (x / s + o).round_().clamp_(-128, 127).to(torch.int8)
    return (q - o) * s


def symmetric_params(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """(s, 0) for ends lo, hi in md: s = max(max(-min(lo, 0), max(hi, 0)) / 127, eps), in md."""
    eps = torch.tensor(F32_EPS, dtype=lo.dtype)
    s = torch.maximum(-torch.clamp(lo, max=0), torch.clamp(hi, min=0)) / 127.0
    return torch.maximum(s, eps), torch.zeros_like(s)


class FloatLinears:
    """The layer's linears as they are; ``observers`` {linear name: object with ``observe(x)``} see their
    inputs."""

    def __init__(self, tensors: Mapping[str, Tensor], observers: Optional[Mapping[str, Any]] = None):
        self.t, self.observers = tensors, dict(observers or {})

    def __call__(self, name: str, x: Tensor) -> Tensor:
        obs = self.observers.get(name)
        if obs is not None and x.numel():
            obs.observe(x)
        b = self.t.get(name + ".bias")
        return F.linear(x, self.t[name + ".weight"], None if b is None else b.to(x.dtype))


class FakeQuantWeights:
    """Each quantized linear's weight as its int8 values times its per-channel scale, in md, made on first
    use and kept for the calls after it: one layer's worth, shared by a layer's passes."""

    def __init__(self, tensors: Mapping[str, Tensor]):
        self.t = tensors
        self._w: dict[tuple[str, torch.dtype], Tensor] = {}

    def __call__(self, name: str, md: torch.dtype) -> Tensor:
        w = self._w.get((name, md))
        if w is None:
            q, ws, _ = quantize_weight_per_channel(self.t[name + ".weight"], name + ".weight")
            # q.to(md) * ws.to(md) without the widened q: the same values (an int8 is exact in md), one
            # weight-sized block allocated, not two
            w = self._w[name, md] = torch.mul(q, ws.to(md), out=torch.empty(q.shape, dtype=md))
        return w


class _Quantized:
    """What the quantized passes share: the layer's tensors, each linear's type, fake-quantized weights
    (``weights``: those of an earlier pass over the same tensors)."""

    def __init__(self, tensors: Mapping[str, Tensor], kinds: Mapping[str, str],
                 weights: Optional[FakeQuantWeights] = None):
        if weights is not None and weights.t is not tensors:
            raise ValueError("fake-quantized weights shared between passes over different tensors")
        self.t, self.kinds = tensors, kinds
        self.weight = weights if weights is not None else FakeQuantWeights(tensors)

    def bias(self, name: str, md: torch.dtype) -> Optional[Tensor]:
        b = self.t.get(name + ".bias")
        return None if b is None else b.to(md)

    def plain(self, name: str, x: Tensor) -> Tensor:
        return F.linear(x, self.t[name + ".weight"], self.bias(name, x.dtype))


class CalibLinears(_Quantized):
    """The calibration pass (module doc); ``ranges`` holds each W8A8 linear's running (lo, hi) in md."""

    def __init__(self, tensors: Mapping[str, Tensor], kinds: Mapping[str, str],
                 weights: Optional[FakeQuantWeights] = None):
        super().__init__(tensors, kinds, weights)
        self.ranges: dict[str, tuple[Tensor, Tensor]] = {}
        self.counts: dict[str, int] = {}

    def __call__(self, name: str, x: Tensor) -> Tensor:
        kind = self.kinds.get(name)
        md = x.dtype
        if kind == W8A8:
            lo, hi = torch.amin(x), torch.amax(x)
            if name in self.ranges:
                lo, hi = torch.minimum(self.ranges[name][0], lo), torch.maximum(self.ranges[name][1], hi)
            self.ranges[name] = (lo, hi)
            self.counts[name] = self.counts.get(name, 0) + x.numel()
            s, o = static_activation_params(lo, hi, md, name)
        elif kind == W8A8_DYNAMIC:
            s, o = symmetric_params(torch.amin(x), torch.amax(x))
        else:
            return self.plain(name, x)
        return F.linear(fake_quant(x, s, o), self.weight(name, md), self.bias(name, md))

    def minmax(self) -> dict[str, MinMax]:
        """Each W8A8 linear's final range, as the statistic the writer turns into input_scale / offset."""
        return {n: MinMax(float(lo), float(hi), self.counts[n]) for n, (lo, hi) in self.ranges.items()}


class DeployedLinears(_Quantized):
    """The linears after their calibration (module doc); ``params`` {W8A8 linear: (s, o) in md}."""

    def __init__(self, tensors: Mapping[str, Tensor], kinds: Mapping[str, str],
                 params: Mapping[str, tuple[Tensor, Tensor]], weights: Optional[FakeQuantWeights] = None):
        super().__init__(tensors, kinds, weights)
        self.params = params

    def __call__(self, name: str, x: Tensor) -> Tensor:
        kind = self.kinds.get(name)
        md = x.dtype
        if kind == W8A8:
            s, o = self.params[name]
            xq = fake_quant(x, s, o)
        elif kind == W8A8_DYNAMIC:
            rows = x.reshape(-1, x.shape[-1])
            s, o = symmetric_params(torch.amin(rows, dim=0), torch.amax(rows, dim=0))
            xq = fake_quant(rows, s, o).reshape(x.shape)
        else:
            return self.plain(name, x)
        return F.linear(xq, self.weight(name, md), self.bias(name, md))


def final_params(ranges: Mapping[str, tuple[Tensor, Tensor]], md: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
    """(s, o) in md of each W8A8 linear from its final running range."""
    return {n: static_activation_params(lo, hi, md, n) for n, (lo, hi) in ranges.items()}
