"""Calibrate one layer as msModelSlim's v1 runner does (docs/recipes.md, "Calibration"), with the arithmetic
of DeepSeek's modeling code (pipeline.quant.calibration.remote_numerics):

    for layer i, every sample in dataset order, batch of one, the input h_j of the layer:
    1. the recipe's steps, as its plan lists them (pipeline.quant.transforms.recipe_plan): quarot folds its
       rotations in (no data); iter_smooth / flex_smooth_quant (main layers only) observe a float forward of
       the layer as it is and fold their scales in; dsquant's own ``smooth`` last
    2. the linears' pass (only when the layer has a W8A8 linear): eager attention through CalibLinears
       (each W8A8 input fake-quantized with its running range), the ranges -> (s, o)
    3. the FA3 pass (when the recipe has fa3_quant): DeployedLinears, absorbed attention where the layer
       has FA3 (observing fa_q / fa_k / fa_v), eager elsewhere
    -> the layer's statistics, and its input for layer i + 1: the output of the last pass that ran

The MTP layer's input is made from the last main layer's output (remote_numerics.mtp_input). The passes
run under the recipe's ``products`` (``calib_products``; auto: the model dtype's own matmuls) (pipeline.quant.numerics.products).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
from torch import Tensor

from pipeline.config import DeepseekV3Config
from pipeline.format.description import FAQUANT, W8A8, W8A8_DYNAMIC
from pipeline.quant.calibration import remote_numerics as rn
from pipeline.quant.calibration.calib_linears import (CalibLinears, DeployedLinears, FakeQuantWeights, FloatLinears,
                                                      final_params)
from pipeline.quant.numerics.observers import RecallWindow, Stats
from pipeline.quant.numerics.products import KeptWeights, calibration_products
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.transforms.recipe_plan import LayerRun, resolve

Tensors = dict[str, Tensor]


@dataclass
class Sample:
    """One calibration sample at a layer boundary: its ids [1, T], the layer's input h [1, T, hidden] (md),
    its positions [1, T] and the dtype of its causal mask (md; float32 for the MTP layer, as msModelSlim)."""

    ids: Tensor
    h: Optional[Tensor]
    pos: Tensor
    mask_dtype: torch.dtype


def first_samples(ids: list[Tensor], embed: Tensor) -> list[Sample]:
    """The samples at layer 0: the embedding lookup."""
    return [Sample(t, embed[t], torch.arange(t.shape[1], device=t.device)[None], embed.dtype) for t in ids]


@dataclass
class LayerResult:
    stats: Stats
    tensors: Tensors                     # the layer's float tensors with every step folded in
    samples: Optional[list[Sample]]      # the next layer's inputs (None: no pass ran)
    choices: dict = field(default_factory=dict)  # flex_smooth_quant's alpha / beta per subgraph


class LayerCalibrator:
    """The passes of the module doc for a model ``cfg`` and ``recipe``, resolved once
    (pipeline.quant.transforms.recipe_plan); ``rope`` tables cover the longest sample. ``smooth_alpha``:
    dsquant's own smoothing."""

    def __init__(self, cfg: DeepseekV3Config, recipe: Recipe, max_tokens: int, smooth_alpha: float = 0.5):
        self.cfg, self.recipe, self.smooth_alpha = cfg, recipe, smooth_alpha
        self.plan = resolve(recipe, cfg)
        self.rope = rn.RopeTables.of(cfg, max(max_tokens, 1) + 1)

    # ----- the steps -----------------------------------------------------------------------------------
    def transform_globals(self, g: Mapping[str, Tensor]) -> Tensors:
        """The globals (embedding, final norm, head) with the recipe's steps folded in."""
        return self.plan.transform_globals(g)

    def transform_layer(self, i: int, t: Mapping[str, Tensor]) -> Tensors:
        """A layer no pass runs on (the MTP layer kept float): its data-free steps (quarot) folded in."""
        return self.plan.transform_layer(i, t)

    def _forward(self, t: Mapping[str, Tensor], i: int, samples: list[Sample], lin, absorbed: bool,
                 fa=None, attention_only: bool = False) -> list[Optional[Tensor]]:
        out = []
        for s in samples:
            out.append(rn.decoder_layer(t, self.cfg, i, s.h, s.pos, self.rope, lin, absorbed, s.mask_dtype, fa,
                                        attention_only))
        return out

    def _layer_run(self, i: int, samples: list[Sample], choices: dict) -> LayerRun:
        """Layer ``i``'s float forwards on ``samples``, for the steps."""
        def float_forward(t, observers, attention_only):
            return self._forward(t, i, samples, FloatLinears(t, observers), absorbed=False,
                                 attention_only=attention_only)

        def absorbed_forward(t, observers, fa):
            return self._forward(t, i, samples, FloatLinears(t, observers), absorbed=True, fa=fa, attention_only=True)

        return LayerRun(i, float_forward, absorbed_forward, choices, self.smooth_alpha)

    def float_pass(self, i: int, t: Mapping[str, Tensor], samples: list[Sample]) -> list[Sample]:
        """The next layer's inputs through layer ``i`` as it is, when none of its passes ran a forward."""
        with calibration_products(self.recipe.products):
            outs = self._forward(t, i, samples, FloatLinears(t), absorbed=False)
        return [Sample(s.ids, o, s.pos, s.mask_dtype) for s, o in zip(samples, outs)]

    # ----- a layer -------------------------------------------------------------------------------------
    def run(self, i: int, t: Mapping[str, Tensor], samples: list[Sample], heads: Optional[Mapping[str, Tensor]] = None,
            kept: Optional[KeptWeights] = None) -> LayerResult:
        """Layer ``i`` (its float tensors in md, HF names) on ``samples`` (module doc). For the MTP layer,
        ``samples`` hold the last main layer's outputs and ``heads`` the transformed final norm and head
        (:meth:`transform_globals`): its inputs are made here, after its steps."""
        cfg, plan = self.cfg, self.plan
        t = dict(t)
        choices: dict = {}
        last: Optional[list] = None
        with calibration_products(self.recipe.products, kept):
            run = self._layer_run(i, samples, choices)
            for step in plan.steps:
                if step.runs_on(cfg, i):
                    t, outs = step.apply(t, run)
                    last = outs or last
            if i >= cfg.num_hidden_layers and samples and samples[0].h is not None and heads is not None:
                samples = mtp_samples(cfg, i, t, heads, samples, samples[0].h.dtype)
            run = self._layer_run(i, samples, choices)
            for step in plan.fed_steps:
                if step.runs_on(cfg, i):
                    t, _ = step.apply(t, run)
            types = self.recipe.layer_types(cfg, i)
            kinds = {p: k for p, k in types.items() if k in (W8A8, W8A8_DYNAMIC)}
            stats: dict = {}
            params = {}
            weights = FakeQuantWeights(t)   # one layer's fake-quantized weights, for both passes
            if any(k == W8A8 for k in kinds.values()):
                calib = CalibLinears(t, kinds, weights)
                outs = self._forward(t, i, samples, calib, absorbed=False, attention_only=plan.fa3_pass)
                stats.update(calib.minmax())
                params = final_params(calib.ranges, t[next(iter(kinds)) + ".weight"].dtype)
                if not plan.fa3_pass:
                    last = outs
            if plan.fa3_pass:
                fa_layer = any(k == FAQUANT for k in types.values())
                windows: dict[str, RecallWindow] = {}

                def fa(name: str, x: Tensor, ratio: float) -> None:
                    w = RecallWindow.observe(x[0].reshape(x.shape[1], -1), ratio, name)
                    windows[name] = windows[name].merge(w) if name in windows else w

                last = self._forward(t, i, samples, DeployedLinears(t, kinds, params, weights), absorbed=fa_layer,
                                     fa=fa if fa_layer else None)
                stats.update(windows)
        nxt = None
        if last is not None and all(o is not None for o in last):
            nxt = [Sample(s.ids, o, s.pos, s.mask_dtype) for s, o in zip(samples, last)]
        return LayerResult(Stats(dict(sorted(stats.items()))), t, nxt, choices)


def mtp_samples(cfg: DeepseekV3Config, layer_id: int, t: Mapping[str, Tensor], g: Mapping[str, Tensor],
                samples: list[Sample], md: torch.dtype) -> list[Sample]:
    """The MTP layer's inputs from the last main layer's outputs (remote_numerics.mtp_input)."""
    out = []
    for s in samples:
        x, pos = rn.mtp_input(t, g, cfg, layer_id, s.h, s.ids, md)
        out.append(Sample(s.ids, x, pos, torch.float32))
    return out


def heads_for_mtp(g: Mapping[str, Tensor], cfg: DeepseekV3Config) -> Tensors:
    """What the MTP feed needs of the (transformed) globals: the final norm and the head."""
    kept = {n: g[n] for n in ("model.norm.weight", "lm_head.weight") if n in g}
    if "lm_head.weight" not in kept and cfg.tie_word_embeddings:
        kept["lm_head.weight"] = g["model.embed_tokens.weight"]
    return kept
