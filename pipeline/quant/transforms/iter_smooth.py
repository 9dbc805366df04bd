"""msModelSlim's iter_smooth (the legacy DeepSeek script's default "m4" outlier suppression), bit for bit.

Per subgraph (pipeline.quant.transforms.subgraphs), with a [k] the observed input's channel statistic
(pipeline.quant.transforms.outlier_stats) and w [k] a per-input-column weight statistic::

    w = md(max(f32(w), 1e-5));   s = md(max(f32(a ** alpha / w ** (1 - alpha)), scale_min))

every operation rounded to the model dtype md (bf16 for bf16 checkpoints). Then, by subgraph type:

    norm-linear  w_j = max over every target's rows of |W[:, j]|
                 symmetric: a = max |x|                      shifted (symmetric: False): a, c from the shifted
                                                             trace (c = the channel midpoint, md)
                 W[:, j]  *= s_j                              b_lin = W @ c (torch.mm in md, W before scaling)
                 g        *= md(1 / s)                        b_norm = md(md(-c) * md(1 / s))
                 the norm's output becomes (g x^ + b_norm), the linears' W x + b_lin: the same function.
    ov           w_j = max over o_proj's rows of W_o[:, j], SIGNED (msModelSlim takes the plain max here)
                 a = max |x| of o_proj's input (never shifted)
                 W_o[:, j] *= s_j;  kv_b_proj's value row j (head-major) *= md(1 / s_j)
    up-down      as ov with down_proj for o_proj and up_proj's rows for the value rows (never shifted)

With more heads than key/value heads msModelSlim averages the scales per group; DeepSeek's MLA has one
value head per query head, so the averages are the scales themselves.

Written as msModelSlim writes them: weights and norm weights in md; ``<norm>.bias`` and the linears'
``.bias`` as float32 (holding md values: msModelSlim adds them in md, its saver stores float32). A norm
or linear that already has a bias keeps it, folded the same way (b_norm = md(b * md(1 / s)) + ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from pipeline.config import DeepseekV3Config
from pipeline.quant.transforms.outlier_stats import ChannelTrace
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.steps import IterSmooth
from pipeline.quant.transforms.subgraphs import NORM_LINEAR, Subgraph, need, smooth_subgraphs, step_subgraphs

STEP = "iter_smooth"
W_MIN = 1e-5      # the clamp of the weight statistic


def shifts(step: IterSmooth, sg: Subgraph) -> bool:
    """Is ``sg`` shifted? Only norm-linear subgraphs, and only when the step is not symmetric."""
    return sg.kind == NORM_LINEAR and not step.symmetric


# ----- the formulas -----------------------------------------------------------------------------------
def balance_scales(act: Tensor, weight_stat: Tensor, alpha: float, beta: float, scale_min: float,
                   step: str = STEP) -> Tensor:
    """s = md(max(f32(a ** alpha / md(max(f32(w), 1e-5)) ** beta), scale_min)), md = w's dtype: the scale
    formula of both steps (iter_smooth: beta = 1 - alpha)."""
    if act.shape != weight_stat.shape:
        raise QuantError(f"{step}: activation statistic {list(act.shape)} and weight statistic "
                         f"{list(weight_stat.shape)} differ in shape")
    md = weight_stat.dtype
    w = weight_stat.float().clamp(min=W_MIN).to(md)
    return (act.to(md).pow(alpha) / w.pow(beta)).float().clamp(min=scale_min).to(md)


def iter_scales(act: Tensor, weight_stat: Tensor, alpha: float, scale_min: float) -> Tensor:
    """iter_smooth's s = md(max(f32(a ** alpha / md(max(f32(w), 1e-5)) ** (1 - alpha)), scale_min))."""
    return balance_scales(act, weight_stat, alpha, 1 - alpha, scale_min)


@dataclass(frozen=True)
class NormLinearResult:
    norm_weight: Tensor
    norm_bias: Optional[Tensor]          # float32, or None (symmetric and the norm had none)
    weights: list[Tensor]
    biases: list[Optional[Tensor]]       # float32 per linear, or None
    scales: Tensor


