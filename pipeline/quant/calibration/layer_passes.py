"""Calibrate one layer as msModelSlim's v1 runner does (docs/recipes.md, "Calibration"), with the arithmetic
of DeepSeek's modeling code (pipeline.quant.calibration.remote_numerics):

    for layer i, every sample in dataset order, batch of one, the input h_j of the layer:
    1. the recipe's steps: quarot folds its rotations in (no data); iter_smooth / flex_smooth_quant (main
       layers only) observe a float forward of the layer as it is and fold their scales in; dsquant's own
       ``smooth`` last
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
from pipeline.quant.calibration.calib_linears import CalibLinears, DeployedLinears, FloatLinears, final_params
from pipeline.quant.numerics.observers import RecallWindow, Stats
from pipeline.quant.numerics.products import KeptWeights, calibration_products
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.transforms.smooth import ChannelAbsMax, smooth_layer
from pipeline.quant.recipe.steps import FlexSmooth, IterSmooth, QuaRot

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
    """The passes of the module doc for a model ``cfg`` and ``recipe``; ``rope`` tables cover the longest
    sample. ``smooth_alpha``: dsquant's own smoothing."""

    def __init__(self, cfg: DeepseekV3Config, recipe: Recipe, max_tokens: int, smooth_alpha: float = 0.5):
        from pipeline.quant.transforms.quarot import build_rotations

        self.cfg, self.recipe, self.smooth_alpha = cfg, recipe, smooth_alpha
        self.rope = rn.RopeTables.of(cfg, max(max_tokens, 1) + 1)
        quarot = [s for s in recipe.steps if isinstance(s, QuaRot)]
        self.rotations = build_rotations(cfg, quarot[0].block_size) if quarot else None
        if quarot and cfg.tie_word_embeddings:
            raise QuantError("quarot: a model with tied embeddings is not supported (the rotated head would differ "
                             "from the embedding)")

    # ----- the steps -----------------------------------------------------------------------------------
    def transform_globals(self, g: Mapping[str, Tensor]) -> Tensors:
        """The globals (embedding, final norm, head) with the recipe's steps folded in."""
        from pipeline.quant.transforms.quarot import rotate_globals

        return rotate_globals(g, self.cfg, self.rotations) if self.rotations is not None else dict(g)

    def _forward(self, t: Mapping[str, Tensor], i: int, samples: list[Sample], lin, absorbed: bool,
                 fa=None, attention_only: bool = False) -> list[Optional[Tensor]]:
        out = []
        for s in samples:
            out.append(rn.decoder_layer(t, self.cfg, i, s.h, s.pos, self.rope, lin, absorbed, s.mask_dtype, fa,
                                        attention_only))
        return out

    def _anti_outlier(self, step, t: Tensors, i: int, samples: list[Sample], choices: dict) -> tuple[Tensors, list]:
        from pipeline.quant.transforms.flex_smooth import flex_smooth_layer
        from pipeline.quant.transforms.iter_smooth import iter_smooth_layer
        from pipeline.quant.transforms.outlier_stats import ActivationRows, ChannelTrace
        from pipeline.quant.transforms.subgraphs import step_subgraphs

        iterative = isinstance(step, IterSmooth)
        subgraphs = step_subgraphs(step, self.cfg, i)
        if not subgraphs:
            return t, []
        kind = ChannelTrace if iterative else ActivationRows
        observers = {sg.observed: kind() for sg in subgraphs}
        mlp_needed = any(".mlp." in n for n in observers)
        outs = self._forward(t, i, samples, FloatLinears(t, observers), absorbed=False, attention_only=not mlp_needed)
        if iterative:
            return iter_smooth_layer(t, i, self.cfg, observers, step), outs
        return flex_smooth_layer(t, i, self.cfg, observers, step, choices), outs

    def _own_smooth(self, t: Tensors, i: int, samples: list[Sample]) -> tuple[Tensors, list]:
        """dsquant's SmoothQuant + latent smoothing (pipeline.quant.transforms.smooth), its statistics from a float
        absorbed forward."""
        p = f"model.layers.{i}"
        stats = {k: ChannelAbsMax() for k in (f"{p}.attn_in", f"{p}.q_b_in", f"{p}.latent", f"{p}.q_abs")}
        first = f"{p}.self_attn." + ("q_a_proj" if self.cfg.q_lora_rank else "q_proj")
        observers = {first: stats[f"{p}.attn_in"], f"{p}.self_attn.q_b_proj": stats[f"{p}.q_b_in"]}

        def fa(name: str, x: Tensor, ratio: float) -> None:
            if name.endswith("fa_q"):
                stats[f"{p}.q_abs"].observe(x.float().abs().amax(1))
            elif name.endswith("fa_k"):
                stats[f"{p}.latent"].observe(x[:, 0])

        outs = self._forward(t, i, samples, FloatLinears(t, observers), absorbed=True, fa=fa, attention_only=True)
        return smooth_layer(t, i, stats, self.smooth_alpha), outs

    def transform_layer(self, i: int, t: Mapping[str, Tensor]) -> Tensors:
        """A layer no pass runs on (the MTP layer kept float): its data-free steps (quarot) folded in."""
        from pipeline.quant.transforms.quarot import rotate_layer

        return rotate_layer(t, i, self.cfg, self.rotations) if self.rotations is not None else dict(t)

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
        cfg, recipe = self.cfg, self.recipe
        t = dict(t)
        is_mtp = i >= cfg.num_hidden_layers
        choices: dict = {}
        last: Optional[list] = None
        with calibration_products(recipe.products, kept):
            for step in recipe.steps:
                if isinstance(step, QuaRot):
                    from pipeline.quant.transforms.quarot import rotate_layer

                    t = rotate_layer(t, i, cfg, self.rotations)
                elif not is_mtp and isinstance(step, (IterSmooth, FlexSmooth)):
                    t, outs = self._anti_outlier(step, t, i, samples, choices)
                    last = outs or last
            if is_mtp and samples and samples[0].h is not None and heads is not None:
                md = samples[0].h.dtype
                samples = mtp_samples(cfg, i, t, heads, samples, md)
            if recipe.smooth and (not is_mtp or recipe.quantize_mtp):
                t, outs = self._own_smooth(t, i, samples)
            types = recipe.layer_types(cfg, i)
            kinds = {p: k for p, k in types.items() if k in (W8A8, W8A8_DYNAMIC)}
            stats: dict = {}
            params = {}
            if any(k == W8A8 for k in kinds.values()):
                calib = CalibLinears(t, kinds)
                outs = self._forward(t, i, samples, calib, absorbed=False, attention_only=recipe.fa_quant)
                stats.update(calib.minmax())
                params = final_params(calib.ranges, t[next(iter(kinds)) + ".weight"].dtype)
                if not recipe.fa_quant:
                    last = outs
            if recipe.fa_quant:
                fa_layer = any(k == FAQUANT for k in types.values())
                windows: dict[str, RecallWindow] = {}

                def fa(name: str, x: Tensor, ratio: float) -> None:
                    w = RecallWindow.observe(x[0].reshape(x.shape[1], -1), ratio, name)
                    windows[name] = windows[name].merge(w) if name in windows else w

                last = self._forward(t, i, samples, DeployedLinears(t, kinds, params), absorbed=fa_layer,
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
