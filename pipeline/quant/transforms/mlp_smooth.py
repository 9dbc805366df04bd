"""Smoothing of a layer's MLP input: post_attention_layernorm into every linear it feeds.

msModelSlim's subgraphs (pipeline.quant.transforms.subgraphs) never smooth the norm before the MLP, so a
per-channel outlier there reaches every gate_proj / up_proj input: the dense MLP's, the shared experts' and
every routed expert's, whose per-token int8 activations cannot hold a channel many times its neighbours.
This transform moves it into the weights, SmoothQuant-style, with one scale per channel for the whole MLP::

    a_j = max |x_j|               x: the norm's output, over every token the layer sees (the shared experts',
                                  or the union of the routed experts' inputs: every token reaches some)
    w_j = max |W[:, j]|           over every quantized target's rows (gate_proj and up_proj of the dense
                                  MLP, of the shared experts and of every routed expert)
    s_j = 2 ** round(log2(a_j ** alpha / w_j ** (1 - alpha)))      (1 where a_j or w_j is ~0)

    post_attention_layernorm.weight (and .bias)  /= s
    every target's W[:, j]                       *= s_j
    the router's mlp.gate.weight[:, j]           *= s_j     (it stays float and reads the same input)

Power-of-two scales make every product exact in binary floating point (no overflow or subnormal in
between): the float model computes the same values bit for bit, the router picks the same experts, and
only the quantized linears see other inputs (channels balanced) and other weights.

The recipe names the layers (``mlp_smooth_layers``, main layers only) and alpha (``mlp_smooth_alpha``);
the measured fallback (pipeline.quant.evaluation.fallback) picks the layers where it lowers the measured
error.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.transforms.smooth import smooth_scales

NORM = "post_attention_layernorm"
ROUTER = "mlp.gate"


def mlp_targets(cfg: DeepseekV3Config, layer_id: int) -> tuple[str, ...]:
    """The linears (module names) layer ``layer_id``'s post-attention norm feeds, quantized ones only (the
    router, which stays float, is :data:`ROUTER`): gate_proj and up_proj of its MLP or experts."""
    p = layout.layer_prefix(layer_id)
    if cfg.is_moe_layer(layer_id):
        mlps = ([p + "mlp.shared_experts."] if cfg.n_shared_experts else []) + [
            f"{p}mlp.experts.{e}." for e in range(cfg.n_routed_experts)]
    else:
        mlps = [p + "mlp."]
    return tuple(m + leaf for m in mlps for leaf in ("gate_proj", "up_proj"))


def pow2_scales(act_absmax: Tensor, weight_absmax: Tensor, alpha: float) -> Tensor:
    """s = 2 ** round(log2(a ** alpha / w ** (1 - alpha))) per channel, float32: SmoothQuant's scale
    (pipeline.quant.transforms.smooth.smooth_scales: 1 where a or w is 0) to the nearest power of two."""
    return torch.exp2(torch.log2(smooth_scales(act_absmax, weight_absmax, alpha)).round())


def smooth_mlp_input(tensors: Mapping[str, Tensor], cfg: DeepseekV3Config, layer_id: int, act_absmax: Tensor,
                     alpha: float) -> tuple[dict[str, Tensor], Tensor]:
    """(layer ``layer_id``'s HF-named tensors with the MLP input smoothed: a new dict, untouched tensors
    shared; the scales s). ``act_absmax``: max |x| per channel of the norm's output."""
    if not 0 <= layer_id < cfg.num_hidden_layers:
        raise QuantError(f"mlp_smooth: layer {layer_id} is not a main layer (0..{cfg.num_hidden_layers - 1})")
    p = layout.layer_prefix(layer_id)

    def get(name: str) -> Tensor:
        if name not in tensors:
            raise QuantError(f"mlp_smooth: tensor {name} is missing from layer {layer_id}")
        return tensors[name]

    names = [t + ".weight" for t in mlp_targets(cfg, layer_id)]
    w_stat = torch.stack([get(n).float().abs().amax(0) for n in names]).amax(0)
    s = pow2_scales(act_absmax, w_stat, alpha)
    out = dict(tensors)
    for n in (p + NORM + ".weight", p + NORM + ".bias"):
        if n in tensors:
            out[n] = (tensors[n].float() / s).to(tensors[n].dtype)
    if cfg.is_moe_layer(layer_id):
        names.append(p + ROUTER + ".weight")
    for n in names:
        w = get(n)
        out[n] = (w.float() * s.view(1, -1)).to(w.dtype)
    return out, s