def smooth_norm_linear(norm_weight: Tensor, weights: Sequence[Tensor], act: Tensor, alpha: float,
                       scale_min: float, shift: Optional[Tensor] = None, norm_bias: Optional[Tensor] = None,
                       biases: Optional[Sequence[Optional[Tensor]]] = None) -> NormLinearResult:
    """A norm (weight g [k], optional bias) feeding linears W_i [n_i, k] (optional biases), with the
    observed statistic ``act`` [k] and, when shifted, the shift c [k] (both md: ChannelTrace)."""
    md = norm_weight.dtype
    k = norm_weight.shape[0]
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != k or w.dtype != md:
            raise QuantError(f"iter_smooth: linear {i} is {w.dtype} {list(w.shape)}, expected {md} [n, {k}]")
    w_stat = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
    s = iter_scales(act, w_stat, alpha, scale_min)
    inv = 1.0 / s
    biases = list(biases) if biases is not None else [None] * len(weights)
    new_biases: list[Optional[Tensor]] = []
    b_norm = None if norm_bias is None else norm_bias.to(md) * inv
    if shift is not None:
        c = shift.to(md)
        for w, b in zip(weights, biases):
            b_lin = torch.mm(c.unsqueeze(0), w.T).squeeze(0)
            new_biases.append((b_lin if b is None else b.to(md) + b_lin).float())
        norm_shift = c * -1 * inv
        b_norm = norm_shift if b_norm is None else b_norm + norm_shift
    else:
        new_biases = [None if b is None else b.float() for b in biases]
    return NormLinearResult(norm_weight * inv, None if b_norm is None else b_norm.float(),
                            [w * s.view(1, -1) for w in weights], new_biases, s)


def smooth_pair(producer_rows: Tensor, consumer: Tensor, act: Tensor, alpha: float,
                scale_min: float) -> tuple[Tensor, Tensor, Tensor]:
    """ov / up-down: the producer's output rows P [k, C] (kv_b_proj's value rows, up_proj) and the
    consumer W [n, k] (o_proj, down_proj) -> (P * md(1 / s) per row, W * s per column, s), with the
    consumer's SIGNED column maximum as the weight statistic."""
    if consumer.dim() != 2 or producer_rows.dim() != 2 or producer_rows.shape[0] != consumer.shape[1]:
        raise QuantError(f"iter_smooth: producer rows {list(producer_rows.shape)} do not feed consumer "
                         f"{list(consumer.shape)}")
    s = iter_scales(act, consumer.amax(0), alpha, scale_min)
    return producer_rows * (1.0 / s).view(-1, 1), consumer * s.view(1, -1), s


# ----- a layer ----------------------------------------------------------------------------------------
def iter_smooth_layer(tensors: Mapping[str, Tensor], layer_id: int, cfg: DeepseekV3Config,
                      stats: Mapping[str, ChannelTrace], step: IterSmooth) -> dict[str, Tensor]:
    """Layer ``layer_id``'s HF-named tensors with iter_smooth folded in: a new dict (untouched tensors
    shared) with the rewritten weights and the new biases (``<norm>.bias``, ``<linear>.bias``).
    ``stats``: the ChannelTrace of each smoothed subgraph's observed module (observing_subgraphs over
    ``step_subgraphs(step, cfg, layer_id)``), from a forward of the layer as it is before this step.
    A routed expert that saw no token is left as it is (msModelSlim skips it)."""

    def norm_rule(sg: Subgraph, cur: Mapping[str, Tensor], trace: ChannelTrace) -> dict:
        act, shift = trace.shifted_absmax() if shifts(step, sg) else (trace.absmax(), None)
        r = smooth_norm_linear(need(cur, sg.source + ".weight", STEP),
                               [need(cur, t + ".weight", STEP) for t in sg.targets], act, step.alpha,
                               step.scale_min, shift, cur.get(sg.source + ".bias"),
                               [cur.get(t + ".bias") for t in sg.targets])
        new = {sg.source + ".weight": r.norm_weight, **{t + ".weight": w for t, w in zip(sg.targets, r.weights)}}
        if r.norm_bias is not None:
            new[sg.source + ".bias"] = r.norm_bias
        new.update({t + ".bias": b for t, b in zip(sg.targets, r.biases) if b is not None})
        return new

    def pair_rule(sg: Subgraph, rows: Tensor, consumer: Tensor, trace: ChannelTrace) -> tuple[Tensor, Tensor]:
        return smooth_pair(rows, consumer, trace.absmax(), step.alpha, step.scale_min)[:2]

    return smooth_subgraphs(STEP, tensors, cfg, step_subgraphs(step, cfg, layer_id), stats, norm_rule, pair_rule)
