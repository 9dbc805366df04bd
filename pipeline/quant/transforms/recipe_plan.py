"""The recipe resolved for a model, in one place: the plan that the job, the calibration and the writer
follow (docs/recipes.md, "Calibration").

:func:`resolve` is the one reader, outside pipeline.quant.recipe, of the recipe's fields that select
behaviour (its steps, ``smooth``, ``calibration``, ``fa_quant``, ``quantize_mtp``). What it returns knows how
to apply itself, so its callers iterate and call, never asking which step or which calibration they hold:

    plan.steps         msModelSlim's pre-processing steps, in the recipe's order: each a :class:`LayerStep`
                       that says which layers it runs on, folds itself into a layer, and names the tensors
                       (:meth:`LayerStep.biases`) and files (:meth:`LayerStep.files`) it adds to the output
    plan.fed_steps     dsquant's own ``smooth`` as msModelSlim's passes run it: after the MTP layer's inputs
                       are made from the last main layer's outputs, on the layer's float forward; then the
                       recipe's ``mlp_smooth_layers`` (:class:`MlpSmoothing`), on the main layers it names
    plan.smoothing     dsquant's own ``smooth`` as the float calibration runs it: a statistics pass of its
                       own over the float model, folded in before the W8A8 / FA3 statistics
                       (:class:`FloatSmoothing`, or :data:`NO_SMOOTHING` when the recipe does not smooth)
    plan.layer_passes  msModelSlim's layer-by-layer passes (else the float model's activations, one pass)
    plan.fa3_pass      whether those passes run the FA3 pass after the linears'

QuaRot's rotations are the first ``quarot`` step's, built once per plan when first needed; the globals and a
layer no pass runs on (the MTP layer kept float) get them once (:meth:`RecipePlan.transform_globals`,
:meth:`RecipePlan.transform_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping, Optional, Union

from torch import Tensor

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import MSMODELSLIM, Recipe
from pipeline.quant.recipe.steps import FlexSmooth, IterSmooth, QuaRot
from pipeline.quant.transforms.flex_smooth import flex_smooth_layer
from pipeline.quant.transforms.iter_smooth import iter_smooth_layer, shifts
from pipeline.quant.transforms.mlp_smooth import NORM, ROUTER, mlp_targets, smooth_mlp_input
from pipeline.quant.transforms.outlier_stats import ActivationRows, ChannelTrace
from pipeline.quant.transforms.quarot import (
    QUAROT_FILE, build_rotations, description_entry, optional_tensors, rotate_globals, rotate_layer)
from pipeline.quant.transforms.smooth import (
    ChannelAbsMax, apply_smoothing, collect_smoothing_stats, smooth_layer, smoothed_weights)
from pipeline.quant.transforms.subgraphs import step_subgraphs, subgraph_weights

Tensors = dict[str, Tensor]


@dataclass
class LayerRun:
    """What a step needs of the layer it runs on, given by the pass that runs it: the layer id, the float
    forwards of the layer on the pass's samples (``float_forward(tensors, observers, attention_only)``:
    eager attention, ``observers`` on the named linears' inputs; ``absorbed_forward(tensors, observers, fa)``:
    absorbed attention, ``fa(name, x, ratio)`` shown the FA3 activations), flex_smooth_quant's ``choices``
    (alpha / beta per subgraph, filled in) and dsquant's smoothing ``alpha``."""

    layer_id: int
    float_forward: Callable[[Mapping[str, Tensor], dict, bool], list]
    absorbed_forward: Callable[[Mapping[str, Tensor], dict, Callable], list]
    choices: dict
    smooth_alpha: float


class LayerStep:
    """One step of msModelSlim's passes. ``apply`` returns (the layer's tensors with the step folded in, the
    outputs of the forward it ran when those are the layer's outputs, else None)."""

    name = ""

    def runs_on(self, cfg: DeepseekV3Config, layer_id: int) -> bool:
        return True

    def apply(self, tensors: Tensors, run: LayerRun) -> tuple[Tensors, Optional[list]]:
        raise NotImplementedError

    def biases(self, cfg: DeepseekV3Config, layer_id: int) -> dict[str, tuple[int, ...]]:
        """``{bias tensor name: shape}`` the step adds to layer ``layer_id``, from the config alone."""
        return {}

    def rewrites(self, cfg: DeepseekV3Config, layer_id: int) -> Optional[frozenset[str]]:
        """The weights of layer ``layer_id`` the step replaces by new tensors (None: every one)."""
        return frozenset()

    def files(self) -> Optional[tuple[dict[str, bytes], dict]]:
        """(files beside the weights, the description's ``optional`` object), or None: the step writes none."""
        return None


