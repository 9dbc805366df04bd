"""The float weight of each quantized linear, in the basis of the quantized model that holds it.

A quantized linear's error is measured on its own input in the quantized model's forward: its output
against ``x @ W_ref.T + b_ref``. When the output was written from the float weights as they are (the
project's default, ``--dynamic``, msModelSlim without anti-outlier steps), W_ref is the float weight. An
anti-outlier step or a rotation changes the basis of the linear's input (and, for residual-stream
writers under QuaRot, of its output) while keeping the function; the files say how, and W_ref follows:

    norm -> linear   the quantized norm gives x' = (x_hat R) * g' + b'  where the float norm gives
                     x = x_hat * g:  x = ((x' - b') / g') R^T * g.  R = Q (the global rotation) for the
                     residual stream's norms under QuaRot, else I; g' / b' the stored norm weight / bias
                     (smoothing scales and shifts show up there)
    o_proj           its input is the attention's value mix, whose channels follow kv_b_proj's value rows:
                     a row scaled by t (msModelSlim's ov smoothing) gives x = x' / t, t fitted per row
                     between the stored and the float kv_b_proj (after any latent-column fold, which the
                     kv_a_layernorm weights give)
    down_proj        the MLP's intermediate: unchanged
    output           residual-stream writers (o_proj, every down_proj) under QuaRot: y' = y @ Q

    W_ref = R_out^T ((W * g) R / g'),   b_ref = -W_ref b'   (columns scaled by g, 1/g'; rows by R_out)

Where the files do not give the basis (QuaRot's rotations of q_lora, kv_lora and the value heads are
folded into the weights and not stored), the mapped float weight no longer matches the dequantized one;
a linear whose W_ref is not within ``MATCH_DB`` of its dequantized weight is measured against the
dequantized weight instead (its activation error only), and its row says so (``reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pipeline.model import DeepseekV3ForCausalLM
from pipeline.model.norm import RMSNorm
from pipeline.quant.evaluation.fakequant import QuantLinear

# The float weight mapped into the quantized basis must be this close (SQNR against the dequantized weight)
# to serve as the reference. Per-channel int8 weights sit at 35-45 dB; a wrong basis is below 5 dB.
MATCH_DB = 15.0
FLOAT_REF, DEQUANT_REF = "float", "dequantized"


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """10 log10(sum ref^2 / sum (ref - got)^2), inf when equal."""
    import math

    err = (ref.double() - got.double()).pow(2).sum().item()
    sig = ref.double().pow(2).sum().item()
    return math.inf if err == 0 else (10 * math.log10(sig / err) if sig > 0 else -math.inf)


@dataclass
class LinearRef:
    """What a quantized linear's output is measured against: ``x @ weight.T + bias`` (float32)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    reference: str                 # FLOAT_REF or DEQUANT_REF
    weight_sqnr_db: Optional[float]  # mapped float weight vs dequantized (None: no float counterpart)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() @ self.weight.T
        return y if self.bias is None else y + self.bias


def _norm_map(fnorm: RMSNorm, qnorm: RMSNorm, rotation: Optional[torch.Tensor]):
    g = fnorm.weight.detach().float()
    gq = qnorm.weight.detach().float()
    inv = torch.where(gq != 0, 1.0 / gq, torch.zeros_like(gq))
    bq = getattr(qnorm, "bias", None)
    return g, inv, rotation, (bq.float() if bq is not None else None)


def _value_rows(fl: DeepseekV3ForCausalLM, ql: DeepseekV3ForCausalLM, attn: str) -> torch.Tensor:
    """t per value channel (H * d_v): stored kv_b_proj value rows over the float ones (after the latent
    column fold), least squares per row."""
    fa, qa = fl.get_submodule(attn), ql.get_submodule(attn)
    d = fa.kv_a_layernorm.weight.float() / qa.kv_a_layernorm.weight.float()
    wf = fa.kv_b_proj.weight.float() * d
    wq = qa.kv_b_proj.weight.float()
    rows = wf.view(fa.H, fa.d_n + fa.d_v, fa.C)[:, fa.d_n:].reshape(-1, fa.C)
    rq = wq.view(fa.H, fa.d_n + fa.d_v, fa.C)[:, fa.d_n:].reshape(-1, fa.C)
    den = rows.pow(2).sum(1)
    return torch.where(den > 0, (rows * rq).sum(1) / den.clamp_min(1e-30), torch.ones_like(den))


def _input_map(name: str, fl, ql, rotation):
    """(g, 1/g', R, b') for a norm-fed linear, ('scale', s) for o_proj, None when unchanged."""
    layer_prefix, rest = name.split(".self_attn.") if ".self_attn." in name else name.split(".mlp.")
    leaf = name.rsplit(".", 1)[1]
    if ".self_attn." in name:
        attn = layer_prefix + ".self_attn"
        if leaf in ("q_a_proj", "q_proj", "kv_a_proj_with_mqa"):
            return _norm_map(fl.get_submodule(layer_prefix + ".input_layernorm"),
                             ql.get_submodule(layer_prefix + ".input_layernorm"), rotation)
        if leaf == "q_b_proj":
            return _norm_map(fl.get_submodule(attn + ".q_a_layernorm"), ql.get_submodule(attn + ".q_a_layernorm"), None)
        if leaf == "o_proj":
            t = _value_rows(fl, ql, attn)
            return ("scale", torch.where(t != 0, 1.0 / t, torch.zeros_like(t)))
        return None
    if leaf in ("gate_proj", "up_proj"):
        post = layer_prefix + ".post_attention_layernorm"
        return _norm_map(fl.get_submodule(post), ql.get_submodule(post), rotation)
    return None


def linear_ref(name: str, float_model: DeepseekV3ForCausalLM, quant_model: DeepseekV3ForCausalLM,
               rotation: Optional[torch.Tensor] = None) -> LinearRef:
    """The reference of quantized linear ``name`` of ``quant_model`` (module doc)."""
    q: QuantLinear = quant_model.get_submodule(name)
    deq = q.dequantized_weight()
    f = float_model.get_submodule(name) if _has(float_model, name) else None
    if not isinstance(f, nn.Linear) or tuple(f.weight.shape) != tuple(deq.shape):
        return LinearRef(deq, q.dequantized_bias(), DEQUANT_REF, None)
    w = f.weight.detach().float()
    b = None
    m = _input_map(name, float_model, quant_model, rotation)
    if m is not None and m[0] == "scale":
        w = w * m[1]
    elif m is not None:
        g, inv, rot, bq = m
        w = w * g
        if rot is not None:
            w = w @ rot
        w = w * inv
        if bq is not None:
            b = -(w @ bq)
    leaf = name.rsplit(".", 1)[1]
    if rotation is not None and leaf in ("o_proj", "down_proj"):
        w = rotation.T @ w
        b = None if b is None else rotation.T @ b
    match = sqnr_db(w, deq)
    if match < MATCH_DB:
        return LinearRef(deq, q.dequantized_bias(), DEQUANT_REF, round(match, 3))
    return LinearRef(w, b, FLOAT_REF, round(match, 3))


def _has(model, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False
