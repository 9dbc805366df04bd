"""A pipeline stage: the float model's layers ``[a, b)`` (plus the embedding on the first stage, the final
norm on the stage that runs the last main layer, and the MTP layer where it is placed), run on one
calibration sample at a time, returning that sample's statistics of the stage's layers. Pure (no Ray):
``actors.quantize.stage`` wraps it in an actor, and running every stage in order in one process gives what
:func:`pipeline.quant.calibration.calibrate.collect_stats` and
:func:`pipeline.quant.transforms.smooth.collect_smoothing_stats` give on the whole model, bit for bit (tested).

    h = embed(ids)                       first stage
    h = layers[a..b)(h)                  every stage with main layers
    h = norm(h)                          the stage with the last main layer: the "hidden" MTP reads
    MTP(h, ids)                          the stage with the MTP layer (when the recipe calibrates it)

Only the stage's own weights are materialized (the rest of the model stays on the meta device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch

from pipeline.io.checkpoint import CheckpointReader
from pipeline.model import build_model
from pipeline.quant.calibration.calibrate import observing, run_mtp, stats_layers
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.numerics.products import KeptWeights
from pipeline.quant.numerics.qparams import QuantError
from pipeline.config import model_dtype
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.transforms.smooth import ChannelAbsMax, apply_smoothing, observing_smoothing, smoothing_runs_mtp

STATS, SMOOTH = "stats", "smooth"  # the two calibration passes
EMBED_NAME, NORM_NAME = "model.embed_tokens.weight", "model.norm.weight"


@dataclass(frozen=True)
class StageSpec:
    index: int
    layers: tuple[int, ...]          # main layers, ascending and contiguous
    mtp: tuple[int, ...] = ()        # MTP layers
    embed: bool = False              # runs the embedding (the first stage)
    head: bool = False               # runs the final norm (owns the last main layer)

    @property
    def label(self) -> str:
        parts = (["embed"] if self.embed else []) + ([f"{self.layers[0]}-{self.layers[-1]}"] if self.layers else [])
        return "+".join(parts + (["norm"] if self.head else []) + [f"mtp{i}" for i in self.mtp]) or "empty"


def split_stages(num_layers: int, mtp_ids: Sequence[int], ranges: Sequence[tuple[int, int]]) -> list[StageSpec]:
    """StageSpecs for contiguous, non-empty main-layer ``ranges`` ([a, b) each, covering 0..num_layers in
    order); the MTP layers go to the last stage, which runs the final norm they read."""
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != num_layers or \
            any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])) or any(a >= b for a, b in ranges):
        raise QuantError(f"stage ranges {list(ranges)} do not cover layers 0..{num_layers - 1} contiguously")
    last = len(ranges) - 1
    return [StageSpec(k, tuple(range(a, b)), tuple(mtp_ids) if k == last else (), embed=k == 0, head=k == last)
            for k, (a, b) in enumerate(ranges)]


def even_ranges(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` contiguous ranges of as equal a number of layers as can be."""
    if not 1 <= stages <= max(num_layers, 1):
        raise QuantError(f"stages must be 1..{num_layers} for {num_layers} layers, got {stages}")
    bounds = [round(k * num_layers / stages) for k in range(stages + 1)]
    return list(zip(bounds, bounds[1:]))


class Stage:
    """The weights of one :class:`StageSpec`, loaded from ``src`` in the model dtype (FP8 dequantized)."""

    def __init__(self, src: Union[str, CheckpointReader], spec: StageSpec, recipe: Recipe, device: str = "cpu"):
        reader = src if isinstance(src, CheckpointReader) else CheckpointReader(src, with_mtp=not recipe.drop_mtp)
        cfg = reader.config
        recipe.check_config(cfg)
        self.spec, self.recipe, self.device, self.config = spec, recipe, device, cfg
        md = model_dtype(cfg)
        tensors: dict[str, torch.Tensor] = {}
        if spec.embed:
            tensors[EMBED_NAME] = reader.read_tensor(EMBED_NAME, md)
        if spec.head:
            tensors[NORM_NAME] = reader.read_tensor(NORM_NAME, md)
        mtp = tuple(i for i in spec.mtp if recipe.quantized_layer(cfg, i))  # FLOAT MTP: not calibrated, not loaded
        for i in (*spec.layers, *mtp):
            tensors.update(reader.read_layer(i, dtype=md))
        self.model = build_model(cfg, tensors, dtype=md, device=device, with_mtp=bool(mtp), strict=False)
        del tensors
        owned = set(spec.layers) | set(spec.mtp)
        self.stats_layers = [i for i in stats_layers(cfg, recipe, have_mtp=bool(cfg.mtp_layer_ids)) if i in owned]
        # the smoothing pass covers the MTP layer exactly when the recipe quantizes it (as run.prepare_float_model)
        self.smooth_layers = sorted(spec.layers) + sorted(mtp)
        self.mtp = mtp                  # the MTP layers the stage runs
        self.dropped: set[int] = set()  # layers freed by drop_layer: the stage can no longer run
        self.kept = KeptWeights()       # upcast weights reused across samples (calib_products); cleared on change

    @torch.no_grad()
    def forward(self, kind: str, ids: Sequence[int], h: Optional[torch.Tensor] = None
                ) -> tuple[Optional[torch.Tensor], Union[Stats, dict[str, ChannelAbsMax]]]:
        """One sample through the stage: ``ids`` the sample's tokens, ``h`` the previous stage's output
        (None on the first stage). Returns (this stage's output, or None when no stage follows that
        needs it; the sample's statistics of this stage's layers: a Stats for ``STATS``, smoothing
        statistics for ``SMOOTH``)."""
        if kind not in (STATS, SMOOTH):
            raise ValueError(f"kind must be {STATS!r} or {SMOOTH!r}, got {kind!r}")
        spec, model = self.spec, self.model
        if self.dropped:
            raise RuntimeError(f"stage {spec.index}: layers {sorted(self.dropped)} were dropped; load a new Stage")
        t = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        if spec.embed:
            h = model.embed(t)
        elif h is None:
            raise ValueError(f"stage {spec.index} ({spec.label}): needs the previous stage's hidden state")
        else:
            h = h.to(self.device)
        ctx = observing(model, self.recipe, self.stats_layers, self.kept) if kind == STATS else \
            observing_smoothing(model, self.smooth_layers, self.recipe.calib_products, self.kept)
        with ctx as observed:
            if spec.layers:
                h = model.run_layers(h, spec.layers)
            if spec.head:
                h = model.model.norm(h)
            if self.mtp:
                if kind == STATS:
                    run_mtp(model, h, t, len(spec.mtp))
                elif smoothing_runs_mtp(model, t.shape[1], self.smooth_layers):
                    model.mtp(h[:, :-1], t[:, 1:])
        result = observed.stats() if kind == STATS else {k: v for k, v in observed.items() if v.value is not None}
        return (None if spec.mtp else h), result

    def drop_layer(self, layer_id: int) -> None:
        """Free one layer's weights (after the weight phase wrote it from them)."""
        self.kept.clear()
        self.model.model.layers[layer_id] = torch.nn.Module()
        self.dropped.add(layer_id)

    def apply_smoothing(self, stats: Mapping[str, ChannelAbsMax], alpha: float) -> None:
        """Fold the (reduced) smoothing statistics into the stage's layers, as the single-process path
        folds them into the whole model."""
        self.kept.clear()                # the weights change in place
        owned = tuple(f"model.layers.{i}." for i in (*self.spec.layers, *self.spec.mtp))
        apply_smoothing(self.model, {k: v for k, v in stats.items() if (k + ".").startswith(owned)}, alpha)
