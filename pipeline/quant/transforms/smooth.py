"""Anti-outlier smoothing that leaves the float model's function unchanged and keeps the format.

SmoothQuant between an RMSNorm and the linears it feeds. With per-channel scales s [k]::

    norm(x) * g  ->  norm(x) * (g / s)          (the activation's channel j shrinks by s_j)
    W[:, j]      ->  W[:, j] * s_j              (every linear fed by that norm)
    s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha)    (max over all linears fed; clamped >= eps)

applied to input_layernorm -> (q_a_proj, kv_a_proj_with_mqa) [or q_proj] and q_a_layernorm -> q_b_proj.

Latent smoothing for FA3. The cached latent c = kv_a_layernorm(c_kv) is consumed only through the linear
maps W_UK and W_UV (kv_b_proj), so with d [kv_lora_rank]::

    kv_a_layernorm.weight -> weight / d        (c' = c / d: the int8 per-tensor scale sees balanced channels)
    kv_b_proj.weight[:, j] -> kv_b_proj.weight[:, j] * d_j
    d_j = max|c_j|^alpha / max_h |q_abs_hj|^(1 - alpha)     (q_abs = q_nope @ W_UK, the absorbed query)

Both tensors stay FLOAT, so the output format is unchanged. All scales are computed in float32; the
results are cast back to the weight dtype (the only change to the function is that rounding).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from pipeline.quant.numerics.products import AUTO, KeptWeights, calibration_products

EPS = 1e-5


@dataclass
class ChannelAbsMax:
    """Per-channel max |x| over every token seen; merges exactly (max is associative)."""

    value: torch.Tensor | None = None

    def observe(self, x: torch.Tensor) -> None:
        m = x.detach().abs().flatten(0, -2).amax(0).float()
        self.value = m if self.value is None else torch.maximum(self.value, m)

    def merge(self, other: "ChannelAbsMax") -> "ChannelAbsMax":
        if self.value is None or other.value is None:
            return ChannelAbsMax(other.value if self.value is None else self.value)
        return ChannelAbsMax(torch.maximum(self.value, other.value))


def smooth_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """s = act^alpha / w^(1 - alpha), both [k] float32; channels with no signal keep s = 1."""
    if act_absmax.shape != weight_absmax.shape:
        raise ValueError(f"activation stats {tuple(act_absmax.shape)} and weight stats "
                         f"{tuple(weight_absmax.shape)} must have the same shape")
    if not 0 <= alpha <= 1:
        raise ValueError(f"smoothing alpha must be in [0, 1], got {alpha}")
    a, w = act_absmax.float(), weight_absmax.float()
    s = a.clamp_min(EPS).pow(alpha) / w.clamp_min(EPS).pow(1 - alpha)
    dead = (a <= EPS) | (w <= EPS)
    return torch.where(dead, torch.ones_like(s), s).clamp_min(EPS)


def smooth_norm_linears(norm_weight: torch.Tensor, weights: list[torch.Tensor], act_absmax: torch.Tensor,
                        alpha: float = 0.5) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(norm weight / s, [W * s for each W], s) for a norm feeding ``weights`` ([n_i, k] each)."""
    w_absmax = torch.stack([w.float().abs().amax(0) for w in weights]).amax(0)
    s = smooth_scales(act_absmax, w_absmax, alpha)
    new_norm = (norm_weight.float() / s).to(norm_weight.dtype)
    return new_norm, [(w.float() * s).to(w.dtype) for w in weights], s


