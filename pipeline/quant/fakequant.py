"""Fake-quant execution: the float model with the quantized arithmetic of a W8A8 + FA3 directory.

- W8A8 (static) linears compute ``deq_scale * (x_q @ W8.T + quant_bias)`` with
  ``x_q = clamp(round(x / input_scale + input_offset), -128, 127)``; W8A8_DYNAMIC linears quantize each
  token symmetrically and compute ``(x_q @ W8.T) * s_tok * weight_scale.T`` (pipeline.quant.qparams; exact
  integer accumulation).
- FA3: the latent that the cache holds is ``c_int8 = clamp(round(c / fa_k), -127, 127)``, and attention
  reads ``fa_k * c_int8`` for both the key and the value products (k_pe stays in the model dtype).

Used to measure accuracy (perplexity, per-layer SQNR) against the float model; the serving engine runs the
same arithmetic with real int8 kernels and caches.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from pipeline import layout
from pipeline.model import DeepseekV3ForCausalLM, build_model
from pipeline.format.description import FLOAT, QUANT_KINDS, W8A8
from pipeline.format.reader import fa_scales, read_quantized
from pipeline.quant.qparams import deq_scale_to_float32, w8a8_dynamic_linear, w8a8_static_linear


class QuantLinear(nn.Module):
    """A linear that computes with the stored integers; output cast to the input's dtype."""

    def __init__(self, kind: str, params: Mapping[str, torch.Tensor]):
        super().__init__()
        if kind not in QUANT_KINDS:
            raise ValueError(f"QuantLinear: unknown type {kind!r}")
        self.kind = kind
        need = ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias") if kind == W8A8 \
            else ("weight", "weight_scale")
        missing = [k for k in need if k not in params]
        if missing:
            raise ValueError(f"QuantLinear ({kind}): missing {missing}")
        for k in need:
            self.register_buffer(k, params[k])
        self.out_features, self.in_features = params["weight"].shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == W8A8:
            y = w8a8_static_linear(x, self.weight, self.input_scale, self.input_offset, self.deq_scale, self.quant_bias)
        else:
            y = w8a8_dynamic_linear(x, self.weight, self.weight_scale)
        return y.to(x.dtype)


def fa3_latent(c: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the int8 cache gives back: fa_k * clamp(round(c / fa_k), -127, 127), in c's dtype."""
    s = scale.float().reshape(())
    return (torch.clamp(torch.round(c.float() / s), -127, 127) * s).to(c.dtype)


def install_fa3(model: DeepseekV3ForCausalLM, fa_k: Mapping[int, torch.Tensor]) -> list:
    """Quantize the cached latent of each layer in ``fa_k`` (layer id -> scale); returns the hook handles."""
    handles = []
    for layer in model.model.layers:
        if layer.layer_id in fa_k:
            s = fa_k[layer.layer_id]
            handles.append(layer.self_attn.kv_a_layernorm.register_forward_hook(
                lambda mod, inp, out, s=s: fa3_latent(out, s)))
    return handles


def install_w8a8(model: DeepseekV3ForCausalLM, tensors: Mapping[str, torch.Tensor], types: Mapping[str, str]) -> int:
    """Replace every linear whose weight is typed W8A8/W8A8_DYNAMIC with a QuantLinear; returns the count."""
    n = 0
    for name, kind in types.items():
        if not name.endswith(".weight") or kind not in QUANT_KINDS:
            continue
        prefix = name[: -len(".weight")]
        params = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        parent_name, child = prefix.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        if not isinstance(getattr(parent, child, None), nn.Linear):
            raise ValueError(f"{prefix}: typed {kind} but the model has no linear there")
        setattr(parent, child, QuantLinear(kind, params))
        n += 1
    return n


def _placeholder_weight(tensors, prefix: str, md: torch.dtype) -> torch.Tensor:
    """A float weight for a quantized linear (replaced when W8A8 is on): W8 * weight_scale, or for
    static layers without weight_scale (ascendV1) W8 * deq_scale / input_scale."""
    w = tensors[prefix + ".weight"].float()
    if prefix + ".weight_scale" in tensors:
        ws = tensors[prefix + ".weight_scale"].float()
    else:
        ws = (deq_scale_to_float32(tensors[prefix + ".deq_scale"]) / tensors[prefix + ".input_scale"].float()).unsqueeze(1)
    return (w * ws).to(md)


def load_fakequant_model(path: str, dtype=torch.float32, device="cpu", w8a8: bool = True,
                         fa3: bool = True) -> DeepseekV3ForCausalLM:
    """The model of a quantized directory. ``w8a8``: linears compute with the integers (else with the
    dequantized weights and float activations); ``fa3``: the latent goes through its int8 form."""
    cfg, types, tensors = read_quantized(path)
    float_tensors = {}
    for name in layout.checkpoint_shapes(cfg):
        kind = types.get(name, FLOAT)
        float_tensors[name] = tensors[name] if kind == FLOAT else _placeholder_weight(tensors, name[:-7], dtype)
    model = build_model(cfg, float_tensors, dtype=dtype, device=device)
    if w8a8:
        install_w8a8(model, {k: v.to(device) for k, v in tensors.items()}, types)
    if fa3:
        install_fa3(model, {k: v.to(device) for k, v in fa_scales(tensors).items()})
    return model
