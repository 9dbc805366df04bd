"""msModelSlim's flex_smooth_quant: SmoothQuant with alpha and beta searched per subgraph, bit for bit.

Per subgraph (pipeline.quant.transforms.subgraphs), X [N, k] every observed token row (outlier_stats.ActivationRows)
and W [n, k] the weights the search multiplies (the norm's targets stacked; o_proj; down_proj), all in the
model dtype md, each operation rounded to md::

    error(alpha, beta):
        Y   = X @ W.T                         ref = mean(Y ** 2) ** 0.5
        f   = max_t |X[t, :]| ** alpha * max_i |W[i, :]| ** (-beta)                  [1, k]
        Xq  = fake8(X / f)   Wq = fake8(W * f)
        fake8(r) = round(r / d).clip(-127, 127) * d,  d = max|r| / 127 per row
        err = mean(|Xq @ Wq.T - Y| ** 2) ** 0.5 / ref                                 (a Python float of md)
    grid  = 0, 0.05, ..., 1 (21 values)
    alpha = the last grid value with the smallest error(alpha, 1 - alpha)            ("<=": ties go up)
    beta  = the last grid value with error(alpha, beta) <= every error so far, starting from alpha's;
            beta = 1 - alpha is on the grid and ties, so beta is never worse than 1 - alpha
    s     = md(max(f32(a ** alpha / w ** beta), 1e-5)),   a = max |X| per channel,
            w = md(max(f32(max_i |W[i, j]|), 1e-5))       (the absolute column maximum, for every type)

then folded as iter_smooth folds it, never shifted: the norm's weight *= md(1 / s) and every target's
columns *= s (norm-linear); o_proj's columns *= s and kv_b_proj's value rows *= md(1 / s) (ov; msModelSlim
computes the DeepSeek ov scales per head group with its "max" method, which for one value head per query
head is the same s); down_proj's columns *= s and up_proj's rows *= md(1 / s) (up-down).

A step with both ``alpha`` and ``beta`` set uses them as given; with either missing, both are searched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from pipeline.config import DeepseekV3Config
from pipeline.quant.transforms.iter_smooth import balance_scales
from pipeline.quant.transforms.outlier_stats import ActivationRows
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.steps import FlexSmooth
from pipeline.quant.transforms.subgraphs import Subgraph, need, smooth_subgraphs, step_subgraphs

log = logging.getLogger(__name__)
STEP = "flex_smooth_quant"
GRID = tuple(k * 5 / 100 for k in range(21))   # 0.0, 0.05, ..., 1.0: the float64 values numpy's rounded grid holds
SCALE_MIN = 1e-5


# ----- the search -------------------------------------------------------------------------------------
def _fake_int8_rows(r: Tensor) -> Tensor:
    step = torch.abs(r).max(dim=-1, keepdim=True)[0] / 127
    return torch.round(r / step).clip(min=-127, max=127) * step


class _Search:
    """error(alpha, beta) of one subgraph; what does not depend on (alpha, beta) computed once."""

    def __init__(self, x: Tensor, w: Tensor):
        if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype:
            raise QuantError(f"flex_smooth_quant: activations {x.dtype} {list(x.shape)} and weights "
                             f"{w.dtype} {list(w.shape)} do not match")
        self.x, self.w = x, w
        self.y = torch.matmul(x, w.T)
        self.ref = torch.mean(self.y ** 2) ** 0.5
        self.x_max = torch.max(torch.abs(x), dim=0, keepdim=True)[0]
        self.w_max = torch.max(torch.abs(w), dim=0, keepdim=True)[0]

    def error(self, alpha: float, beta: float) -> float:
        f = self.x_max ** alpha * self.w_max ** (-beta)
        yq = torch.matmul(_fake_int8_rows(self.x / f), _fake_int8_rows(self.w * f).T)
        return ((torch.mean(torch.abs(yq - self.y) ** 2) ** 0.5) / self.ref).item()


def pick_alpha_beta(error: Callable[[float, float], float]) -> tuple[float, float, float]:
    """msModelSlim's selection over GRID given error(alpha, beta): alpha the last minimiser of
    error(alpha, 1 - alpha); then beta the last grid value whose error is <= the best so far (starting
    from alpha's; 0.0 if none). Returns (alpha, beta, error)."""
    alpha, best = 0.0, float("inf")
    for a in GRID:
        err = error(a, 1.0 - a)
        if err <= best:
            alpha, best = a, err
    beta = 0.0
    for b in GRID:
        err = error(alpha, b)
        if err <= best:
            beta, best = b, err
    return alpha, beta, best


def search_alpha_beta(x: Tensor, w: Tensor) -> tuple[float, float, float]:
    """(alpha, beta, error) for activations x [N, k] and weights w [n, k] (both md): module docstring."""
    return pick_alpha_beta(_Search(x, w).error)


def flex_scales(act_max: Tensor, weight_max: Tensor, alpha: float, beta: float) -> Tensor:
    """s = md(max(f32(a ** alpha / md(max(f32(w), 1e-5)) ** beta), 1e-5)) (a and w in md)."""
    return balance_scales(act_max, weight_max, alpha, beta, SCALE_MIN, STEP)


@dataclass(frozen=True)
class FlexChoice:
    """What the search chose for one subgraph (or the step's fixed values)."""

    alpha: float
    beta: float
    error: Optional[float]    # None when not searched


def choose(x: Tensor, w: Tensor, step: FlexSmooth) -> FlexChoice:
    """The step's alpha / beta when both are set, else the search's (msModelSlim ignores a lone one)."""
    if step.alpha is not None and step.beta is not None:
        return FlexChoice(step.alpha, step.beta, None)
    return FlexChoice(*search_alpha_beta(x, w))


def smooth_norm_linear(norm_weight: Tensor, weights: Sequence[Tensor], x: Tensor,
                       step: FlexSmooth) -> tuple[Tensor, list[Tensor], Tensor, FlexChoice]:
    """A norm (weight g [k]) feeding linears W_i [n_i, k], observed rows x [N, k] (md) ->
    (g * md(1 / s), [W_i * s], s, choice)."""
    md = norm_weight.dtype
    k = norm_weight.shape[0]
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != k or w.dtype != md:
            raise QuantError(f"flex_smooth_quant: linear {i} is {w.dtype} {list(w.shape)}, expected {md} [n, {k}]")
    x = x.to(md)
    c = choose(x, torch.cat(list(weights), 0), step)
    w_max = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
    s = flex_scales(torch.abs(x).amax(0), w_max, c.alpha, c.beta)
    return norm_weight * (1.0 / s), [w * s.view(1, -1) for w in weights], s, c


def smooth_pair(producer_rows: Tensor, consumer: Tensor, x: Tensor,
                step: FlexSmooth) -> tuple[Tensor, Tensor, Tensor, FlexChoice]:
    """ov / up-down: producer rows P [k, C], consumer W [n, k], the consumer's observed input rows x [N, k]
    -> (P * md(1 / s) per row, W * s per column, s, choice)."""
    if consumer.dim() != 2 or producer_rows.dim() != 2 or producer_rows.shape[0] != consumer.shape[1]:
        raise QuantError(f"flex_smooth_quant: producer rows {list(producer_rows.shape)} do not feed consumer "
                         f"{list(consumer.shape)}")
    x = x.to(consumer.dtype)
    c = choose(x, consumer, step)
    s = flex_scales(torch.abs(x).amax(0), consumer.abs().amax(0), c.alpha, c.beta)
    return producer_rows * (1.0 / s).view(-1, 1), consumer * s.view(1, -1), s, c


# ----- a layer ----------------------------------------------------------------------------------------
def flex_smooth_layer(tensors: Mapping[str, Tensor], layer_id: int, cfg: DeepseekV3Config,
                      stats: Mapping[str, ActivationRows], step: FlexSmooth,
                      choices: Optional[dict[str, FlexChoice]] = None) -> dict[str, Tensor]:
    """Layer ``layer_id``'s HF-named tensors with flex_smooth_quant folded in: a new dict (untouched
    tensors shared; no new tensor: the smoothing is symmetric). ``stats``: the ActivationRows of each
    smoothed subgraph's observed module (observing_subgraphs over ``step_subgraphs(step, cfg, layer_id)``),
    from a forward of the layer as it is before this step. ``choices``, when given, receives each
    subgraph's alpha / beta by its source module's name. A routed expert that saw no token is left as
    it is."""

    def record(name: str, c: FlexChoice) -> None:
        log.debug("%s %s: alpha %s beta %s error %s", STEP, name, c.alpha, c.beta, c.error)
        if choices is not None:
            choices[name] = c

    def norm_rule(sg: Subgraph, cur: Mapping[str, Tensor], rows: ActivationRows) -> dict:
        names = [t + ".weight" for t in sg.targets]
        g, ws, _, c = smooth_norm_linear(need(cur, sg.source + ".weight", STEP), [need(cur, n, STEP) for n in names],
                                         rows.tensor(), step)
        record(sg.source, c)
        return {sg.source + ".weight": g, **dict(zip(names, ws))}

    def pair_rule(sg: Subgraph, producer: Tensor, consumer: Tensor, rows: ActivationRows) -> tuple[Tensor, Tensor]:
        p, w, _, c = smooth_pair(producer, consumer, rows.tensor(), step)
        record(sg.source, c)
        return p, w

    return smooth_subgraphs(STEP, tensors, cfg, step_subgraphs(step, cfg, layer_id), stats, norm_rule, pair_rule)