def smooth_latent(kv_norm_weight: torch.Tensor, kv_b_weight: torch.Tensor, latent_absmax: torch.Tensor,
                  q_abs_absmax: torch.Tensor, alpha: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_a_layernorm.weight / d, kv_b_proj.weight * d over its input columns, d)."""
    d = smooth_scales(latent_absmax, q_abs_absmax, alpha)
    if kv_b_weight.shape[1] != d.shape[0]:
        raise ValueError(f"kv_b_proj.weight has {kv_b_weight.shape[1]} input columns, latent stats {d.shape[0]}")
    return (kv_norm_weight.float() / d).to(kv_norm_weight.dtype), (kv_b_weight.float() * d).to(kv_b_weight.dtype), d


# ----- on a model -------------------------------------------------------------------------------------
def _attn_prefixes(model) -> dict[str, torch.nn.Module]:
    return {f"model.layers.{layer.layer_id}": layer for layer in model.model.layers}


@contextmanager
def observing_smoothing(model, layer_ids=None, products: str = AUTO,
                        kept: KeptWeights | None = None) -> Iterator[dict[str, ChannelAbsMax]]:
    """While active, forwards through ``layer_ids`` (default: every layer the model holds) update the
    yielded statistics (see :func:`collect_smoothing_stats`); this thread's reduced-precision products
    follow ``products`` (the recipe's ``calib_products``: pipeline.quant.numerics.products; upcast weights kept in
    ``kept``, default: for this activation)."""
    stats: dict[str, ChannelAbsMax] = {}
    handles = []
    wanted = set(layer_ids) if layer_ids is not None else None

    def observer(key):
        stats.setdefault(key, ChannelAbsMax())
        return lambda mod, inp, out=None: stats[key].observe(out if out is not None else inp[0])

    for prefix, layer in _attn_prefixes(model).items():
        if wanted is not None and layer.layer_id not in wanted:
            continue
        attn = layer.self_attn
        handles.append(layer.input_layernorm.register_forward_hook(observer(f"{prefix}.attn_in")))
        if hasattr(attn, "q_a_layernorm"):
            handles.append(attn.q_a_layernorm.register_forward_hook(observer(f"{prefix}.q_b_in")))
        handles.append(attn.kv_a_layernorm.register_forward_hook(observer(f"{prefix}.latent")))
        q_abs = stats.setdefault(f"{prefix}.q_abs", ChannelAbsMax())

        def on_query(mod, inp, out, attn=attn, q_abs=q_abs):
            q_nope = out.unflatten(-1, (attn.H, attn.d_n + attn.d_r))[..., : attn.d_n]
            w_uk, _ = attn.absorbed_weights()
            q_abs.observe(torch.einsum("bshd,hdc->bshc", q_nope.float(), w_uk.float()).abs().amax(-2))

        q_out = attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj
        handles.append(q_out.register_forward_hook(on_query))
    try:
        with calibration_products(products, kept):
            yield stats
    finally:
        for hd in handles:
            hd.remove()


def smoothing_runs_mtp(model, ids_len: int, layer_ids=None) -> bool:
    """Whether the smoothing pass runs the (first) MTP layer on a sample of ``ids_len`` tokens."""
    return bool(model.mtp_layers) and ids_len > 1 and (layer_ids is None or model.mtp_layers[0].layer_id in set(layer_ids))


@torch.no_grad()
def collect_smoothing_stats(model, samples: list[list[int]], layer_ids=None,
                            products: str = AUTO) -> dict[str, ChannelAbsMax]:
    """Per-channel |max| of what smoothing balances, from float forwards of each sample (batch of one):
    ``<layer>.attn_in`` (input_layernorm output), ``<layer>.q_b_in`` (q_a_layernorm output),
    ``<layer>.latent`` (normed latent c) and ``<layer>.q_abs`` (absorbed query, max over heads)."""
    with observing_smoothing(model, layer_ids, products) as stats:
        for ids in samples:
            t = torch.tensor([ids], device=model.lm_head.weight.device)
            h = model.final_hidden(t)
            if smoothing_runs_mtp(model, len(ids), layer_ids):
                model.mtp(h[:, :-1], t[:, 1:])
    return stats


def smoothed_weights(layer_id: int) -> frozenset[str]:
    """The linear weights of layer ``layer_id`` that :func:`smooth_layer` may change."""
    a = f"model.layers.{layer_id}.self_attn."
    return frozenset(a + m + ".weight" for m in ("q_a_proj", "q_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj"))


def smooth_layer(tensors: dict[str, torch.Tensor], layer_id: int, stats: dict[str, ChannelAbsMax],
                 alpha: float = 0.5, latent: bool = True) -> dict[str, torch.Tensor]:
    """One layer's HF-named tensors with smoothing folded in (a new dict; untouched tensors shared).
    The same function serves the in-memory model and the layer-streaming quantizer, so both get
    bit-identical weights."""
    p = f"model.layers.{layer_id}."
    if f"{p[:-1]}.attn_in" not in stats:
        return dict(tensors)
    a = p + "self_attn."
    out = dict(tensors)
    first = [a + "q_a_proj.weight" if a + "q_a_proj.weight" in tensors else a + "q_proj.weight",
             a + "kv_a_proj_with_mqa.weight"]
    g, ws, _ = smooth_norm_linears(tensors[p + "input_layernorm.weight"], [tensors[n] for n in first],
                                   stats[f"{p[:-1]}.attn_in"].value, alpha)
    out[p + "input_layernorm.weight"] = g
    out.update(zip(first, ws))
    if a + "q_a_layernorm.weight" in tensors:
        g, (w,), _ = smooth_norm_linears(tensors[a + "q_a_layernorm.weight"], [tensors[a + "q_b_proj.weight"]],
                                         stats[f"{p[:-1]}.q_b_in"].value, alpha)
        out[a + "q_a_layernorm.weight"], out[a + "q_b_proj.weight"] = g, w
    if latent:
        g, w, _ = smooth_latent(tensors[a + "kv_a_layernorm.weight"], tensors[a + "kv_b_proj.weight"],
                                stats[f"{p[:-1]}.latent"].value, stats[f"{p[:-1]}.q_abs"].value, alpha)
        out[a + "kv_a_layernorm.weight"], out[a + "kv_b_proj.weight"] = g, w
    return out


@torch.no_grad()
def apply_smoothing(model, stats: dict[str, ChannelAbsMax], alpha: float = 0.5, latent: bool = True) -> None:
    """Fold the smoothing scales into the model's norm and linear weights, in place (via smooth_layer)."""
    for layer in model.model.layers:
        p = f"model.layers.{layer.layer_id}."
        params = {p + k: v for k, v in layer.named_parameters()}
        new = smooth_layer(params, layer.layer_id, stats, alpha, latent)
        for k, v in new.items():
            if v is not params[k]:
                params[k].copy_(v)