class Rotate(LayerStep):
    """``quarot``: the plan's rotations folded into every layer (no data)."""

    name = "quarot"

    def __init__(self, step: QuaRot, plan: "RecipePlan"):
        self.step, self.plan = step, plan

    def apply(self, tensors: Tensors, run: LayerRun) -> tuple[Tensors, Optional[list]]:
        return rotate_layer(tensors, run.layer_id, self.plan.cfg, self.plan.rotations), None

    def rewrites(self, cfg: DeepseekV3Config, layer_id: int) -> Optional[frozenset[str]]:
        return None

    def files(self) -> Optional[tuple[dict[str, bytes], dict]]:
        """QuaRot's ``optional/quarot.safetensors`` holding ``global_rotation``, as msModelSlim exports it."""
        if not self.step.export_extra_info:
            return {}, {}
        from safetensors.torch import save

        return {QUAROT_FILE: save(optional_tensors(self.plan.rotations))}, description_entry()["optional"]


class AntiOutlier(LayerStep):
    """An anti-outlier step on the main layers (the MTP layer is never smoothed): its subgraphs' activations
    observed on a float forward of the layer as it is, then its scales folded in."""

    observer: type

    def __init__(self, step: Union[IterSmooth, FlexSmooth], cfg: DeepseekV3Config):
        self.step, self.cfg, self.name = step, cfg, step.type

    def runs_on(self, cfg: DeepseekV3Config, layer_id: int) -> bool:
        return layer_id < cfg.num_hidden_layers

    def fold(self, tensors: Tensors, layer_id: int, observers: dict, choices: dict) -> Tensors:
        raise NotImplementedError

    def rewrites(self, cfg: DeepseekV3Config, layer_id: int) -> Optional[frozenset[str]]:
        return subgraph_weights(step_subgraphs(self.step, cfg, layer_id))

    def apply(self, tensors: Tensors, run: LayerRun) -> tuple[Tensors, Optional[list]]:
        subgraphs = step_subgraphs(self.step, self.cfg, run.layer_id)
        if not subgraphs:
            return tensors, None
        observers = {sg.observed: self.observer() for sg in subgraphs}
        mlp_needed = any(".mlp." in n for n in observers)
        outs = run.float_forward(tensors, observers, not mlp_needed)
        return self.fold(tensors, run.layer_id, observers, run.choices), outs


class IterSmoothing(AntiOutlier):
    """``iter_smooth`` (msModelSlim's m4); with ``symmetric: false`` it shifts its norm-linear subgraphs,
    which adds a float32 ``.bias`` to each such norm and to every linear it feeds."""

    observer = ChannelTrace

    def fold(self, tensors: Tensors, layer_id: int, observers: dict, choices: dict) -> Tensors:
        return iter_smooth_layer(tensors, layer_id, self.cfg, observers, self.step)

    def biases(self, cfg: DeepseekV3Config, layer_id: int) -> dict[str, tuple[int, ...]]:
        if self.step.symmetric or not self.runs_on(cfg, layer_id):
            return {}
        out: dict[str, tuple[int, ...]] = {}
        shapes = layout.layer_shapes(cfg, layer_id)
        for sg in step_subgraphs(self.step, cfg, layer_id):
            if shifts(self.step, sg):
                out[sg.source + ".bias"] = shapes[sg.source + ".weight"]
                out.update({t + ".bias": (shapes[t + ".weight"][0],) for t in sg.targets})
        return out


class FlexSmoothing(AntiOutlier):
    """``flex_smooth_quant``: alpha / beta searched per subgraph (recorded in ``choices``) unless given."""

    observer = ActivationRows

    def fold(self, tensors: Tensors, layer_id: int, observers: dict, choices: dict) -> Tensors:
        return flex_smooth_layer(tensors, layer_id, self.cfg, observers, self.step, choices)


