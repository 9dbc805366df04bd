"""Fake-quant execution: the float model with the quantized arithmetic of a W8A8 + FA3 directory.

- W8A8 (static) linears compute ``deq_scale * (x_q @ W8.T + quant_bias)`` with
  ``x_q = clamp(round(x / input_scale + input_offset), -128, 127)``; W8A8_DYNAMIC linears quantize each
  token symmetrically and compute ``(x_q @ W8.T) * s_tok * weight_scale.T`` (pipeline.quant.numerics.qparams; exact
  integer accumulation).
- FA3: the latent that the cache holds is ``c_int8 = clamp(round(c / fa_k), -127, 127)``, and attention
  reads ``fa_k * c_int8`` for both the key and the value products (k_pe stays in the model dtype).

Files written by other tools load too:
- biases (msModelSlim's iter_smooth): a norm's float32 ``.bias`` is added after its scale, in float32, and
  the result cast back (``md(md(w * x_hat) + bias)``, pipeline.model.norm.RMSNorm); a linear's ``.bias`` is added by FLOAT and
  W8A8_DYNAMIC linears and by the dequantized placeholders, but not by W8A8 (static) linears, whose
  ``quant_bias`` already holds it (counted once);
- QuaRot (the description's ``optional.quarot.rotation_map.global_rotation``): the files already hold the
  rotated embeddings, heads and weights, so the forward is the usual one, in the rotated basis of the
  residual stream; the model's ``global_rotation`` attribute (None without QuaRot) is the orthogonal Q
  with ``h_rotated = h @ Q``, which the evaluation uses to compare residual-stream tensors with the float
  model's.

Used to measure accuracy (perplexity, agreement, KL, SQNR) against the float model; the serving engine
runs the same arithmetic with real int8 kernels and caches.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn

from pipeline import layout
from pipeline.io import storage
from pipeline.io.safetensors_io import CheckpointError, read_header, read_tensors
from pipeline.model import DeepseekV3ForCausalLM, build_model
from pipeline.format.description import DESCRIPTION_NAME, FLOAT, QUANT_KINDS, W8A8, loads_json_object
from pipeline.format.reader import fa_scales, read_quantized
from pipeline.quant.numerics.qparams import deq_scale_to_float32, w8a8_dynamic_linear, w8a8_static_linear

ROTATION_KEY = "global_rotation"
ORTHOGONAL_TOL = 1e-4    # max |Q Q^T - I| accepted of a stored global rotation


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
        # a static linear's bias is inside quant_bias; a dynamic one adds its own
        self.register_buffer("bias", params["bias"].float() if kind != W8A8 and "bias" in params else None)
        self.out_features, self.in_features = params["weight"].shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == W8A8:
            y = w8a8_static_linear(x, self.weight, self.input_scale, self.input_offset, self.deq_scale, self.quant_bias)
        else:
            y = w8a8_dynamic_linear(x, self.weight, self.weight_scale)
            if self.bias is not None:
                y = y + self.bias
        return y.to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the integers stand for: W8 * weight_scale (static: deq_scale / input_scale)."""
        if self.kind == W8A8:
            ws = deq_scale_to_float32(self.deq_scale) / self.input_scale.float()
            return self.weight.float() * ws.unsqueeze(1)
        return self.weight.float() * self.weight_scale.float().reshape(-1, 1)

    def dequantized_bias(self) -> Optional[torch.Tensor]:
        """The float32 bias the integers stand for (static: deq_scale * (quant_bias + input_offset *
        rowsum(W8)), the bias folded into quant_bias; dynamic: the stored bias or None)."""
        if self.kind != W8A8:
            return self.bias
        rows = self.weight.to(torch.int64).sum(1).double()
        deq = deq_scale_to_float32(self.deq_scale).double()
        return (deq * (self.quant_bias.double() + self.input_offset.double().reshape(()) * rows)).float()


def fa3_latent(c: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the int8 cache gives back: fa_k * clamp(round(c / fa_k), -127, 127), in c's dtype."""
    s = scale.float().reshape(())
    return (torch.clamp(torch.round(c.float() / s), -127, 127) * s).to(c.dtype)


def install_fa3(model: DeepseekV3ForCausalLM, fa_k: Mapping[int, torch.Tensor]) -> list:
    """Quantize the cached latent of each layer in ``fa_k`` (layer id -> scale), recorded in the model's
    ``fa3_layers``; returns the hook handles."""
    handles = []
    model.fa3_layers = sorted(set(getattr(model, "fa3_layers", ())) | {int(i) for i in fa_k})
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


def float_biases(tensors: Mapping[str, torch.Tensor], types: Mapping[str, str]) -> dict:
    """The stored ``.bias`` tensors of norms and float linears (see the module doc), which build_model
    attaches as it attaches a checkpoint's; quantized linears take theirs in install_w8a8."""
    return {k: v for k, v in tensors.items()
            if k.endswith(".bias") and types.get(k[: -len(".bias")] + ".weight", FLOAT) == FLOAT}


def read_rotation(path: str, hidden: int) -> Optional[torch.Tensor]:
    """QuaRot's global rotation Q [hidden, hidden] float32 of a quantized directory, or None."""
    desc = loads_json_object(storage.read_bytes(storage.join(path, DESCRIPTION_NAME)), DESCRIPTION_NAME)
    rel = (((desc.get("optional") or {}).get("quarot") or {}).get("rotation_map") or {}).get(ROTATION_KEY)
    if rel is None:
        return None
    file = storage.join(path, rel) if isinstance(rel, str) else ""
    if not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/") or not storage.exists(file):
        raise CheckpointError(f"{path}/{DESCRIPTION_NAME}: optional.quarot.rotation_map.{ROTATION_KEY} names "
                              f"{rel!r}, not a file inside the directory")
    header = read_header(file)
    if ROTATION_KEY not in header.tensors:
        raise CheckpointError(f"{file}: no tensor {ROTATION_KEY!r}")
    q = read_tensors(header, [ROTATION_KEY])[ROTATION_KEY].float()
    if tuple(q.shape) != (hidden, hidden):
        raise CheckpointError(f"{file}: {ROTATION_KEY} has shape {list(q.shape)}, expected [{hidden}, {hidden}]")
    err = (q.double() @ q.double().T - torch.eye(hidden, dtype=torch.float64)).abs().max().item()
    if not err <= ORTHOGONAL_TOL:
        raise CheckpointError(f"{file}: {ROTATION_KEY} is not orthogonal (max |Q Q^T - I| = {err:.3g})")
    return q


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
    float_tensors.update(float_biases(tensors, types if w8a8 else dict.fromkeys(types, FLOAT)))
    model = build_model(cfg, float_tensors, dtype=dtype, device=device)
    on_device = {k: v.to(device) for k, v in tensors.items()}
    if w8a8:
        install_w8a8(model, on_device, types)
    model.fa3_layers = []
    if fa3:
        install_fa3(model, fa_scales(on_device))
    model.global_rotation = read_rotation(path, cfg.hidden_size)
    if model.global_rotation is not None:
        model.global_rotation = model.global_rotation.to(device)
    return model
