"""The pre-processing steps of a recipe, as msModelSlim's modelslim_v1 YAML names them (docs/recipes.md).

    quarot             QuaRot: a block-diagonal random Hadamard on the residual stream and pairwise rotations
                       inside attention, norms fused into the linears they feed; data-free
    iter_smooth        msModelSlim's "m4" outlier suppression: per-channel scales (and, when not symmetric, a
                       per-channel shift on norm-linear subgraphs) from activation statistics
    flex_smooth_quant  SmoothQuant with alpha / beta searched per subgraph from calibration activations

They run in the recipe's order, in front of the quantization (``linear_quant`` rules and ``fa3_quant``, which
are :class:`pipeline.quant.recipe.recipe.Recipe` fields, not steps). Each is a frozen dataclass built strictly from
the YAML mapping (an unknown key is an error naming it) and written back in the same form
(:meth:`to_yaml`), so that the recipe written next to the weights runs again as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.patterns import check_patterns
from pipeline.strict import check_keys

SUBGRAPH_TYPES = ("norm-linear", "linear-linear", "ov", "up-down")  # msModelSlim's names
PRESET_SUBGRAPHS = ("norm-linear", "ov")  # what msModelSlim's DeepSeek recipes enable (its adapter offers up-down too)


def _number(where: str, v: Any, *, optional: bool = False) -> Optional[float]:
    """``v`` as a float strictly inside (0, 1), as msModelSlim validates alpha, beta and scale_min; a numeric
    string too, as its pydantic models take it (YAML 1.1 reads ``1e-5`` as a string)."""
    if v is None and optional:
        return None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
        raise QuantError(f"{where}: must be a number strictly between 0 and 1, got {v!r}")
    return float(v)


def _patterns(where: str, v: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if v is None:
        return default
    if isinstance(v, str) or not isinstance(v, (list, tuple)) or not all(isinstance(p, str) and p for p in v):
        raise QuantError(f"{where}: must be a list of module-name patterns such as ['*self_attn*'], got {v!r}")
    return check_patterns(v, where)


def _subgraphs(where: str, v: Any) -> tuple[str, ...]:
    if v is None:
        return SUBGRAPH_TYPES
    if isinstance(v, str) or not isinstance(v, (list, tuple)):
        raise QuantError(f"{where}: must be a list of subgraph types from {list(SUBGRAPH_TYPES)}, got {v!r}")
    bad = [s for s in v if s not in SUBGRAPH_TYPES]
    if bad:
        raise QuantError(f"{where}: unknown subgraph type(s) {bad} (known: {list(SUBGRAPH_TYPES)})")
    return tuple(v)


@dataclass(frozen=True)
class QuaRot:
    """msModelSlim's offline QuaRot. ``block_size`` -1: one Hadamard over each whole rotated dimension."""

    block_size: int = -1
    online: bool = False
    down_proj_online_layers: tuple[int, ...] = ()
    max_tp_size: int = 4
    export_extra_info: bool = True
    type: str = "quarot"

    def __post_init__(self):
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or not (b == -1 or (b >= 2 and b & (b - 1) == 0)):
            raise QuantError(f"quarot.block_size: must be -1 or a power of two >= 2, got {b!r}")
        if self.online is not False:
            raise QuantError("quarot.online: only offline QuaRot (false) is supported: online rotation needs the "
                             "serving side to rotate activations at run time")
        if self.down_proj_online_layers:
            raise QuantError("quarot.down_proj_online_layers: online rotations are not supported (leave it empty)")
        t = self.max_tp_size
        if isinstance(t, bool) or not isinstance(t, int) or t < 1 or t & (t - 1):
            raise QuantError(f"quarot.max_tp_size: must be a power of two >= 1, got {t!r}")
        if not isinstance(self.export_extra_info, bool):
            raise QuantError(f"quarot.export_extra_info: must be a boolean, got {self.export_extra_info!r}")


@dataclass(frozen=True)
class IterSmooth:
    """msModelSlim's iter_smooth ("m4"); the defaults are its processor's (the legacy DeepSeek script passes
    alpha 0.5 and ``symmetric: False``)."""

    alpha: float = 0.9
    scale_min: float = 1e-5
    symmetric: bool = True
    enable_subgraph_type: tuple[str, ...] = SUBGRAPH_TYPES
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    type: str = "iter_smooth"

    def __post_init__(self):
        object.__setattr__(self, "alpha", _number("iter_smooth.alpha", self.alpha))
        object.__setattr__(self, "scale_min", _number("iter_smooth.scale_min", self.scale_min))
        if not isinstance(self.symmetric, bool):
            raise QuantError(f"iter_smooth.symmetric: must be a boolean, got {self.symmetric!r}")


@dataclass(frozen=True)
class FlexSmooth:
    """msModelSlim's flex_smooth_quant: alpha and beta searched per subgraph unless given."""

    alpha: Optional[float] = None
    beta: Optional[float] = None
    enable_subgraph_type: tuple[str, ...] = SUBGRAPH_TYPES
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    type: str = "flex_smooth_quant"

    def __post_init__(self):
        object.__setattr__(self, "alpha", _number("flex_smooth_quant.alpha", self.alpha, optional=True))
        object.__setattr__(self, "beta", _number("flex_smooth_quant.beta", self.beta, optional=True))


Step = Union[QuaRot, IterSmooth, FlexSmooth]
STEP_TYPES: dict[str, type] = {"quarot": QuaRot, "iter_smooth": IterSmooth, "flex_smooth_quant": FlexSmooth}


def step_from_dict(raw: Mapping[str, Any], where: str) -> Step:
    """One ``spec.process`` entry of a pre-processing type, strictly."""
    kind = raw.get("type")
    cls = STEP_TYPES.get(kind)
    if cls is None:
        raise QuantError(f"{where}: not a pre-processing step: {kind!r} (known: {sorted(STEP_TYPES)})")
    kw = check_keys(raw, cls, f"{where} ({kind})", QuantError)
    for key in ("include", "exclude"):
        if key in kw:
            kw[key] = _patterns(f"{where}.{key}", kw[key], ("*",) if key == "include" else ())
    if "enable_subgraph_type" in kw:
        kw["enable_subgraph_type"] = _subgraphs(f"{where}.enable_subgraph_type", kw["enable_subgraph_type"])
    if "down_proj_online_layers" in kw:
        v = kw["down_proj_online_layers"]
        if not isinstance(v, (list, tuple)):
            raise QuantError(f"{where}.down_proj_online_layers: must be a list of layer ids, got {v!r}")
        kw["down_proj_online_layers"] = tuple(v)
    try:
        return cls(**kw)
    except (TypeError, QuantError) as e:
        raise QuantError(f"{where}: {e}") from None


def step_to_yaml(step: Step) -> dict[str, Any]:
    """The step as its YAML mapping, ``type`` first, lists as lists (only fields that differ from the
    defaults besides ``type``, as a person writes them)."""
    out: dict[str, Any] = {"type": step.type}
    default = type(step)()
    for f in dataclasses.fields(step):
        if f.name == "type":
            continue
        v = getattr(step, f.name)
        if v != getattr(default, f.name) or f.name in ("enable_subgraph_type", "include", "block_size"):
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def step_fingerprint(step: Step) -> dict[str, Any]:
    """Every field, for a job's fingerprint (pipeline.quant.job.job_state)."""
    return {f.name: (list(v) if isinstance(v := getattr(step, f.name), tuple) else v) for f in dataclasses.fields(step)}