class OwnSmoothing(LayerStep):
    """dsquant's SmoothQuant + latent smoothing (pipeline.quant.transforms.smooth) in msModelSlim's passes: its
    statistics from a float absorbed forward of the attention (whose outputs feed nothing), on the main
    layers and, when the recipe quantizes it, the MTP layer."""

    name = "smooth"

    def __init__(self, cfg: DeepseekV3Config, quantize_mtp: bool):
        self.cfg, self.quantize_mtp = cfg, quantize_mtp

    def runs_on(self, cfg: DeepseekV3Config, layer_id: int) -> bool:
        return layer_id < cfg.num_hidden_layers or self.quantize_mtp

    def apply(self, tensors: Tensors, run: LayerRun) -> tuple[Tensors, Optional[list]]:
        p = f"model.layers.{run.layer_id}"
        stats = {k: ChannelAbsMax() for k in (f"{p}.attn_in", f"{p}.q_b_in", f"{p}.latent", f"{p}.q_abs")}
        first = f"{p}.self_attn." + ("q_a_proj" if self.cfg.q_lora_rank else "q_proj")
        observers = {first: stats[f"{p}.attn_in"], f"{p}.self_attn.q_b_proj": stats[f"{p}.q_b_in"]}

        def fa(name: str, x: Tensor, ratio: float) -> None:
            if name.endswith("fa_q"):
                stats[f"{p}.q_abs"].observe(x.float().abs().amax(1))
            elif name.endswith("fa_k"):
                stats[f"{p}.latent"].observe(x[:, 0])

        run.absorbed_forward(tensors, observers, fa)
        return smooth_layer(tensors, run.layer_id, stats, run.smooth_alpha), None

    def rewrites(self, cfg: DeepseekV3Config, layer_id: int) -> Optional[frozenset[str]]:
        return smoothed_weights(layer_id)


class MlpSmoothing(LayerStep):
    """The recipe's ``mlp_smooth_layers`` (pipeline.quant.transforms.mlp_smooth): the norm's output observed
    at the inputs of the linears it feeds on a float forward of the layer as it is, then the scales folded
    into the norm, those linears and the router."""

    name = "mlp_smooth"

    def __init__(self, cfg: DeepseekV3Config, layers: tuple[int, ...], alpha: float):
        self.cfg, self.layers, self.alpha = cfg, frozenset(layers), alpha

    def runs_on(self, cfg: DeepseekV3Config, layer_id: int) -> bool:
        return layer_id in self.layers

    def apply(self, tensors: Tensors, run: LayerRun) -> tuple[Tensors, Optional[list]]:
        seen = ChannelAbsMax()          # one observer for every target: the max over every token routed
        run.float_forward(tensors, {t: seen for t in mlp_targets(self.cfg, run.layer_id)}, False)
        if seen.value is None:
            raise QuantError(f"mlp_smooth: layer {run.layer_id}'s MLP saw no token")
        return smooth_mlp_input(tensors, self.cfg, run.layer_id, seen.value, self.alpha)[0], None

    def rewrites(self, cfg: DeepseekV3Config, layer_id: int) -> Optional[frozenset[str]]:
        p = layout.layer_prefix(layer_id)
        router = (p + ROUTER + ".weight",) if cfg.is_moe_layer(layer_id) else ()
        return frozenset((*(t + ".weight" for t in mlp_targets(cfg, layer_id)), *router,
                          p + NORM + ".weight"))


class NoSmoothing:
    """The float calibration of a recipe without dsquant's smoothing: nothing to collect or fold."""

    def collect(self, run: Callable[[], dict]) -> None:
        """The smoothing statistics ``run`` gathers (a statistics pass of its own), or None: none to gather."""
        return None

    def fold_into(self, model, samples, alpha: float, products: str):
        """Collect the smoothing statistics on the float ``model`` and fold them in; returns them (None)."""
        return None

    def kept_weights(self, layer_id: int) -> frozenset[str]:
        """The weights of layer ``layer_id`` a layer reader must hand over as floats (smoothing rewrites them)."""
        return frozenset()

    def stream(self, hidden: list) -> Optional[list]:
        """The hidden states the smoothing statistics are taken on, beside the statistics' own (the
        layer-wise float calibration runs both streams), or None: no such stream."""
        return None


NO_SMOOTHING = NoSmoothing()


class FloatSmoothing(NoSmoothing):
    """dsquant's smoothing in the float calibration: per-channel statistics over the float model (the MTP
    layer included when the recipe quantizes it), folded into the model before its W8A8 / FA3 statistics."""

    def __init__(self, layer_ids: Optional[range]):
        self.layer_ids = layer_ids          # None: every layer the model holds

    def collect(self, run: Callable[[], dict]) -> dict:
        return run()

    def fold_into(self, model, samples, alpha: float, products: str):
        stats = collect_smoothing_stats(model, samples, layer_ids=self.layer_ids, products=products)
        apply_smoothing(model, stats, alpha)
        return stats

    def kept_weights(self, layer_id: int) -> frozenset[str]:
        return smoothed_weights(layer_id)

    def stream(self, hidden: list) -> Optional[list]:
        return list(hidden)


