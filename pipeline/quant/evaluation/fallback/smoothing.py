"""The ladder's zero-byte step before any move to bf16: smoothing a layer's MLP input.

msModelSlim's recipes never smooth post_attention_layernorm, so per-channel outliers there reach every
gate/up input of the layer (dense MLP, shared and routed experts) and neither int8 rung holds them; without
this step the ladder can only keep those pieces bf16. pipeline.quant.transforms.mlp_smooth folds
power-of-two per-channel scales into the norm, those linears and the float router (the float function is
unchanged) and keeps every type: no byte above int8.

The job quantizes a second probe with every candidate layer smoothed (the main layers whose MLP the recipe
quantizes and does not smooth already) and measures, per layer, the error of its MLP pieces at their best
int8 rung (the recipe's type or W8A8_DYNAMIC, the ``residual`` proxy of :func:`.search.rung_costs`, summed
over the layer's pieces) with and without smoothing, on the fitting samples. A layer keeps the smoothing
only where it lowers that error; the ladder then runs on the recipe with those layers in
``mlp_smooth_layers``, which the written recipe carries, and ``fallback.json``'s ``mlp_smooth`` section
records both errors per layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, Sequence

from pipeline.format.description import FLOAT, QUANT_KINDS, W8A8
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.transforms.mlp_smooth import mlp_targets


def candidates(recipe: Recipe, cfg) -> tuple[int, ...]:
    """The main layers whose MLP input smoothing may help: gate/up quantized, not smoothed already."""
    out = []
    for i in range(cfg.num_hidden_layers):
        types = recipe.layer_types(cfg, i)
        if i not in recipe.mlp_smooth_layers and any(types.get(t) in QUANT_KINDS for t in mlp_targets(cfg, i)):
            out.append(i)
    return tuple(out)


def mlp_errors(probe: str, samples: Sequence[Sequence[int]], float_weights, layers: Sequence[int]) -> dict[int, float]:
    """Per layer of ``layers``: the summed ``residual`` cost of its MLP pieces at their best int8 rung, on
    the probe ``probe`` with its quantized linears' float weights (``float_weights``: the job's
    FloatWeights)."""
    import torch

    from pipeline.quant.evaluation.fakequant import load_fakequant_model
    from pipeline.quant.evaluation.fallback.rungs import dynamic_params, ladder_pieces
    from pipeline.quant.evaluation.fallback.search import rung_costs
    from pipeline.quant.evaluation.sensitivity import FakeQuantParams, FloatReference

    with torch.no_grad():
        model = load_fakequant_model(probe, w8a8=False, fa3=False)
        float_weights.install(model)
        ref = FloatReference(model, samples)
    params = FakeQuantParams.from_dir(probe)
    wanted = set(layers)
    pieces = [p for p in ladder_pieces(params.linears) if p.layer in wanted and not p.attention]
    names = {m for p in pieces for m in p.members}
    sub = FakeQuantParams({m: params.linears[m] for m in names})
    float_tensors = float_weights.tensors
    dynamic = {m: dynamic_params(kind, p, float_tensors.get(m + ".weight"), float_tensors.get(m + ".bias"))
               for m, (kind, p) in sub.linears.items() if kind == W8A8}
    costs = rung_costs(ref, pieces, sub, dynamic)
    out = dict.fromkeys(layers, 0.0)
    for p in pieces:
        out[p.layer] += min(c for r, c in costs[p.key].items() if r != FLOAT)
    return out


def kept_layers(without: Mapping[int, float], with_: Mapping[int, float]) -> list[int]:
    """The layers whose measured MLP error smoothing lowers."""
    return sorted(i for i in without if with_[i] < without[i])


def smooth_where_it_helps(recipe: Recipe, cfg, probe: tuple[str, object], quantize_probe: Callable,
                          samples: Sequence[Sequence[int]], log: Callable[[str], None]) -> tuple:
    """(the recipe with the layers that keep the smoothing added, its probe as (path, FloatWeights), the
    report's ``mlp_smooth`` section or None when no layer is a candidate). ``probe``: the recipe's probe;
    ``quantize_probe(recipe)`` quantizes another and returns it as (path, FloatWeights); ``samples``: the
    fitting samples."""
    layers = candidates(recipe, cfg)
    if not layers:
        return recipe, probe, None

    def smoothed(ids) -> Recipe:
        return replace(recipe, mlp_smooth_layers=tuple(sorted(set(recipe.mlp_smooth_layers) | set(ids))))

    every = quantize_probe(smoothed(layers))
    without = mlp_errors(probe[0], samples, probe[1], layers)
    with_ = mlp_errors(every[0], samples, every[1], layers)
    kept = kept_layers(without, with_)
    section = {"alpha": recipe.mlp_smooth_alpha, "candidates": list(layers), "kept": kept,
               "mlp_error": {str(i): {"without": without[i], "with": with_[i]} for i in layers}}
    log(f"fallback: MLP input smoothing lowers the measured MLP error of layers {kept} (of candidates "
        f"{list(layers)}): " + ", ".join(f"{i}: {without[i]:.3g} -> {with_[i]:.3g}" for i in layers))
    if kept == list(layers):
        return smoothed(layers), every, section
    if not kept:
        return recipe, probe, section
    return smoothed(kept), quantize_probe(smoothed(kept)), section
