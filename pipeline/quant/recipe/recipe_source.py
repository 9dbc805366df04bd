"""Where a job's recipe comes from: a modelslim_v1 file (``--config-path``), a preset (``--model-type X
--quant-type Y``) or the legacy DeepSeek script's flags (``--fa_quant --anti_method m4 --rot --quant_mtp``),
with this project's own options on top (docs/msmodelslim.md).

The legacy form follows ``quant_deepseek_w8a8.py``: anti-outlier m4 (iter_smooth, alpha 0.5, a shift on the
norm-linear subgraphs) unless ``--disable_anti`` or ``--anti_method none``; m6 is flex_smooth_quant; ``--rot``
runs QuaRot first; FA3 stays off the model's list of layers (pipeline.quant.recipe.presets), the model named by
``--model-type`` or read from the path. ``--quant_mtp none`` leaves the MTP layer out of the job and its
output (``Recipe.drop_mtp``; FA3 lists then name main layers only). Whatever the form, the job writes the
recipe it ran next to the weights as ``<model_type>_best_practice.yaml``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.quant.recipe import modelslim_yaml, presets
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.recipe.steps import PRESET_SUBGRAPHS, FlexSmooth, IterSmooth, QuaRot

ANTI_METHODS = ("m4", "m6", "none")
QUANT_MTP = ("float", "mix", "none")
LEGACY_QUAROT_BLOCK = 32
DEFAULT_MODEL_TYPE = "DeepSeek-V3"
RECIPE_SUFFIX = "_best_practice.yaml"
MODEL_TYPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")   # what may stand before RECIPE_SUFFIX


@dataclass(frozen=True)
class RecipeRequest:
    """What the command line asked for (None: not given)."""

    config_path: Optional[str] = None
    model_type: Optional[str] = None
    quant_type: Optional[str] = None
    anti_method: Optional[str] = None      # legacy default m4
    disable_anti: bool = False
    rot: bool = False
    quant_mtp: Optional[str] = None        # float | mix | none; legacy default float here (docs/msmodelslim.md)
    fa_quant: Optional[bool] = None        # default on
    dynamic: bool = False
    smooth: bool = False
    fa_exclude_layers: tuple[int, ...] = ()
    mlp_smooth_layers: tuple[int, ...] = ()
    dialect: Optional[str] = None
    calib_products: str = "auto"
    calib_data: Optional[str] = None
    calibration: str = "msmodelslim"


@dataclass(frozen=True)
class ResolvedRecipe:
    recipe: Recipe
    model_type: str
    source: str                             # one line: what the recipe came from
    calib_path: Optional[str] = None        # --calib-data, else the recipe's dataset
    dataset: Optional[str] = None           # the data the job reads, as the written recipe pins it (absolute)
    part_file_size: Optional[float] = None  # GiB, from the recipe's saver
    notes: dict = field(default_factory=dict)
    dataset_sha256: Optional[str] = None    # its content, pinned in the written recipe

    @property
    def file_name(self) -> str:
        if not MODEL_TYPE_NAME.fullmatch(self.model_type):     # resolve() only makes such names
            raise QuantError(f"model type {self.model_type!r} cannot name a file")
        return f"{self.model_type}{RECIPE_SUFFIX}"

    def yaml_text(self) -> str:
        return modelslim_yaml.to_yaml(self.recipe, dataset=self.dataset, dataset_sha256=self.dataset_sha256,
                                      part_file_size=self.part_file_size,
                                      metadata={"config_id": f"dsquant_{self.model_type}", "verified_model_types":
                                                [self.model_type]},
                                      notes={"written by": "dsquant (python -m jobs.quantize)", "recipe": self.source,
                                             **self.notes})


def verified_model_types(rf: modelslim_yaml.RecipeFile, source: str) -> list[str]:
    """The recipe's ``metadata.verified_model_types``: a list of model names, each a known model type or a
    plain file-name stem (the first names the recipe file the job writes beside its weights); QuantError
    naming the field otherwise (a path, ``..``, a non-string would name a file outside the output)."""
    raw = rf.metadata.get("verified_model_types")
    if raw is None:
        return []
    where = f"{source}: metadata.verified_model_types"
    if not isinstance(raw, list):
        raise QuantError(f"{where}: expected a list of model names, got {type(raw).__name__}")
    for k, name in enumerate(raw):
        if not (isinstance(name, str) and (name in presets.MODEL_TYPES or MODEL_TYPE_NAME.fullmatch(name))):
            raise QuantError(f"{where}[{k}]: {name!r} is not a model name (known: {', '.join(presets.MODEL_TYPES)}; "
                             "else letters, digits, '.', '_', '-', at most 64, not starting with '.')")
    return raw


def _legacy_steps(req: RecipeRequest) -> tuple:
    if req.disable_anti and req.anti_method not in (None, "none"):
        raise QuantError(f"--anti-method {req.anti_method} and --disable-anti contradict each other; give one")
    method = "none" if req.disable_anti else (req.anti_method or "m4")
    if method not in ANTI_METHODS:
        raise QuantError(f"--anti-method: unknown method {method!r} (known: {', '.join(ANTI_METHODS)})")
    steps: list = [QuaRot(block_size=LEGACY_QUAROT_BLOCK)] if req.rot else []
    if method == "m4":
        steps.append(IterSmooth(alpha=0.5, scale_min=1e-5, symmetric=False, enable_subgraph_type=PRESET_SUBGRAPHS))
    elif method == "m6":
        steps.append(FlexSmooth(enable_subgraph_type=PRESET_SUBGRAPHS))
    return tuple(steps)


def _carried(ids: list[int], cfg: DeepseekV3Config, drop_mtp: bool) -> list[int]:
    """The layers of ``ids`` the output carries: all, or the main ones when the MTP layer is left out."""
    return [i for i in ids if not (drop_mtp and i >= cfg.num_hidden_layers)]


def resolve(req: RecipeRequest, model_path: Optional[str], cfg: DeepseekV3Config,
            log: Callable[[str], None] = print) -> ResolvedRecipe:
    """The job's recipe from ``req`` for the checkpoint at ``model_path`` (None: the embedded model, whose
    directory name is not read as a model name) with config ``cfg``."""
    if req.quant_mtp is not None and req.quant_mtp not in QUANT_MTP:
        raise QuantError(f"--quant-mtp: unknown mode {req.quant_mtp!r} (known: {', '.join(QUANT_MTP)})")
    if req.model_type is not None:
        presets.check_model_type(req.model_type)
    ids = layout.all_layer_ids(cfg)
    notes: dict = {}
    base = Recipe(calib_products=req.calib_products, calibration=req.calibration)
    legacy_given = [f for f, v in (("--anti-method", req.anti_method), ("--disable-anti", req.disable_anti or None),
                                   ("--rot", req.rot or None)) if v is not None]
    if req.config_path is not None or req.quant_type is not None:
        if legacy_given:
            raise QuantError(f"{', '.join(legacy_given)}: the legacy script's flags do not combine with "
                             f"{'--config-path' if req.config_path else '--quant-type'}; put the step in the recipe")
        if req.config_path is not None and req.quant_type is not None:
            raise QuantError("--config-path and --quant-type both name a recipe; give one")
        if req.config_path is not None:
            rf = modelslim_yaml.load(req.config_path, base)
            source = f"recipe {req.config_path}"
        else:
            if req.model_type is None:
                raise QuantError("--quant-type needs --model-type (one of " + ", ".join(presets.MODEL_TYPES) + ")")
            path = presets.preset_path(req.model_type, req.quant_type)
            rf = modelslim_yaml.load(path, base)
            source = f"preset {req.model_type} {req.quant_type} ({path.rsplit('/', 1)[-1]})"
        recipe = rf.recipe
        drop = recipe.drop_mtp if req.quant_mtp is None else req.quant_mtp == "none"
        kept = _carried(ids, cfg, drop)
        listed = presets.pattern_layers(recipe.fa_exclude)
        missing = [i for i in listed if i not in ids]
        if recipe.fa_quant and missing:
            log(f"warning: the recipe's fa3_quant exclude names layers {missing} that this checkpoint does not have "
                f"(layers 0..{ids[-1]}); FA3 stays off {[i for i in listed if i in ids]} where they exist")
        if recipe.fa_quant and listed:
            notes["fa3"] = f"FA3 off layers {[i for i in listed if i in kept]} ({source})"
        meta_types = verified_model_types(rf, source)
        if req.model_type is not None and meta_types and req.model_type not in meta_types:
            log(f"warning: {source}: metadata.verified_model_types {meta_types} does not name --model-type "
                f"{req.model_type}; the recipe was not verified for it")
        model_type = req.model_type or (meta_types[0] if meta_types else None) \
            or (presets.model_type_from_path(model_path) if model_path else None) or DEFAULT_MODEL_TYPE
        calib = req.calib_data or rf.dataset_path()
        part = rf.part_file_size
        if req.fa_quant is False:
            recipe = dataclasses.replace(recipe, fa_quant=False)
        if req.quant_mtp is not None:
            recipe = dataclasses.replace(recipe, quantize_mtp=req.quant_mtp == "mix", drop_mtp=drop)
    else:
        drop = req.quant_mtp == "none"
        kept = _carried(ids, cfg, drop)
        fa = presets.existing_layers(presets.legacy_fa3_list(model_path, req.model_type), kept, log)
        fa_quant = req.fa_quant if req.fa_quant is not None else True
        recipe = dataclasses.replace(base, steps=_legacy_steps(req), fa_quant=fa_quant,
                                     fa_exclude_layers=fa.layers if fa_quant else (),
                                     quantize_mtp=req.quant_mtp == "mix", drop_mtp=drop)
        if fa_quant:
            notes["fa3"] = fa.describe()
            log(fa.describe())
        model_type = req.model_type or (presets.model_type_from_path(model_path) if model_path else None) or DEFAULT_MODEL_TYPE
        anti = "none" if req.disable_anti else (req.anti_method or "m4")
        source = f"legacy flags (anti-outlier {anti}{', QuaRot' if req.rot else ''}, MTP " \
                 f"{req.quant_mtp or 'float'})"
        calib, part = req.calib_data, None
    extra = tuple(sorted(i for i in set(recipe.fa_exclude_layers) | set(req.fa_exclude_layers)
                         if i in kept or i not in ids))   # an MTP layer the output leaves out: nothing to exclude
    if drop:
        notes["mtp"] = (f"none: the MTP layer (model.layers.{cfg.num_hidden_layers}) is not read, calibrated or "
                        "written; config.json is the source's")
    recipe = dataclasses.replace(recipe, fa_exclude_layers=extra, smooth=req.smooth or recipe.smooth,
                                 dynamic=req.dynamic or recipe.dynamic,
                                 mlp_smooth_layers=tuple(sorted(set(recipe.mlp_smooth_layers)
                                                                | set(req.mlp_smooth_layers))),
                                 dialect=req.dialect or (recipe.dialect if req.config_path or req.quant_type
                                                         else "seed"))
    recipe.check_config(cfg)
    if recipe.linear_rules:
        check_rules(recipe, cfg, source, log)
    dataset, pin = modelslim_yaml.dataset_pin(calib)     # a rerun of the written recipe reads this data or stops
    return ResolvedRecipe(recipe, model_type, source, calib, dataset, part, notes, pin)


def quantized_linears(recipe: Recipe, cfg: DeepseekV3Config) -> list[str]:
    """The linears of the layers the recipe quantizes (the MTP layer only with ``quantize_mtp``)."""
    names: list[str] = []
    for lid in layout.all_layer_ids(cfg):
        if lid < cfg.num_hidden_layers or recipe.quantize_mtp:
            names += [m for m in dict.fromkeys(n.rsplit(".", 1)[0] for n in layout.layer_shapes(cfg, lid))
                      if layout.is_quantizable_linear(m)]
    return names


def check_rules(recipe: Recipe, cfg: DeepseekV3Config, source: str, log: Callable[[str], None]) -> None:
    """A warning naming each linear_quant rule that decides no linear of the model (its patterns match
    none, or an earlier rule takes them all); QuantError when the recipe then quantizes nothing at all
    (no linear, no FA3 layer): an output that would pass jobs.check unquantized."""
    rules = recipe.rules
    used = [0] * len(rules)
    for name in quantized_linears(recipe, cfg):
        k = next((k for k, r in enumerate(rules) if r.matches(name)), None)
        if k is not None:
            used[k] += 1
    if not any(used) and not any(recipe.fa_layer(cfg, i) for i in layout.all_layer_ids(cfg)):
        raise QuantError(f"{source}: no linear_quant rule matches a linear of this model and FA3 is off: the "
                         "output would be the float model; check the include patterns")
    for k, (rule, n) in enumerate(zip(rules, used)):
        if not n:
            log(f"warning: {source}: linear_quant rule {k + 1} of {len(rules)} (include {list(rule.include)}, "
                f"exclude {list(rule.exclude)}) decides no linear of this model: its patterns match none, or an "
                "earlier rule takes them")
