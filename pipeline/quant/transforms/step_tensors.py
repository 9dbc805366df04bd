"""The tensors a recipe's steps add to a layer, known from the config and the recipe alone (the writer lays
its shards out before any value exists): iter_smooth with ``symmetric: false`` shifts its norm-linear
subgraphs, which adds a float32 ``.bias`` to each such norm and to every linear it feeds (docs/recipes.md).
The MTP layer is never smoothed.
"""

from __future__ import annotations

from pipeline.config import DeepseekV3Config
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.recipe.steps import IterSmooth


def step_biases(cfg: DeepseekV3Config, recipe: Recipe, layer_id: int) -> dict[str, tuple[int, ...]]:
    """``{bias tensor name: shape}`` the recipe's steps add to layer ``layer_id``."""
    if layer_id >= cfg.num_hidden_layers:
        return {}
    from pipeline import layout
    from pipeline.quant.transforms.iter_smooth import shifts
    from pipeline.quant.transforms.subgraphs import step_subgraphs

    out: dict[str, tuple[int, ...]] = {}
    for step in recipe.steps:
        if not isinstance(step, IterSmooth) or step.symmetric:
            continue
        shapes = layout.layer_shapes(cfg, layer_id)
        for sg in step_subgraphs(step, cfg, layer_id):
            if shifts(step, sg):
                out[sg.source + ".bias"] = shapes[sg.source + ".weight"]
                out.update({t + ".bias": (shapes[t + ".weight"][0],) for t in sg.targets})
    return out


def step_files(cfg: DeepseekV3Config, recipe: Recipe) -> tuple[dict[str, bytes], dict]:
    """(files to write beside the weights, the description's ``optional`` object) for the recipe's steps:
    QuaRot's ``optional/quarot.safetensors`` holding ``global_rotation``, as msModelSlim exports it."""
    from pipeline.quant.recipe.steps import QuaRot

    quarot = [s for s in recipe.steps if isinstance(s, QuaRot)]
    if not quarot or not quarot[0].export_extra_info:
        return {}, {}
    from safetensors.torch import save

    from pipeline.quant.transforms.quarot import QUAROT_FILE, build_rotations, description_entry, optional_tensors

    rot = build_rotations(cfg, quarot[0].block_size)
    return {QUAROT_FILE: save(optional_tensors(rot))}, description_entry()["optional"]
