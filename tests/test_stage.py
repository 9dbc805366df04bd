"""Pipeline stages without Ray: every split of the layers into stages, run in order on each sample,
gives the whole model's calibration statistics bit for bit (W8A8/FA3 and smoothing, MTP included), and
the per-unit weight phase writes the single-process writer's files byte for byte."""

from __future__ import annotations

import pytest
import torch

from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, calibrate, calibration_samples
from pipeline.quant.job.stage import SMOOTH, STATS, Stage, even_ranges, split_stages
from pipeline.quant.transforms.smooth import ChannelAbsMax
from tiny import TINY_FIXTURE

SRC = str(TINY_FIXTURE)


def run_stages(stages: list[Stage], kind: str, samples) -> list:
    """Per sample, the stages in order; returns the statistics of every (sample, stage)."""
    out = []
    for s in samples:
        h = None
        for st in stages:
            h, got = st.forward(kind, s, h)
            out.append(got)
    return out


def merge_smooth(parts) -> dict[str, ChannelAbsMax]:
    acc: dict[str, ChannelAbsMax] = {}
    for part in parts:
        for k, v in part.items():
            acc[k] = acc[k].merge(v) if k in acc else v
    return acc


RECIPES = {"plain": Recipe(), "smooth-mtp": Recipe(quantize_mtp=True, smooth=True)}


@pytest.fixture(scope="module")
def opts(calib4) -> QuantizeOptions:
    """Four texts: the stages' statistics equal the whole model's on any texts."""
    return QuantizeOptions(calib_path=calib4)


@pytest.fixture(scope="module")
def whole(opts):
    """The whole model's calibration of a recipe (statistics, smoothing statistics), once per recipe: the
    reference every split of that recipe must give; read-only."""
    done: dict = {}

    def get(name: str):
        if name not in done:
            done[name] = calibrate(SRC, RECIPES[name], opts)
        return done[name]

    return get


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_stages_compose_to_the_whole_model_bit_for_bit(n_stages, recipe, opts, whole):
    cfg = CheckpointReader(SRC).config
    samples = calibration_samples(SRC, opts, cfg.max_position_embeddings)
    want, want_smooth = whole(recipe)
    recipe = RECIPES[recipe]

    specs = split_stages(cfg.num_hidden_layers, cfg.mtp_layer_ids, even_ranges(cfg.num_hidden_layers, n_stages))
    stages = [Stage(SRC, sp, recipe) for sp in specs]
    smooth = None
    if recipe.smooth:
        smooth = merge_smooth(run_stages(stages, SMOOTH, samples))
        assert sorted(smooth) == sorted(k for k, v in want_smooth.items() if v.value is not None)
        for k, v in smooth.items():
            assert torch.equal(v.value, want_smooth[k].value), k
        for st in stages:
            st.apply_smoothing(smooth, opts.smooth_alpha)
    got = Stats({})
    for part in run_stages(stages, STATS, samples):
        got = got.merge(part)
    assert got.to_dict() == want.to_dict()  # every row, lo, hi and count


def test_stage_splits_are_checked():
    with pytest.raises(QuantError, match="do not cover layers 0..2"):
        split_stages(3, [3], [(0, 1), (2, 3)])
    with pytest.raises(QuantError, match="stages must be 1..3"):
        even_ranges(3, 4)
    a, b = split_stages(3, [3], even_ranges(3, 2))
    assert (a.layers, a.embed, a.head, a.mtp) == ((0, 1), True, False, ())
    assert (b.layers, b.embed, b.head, b.mtp) == ((2,), False, True, (3,))
    assert a.label == "embed+0-1" and b.label == "2-2+norm+mtp3"