class RecipePlan:
    """A recipe resolved for a model (module doc); built by :func:`resolve`."""

    def __init__(self, recipe: Recipe, cfg: DeepseekV3Config):
        self.recipe, self.cfg = recipe, cfg
        make = {"quarot": lambda st: Rotate(st, self), "iter_smooth": lambda st: IterSmoothing(st, cfg),
                "flex_smooth_quant": lambda st: FlexSmoothing(st, cfg)}
        self.steps: tuple[LayerStep, ...] = tuple(make[st.type](st) for st in recipe.steps)
        self._quarot = next((st for st in recipe.steps if st.type == "quarot"), None)
        self.fed_steps: tuple[LayerStep, ...] = (
            ((OwnSmoothing(cfg, recipe.quantize_mtp),) if recipe.smooth else ())
            + ((MlpSmoothing(cfg, recipe.mlp_smooth_layers, recipe.mlp_smooth_alpha),)
               if recipe.mlp_smooth_layers else ()))
        self.smoothing = (FloatSmoothing(None if recipe.quantize_mtp else range(cfg.num_hidden_layers))
                          if recipe.smooth else NO_SMOOTHING)
        self.layer_passes = recipe.calibration == MSMODELSLIM
        self.fa3_pass = recipe.fa_quant
        # the statistics forward, plus dsquant's smoothing's own (what the estimate counts)
        self.calibration_forwards = 1 + bool(recipe.smooth) + bool(recipe.mlp_smooth_layers)

    def rewritten(self, layer_id: int) -> Optional[frozenset[str]]:
        """The weights of layer ``layer_id`` the steps replace by new tensors while the original ones are
        still held (what the estimate counts twice); None: every one (quarot)."""
        names: set[str] = set()
        for step in (*self.steps, *self.fed_steps):
            if step.runs_on(self.cfg, layer_id):
                got = step.rewrites(self.cfg, layer_id)
                if got is None:
                    return None
                names |= got
        return frozenset(names)

    @property
    def changes_weights(self) -> bool:
        """Whether a step rewrites the layers' float weights (every weight is then read as a float)."""
        return bool(self.steps or self.fed_steps)

    @cached_property
    def rotations(self):
        """QuaRot's rotations of the model (the first ``quarot`` step's block size), built once."""
        if self.cfg.tie_word_embeddings:
            raise QuantError("quarot: a model with tied embeddings is not supported (the rotated head would differ "
                             "from the embedding)")
        return build_rotations(self.cfg, self._quarot.block_size)

    def transform_globals(self, g: Mapping[str, Tensor]) -> Tensors:
        """The globals (embedding, final norm, head) with the recipe's steps folded in."""
        return rotate_globals(g, self.cfg, self.rotations) if self._quarot is not None else dict(g)

    def transform_layer(self, layer_id: int, t: Mapping[str, Tensor]) -> Tensors:
        """A layer no pass runs on (the MTP layer kept float): its data-free steps (quarot) folded in."""
        return rotate_layer(t, layer_id, self.cfg, self.rotations) if self._quarot is not None else dict(t)

    def biases(self, layer_id: int) -> dict[str, tuple[int, ...]]:
        """``{bias tensor name: shape}`` the steps add to layer ``layer_id``, known from the config and the
        recipe alone (the writer lays its shards out before any value exists)."""
        out: dict[str, tuple[int, ...]] = {}
        for step in self.steps:
            out.update(step.biases(self.cfg, layer_id))
        return out

    def files(self) -> tuple[dict[str, bytes], dict]:
        """(files to write beside the weights, the description's ``optional`` object): the first step's that
        writes any."""
        return next((f for f in (step.files() for step in self.steps) if f is not None), ({}, {}))

    def check_calibration(self, needs_calibration: bool, layerwise: bool) -> None:
        """The calibration the recipe asks for against the job's: the steps run in msModelSlim's passes,
        which run in the one-read job."""
        if self.recipe.mlp_smooth_layers and not self.layer_passes:
            raise QuantError("recipe: mlp_smooth_layers run in msModelSlim's layer-by-layer passes: drop "
                             "--calibration float")
        if self.steps and not self.layer_passes:
            raise QuantError(f"recipe steps {[st.name for st in self.steps]} run in msModelSlim's layer-by-layer "
                             "passes: drop --calibration float (or the steps: --disable-anti)")
        if needs_calibration and not layerwise and self.layer_passes:
            raise QuantError("--two-pass is the float calibration's reference (the whole float model first): it "
                             "needs --calibration float; msModelSlim's layer-by-layer passes run in the one-read job")

    def check_batch(self, batch: int) -> None:
        """msModelSlim's passes run one sample at a time, in order."""
        if self.layer_passes and batch != 1:
            raise QuantError("calib_batch > 1 needs the float calibration (--calibration float): msModelSlim's "
                             "passes run one sample at a time, in order")


def resolve(recipe: Recipe, cfg: DeepseekV3Config) -> RecipePlan:
    """``recipe`` resolved for the model ``cfg`` (cheap: rotations are built when first needed)."""
    return RecipePlan(recipe, cfg)
