"""Presets (``--model-type X --quant-type Y``), msModelSlim's per-model FA3 exclusion lists, and the legacy
DeepSeek script's defaults (docs/msmodelslim.md).

Presets are modelslim_v1 YAML files shipped in ``pipeline/quant/recipe/presets/``; a preset is the file whose
``metadata.verified_model_types`` names the model type and whose ``metadata.label.kv_cache`` says whether
the KV cache is quantized (w8a8c8) or not (w8a8), as msModelSlim looks its ``lab_practice`` files up.

The legacy script ``quant_deepseek_w8a8.py`` keeps FA3 off a per-model list of layers, chosen from the model
path: "R1" in it (upper-cased) first, then "V3.1", then "V3"; none of them, no list. ``--model-type`` names
the model instead of the path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import resources
from typing import Callable, Optional

from pipeline.quant.numerics.qparams import QuantError

MODEL_TYPES = ("DeepSeek-V3", "DeepSeek-R1", "DeepSeek-V3.1", "DeepSeek-R1-0528")
QUANT_TYPES = ("w8a8", "w8a8c8")
FAMILY = {"DeepSeek-V3": "V3", "DeepSeek-R1": "R1", "DeepSeek-V3.1": "V3.1", "DeepSeek-R1-0528": "R1"}
# quant_deepseek_w8a8.py's disable_attn_layers
FA3_OFF = {
    "R1": (0, 1, 2, 46, 47, 50, 54, 55, 56, 57, 58, 59, 60),
    "V3.1": (0, 1, 2, 50, 51, 53, 54, 55, 56, 57, 58, 59, 60),
    "V3": (0, 1, 2, 46, 50, 51, 53, 54, 55, 56, 57, 59, 60),
}
_LAYER_PATTERN = re.compile(r"model\.layers\.(\d+)\.\*")


def family_from_path(path: str) -> Optional[str]:
    """The legacy script's reading of a model path: "R1", "V3.1", "V3" or None."""
    up = path.upper()
    for fam in ("R1", "V3.1", "V3"):
        if fam in up:
            return fam
    return None


def model_type_from_path(path: str) -> Optional[str]:
    """A model type for a path the legacy way (R1 -> DeepSeek-R1, V3.1 -> DeepSeek-V3.1, V3 -> DeepSeek-V3)."""
    fam = family_from_path(path)
    return {"R1": "DeepSeek-R1", "V3.1": "DeepSeek-V3.1", "V3": "DeepSeek-V3"}.get(fam) if fam else None


@dataclass(frozen=True)
class FA3List:
    """The FA3 exclusion list a job uses, and where it came from (for the log and the written recipe)."""

    layers: tuple[int, ...]
    source: str

    def describe(self) -> str:
        return f"FA3 off layers {list(self.layers)}: {self.source}"


def legacy_fa3_list(model_path: Optional[str], model_type: Optional[str] = None) -> FA3List:
    """The list quant_deepseek_w8a8.py would use: from ``model_type`` when given, else from the path
    (None: the embedded model, which is no DeepSeek release: no list)."""
    if model_type is not None:
        fam = FAMILY[check_model_type(model_type)]
        return FA3List(FA3_OFF[fam], f"{model_type}'s list (--model-type)")
    if model_path is None:
        return FA3List((), "no list: the embedded model is no DeepSeek release (give --model-type to choose one)")
    fam = family_from_path(model_path)
    if fam is None:
        return FA3List((), "no list: the model path names neither R1 nor V3 (give --model-type to choose one)")
    name = {"R1": "DeepSeek-R1", "V3.1": "DeepSeek-V3.1", "V3": "DeepSeek-V3"}[fam]
    return FA3List(FA3_OFF[fam], f"{name}'s list (\"{fam}\" in the model path)")


def existing_layers(fa: FA3List, layer_ids: list[int], warn: Callable[[str], None]) -> FA3List:
    """``fa`` less the layers the checkpoint does not have (as the script's ``ids < num_layer``), with a
    warning naming them."""
    have = set(layer_ids)
    missing = [i for i in fa.layers if i not in have]
    if missing:
        warn(f"warning: the FA3 exclusion list names layers {missing} that this checkpoint does not have "
             f"(layers 0..{max(layer_ids)}); kept out where they exist: {[i for i in fa.layers if i in have]}")
    return FA3List(tuple(i for i in fa.layers if i in have), fa.source)


def pattern_layers(patterns: tuple[str, ...]) -> list[int]:
    """The layer ids of ``model.layers.N.*`` patterns (an FA3 exclusion list written as patterns)."""
    return [int(m.group(1)) for p in patterns if (m := _LAYER_PATTERN.fullmatch(p))]


def check_model_type(model_type: str) -> str:
    if model_type not in MODEL_TYPES:
        raise QuantError(f"--model-type: unknown model type {model_type!r} (known: {', '.join(MODEL_TYPES)})")
    return model_type


def preset_dir() -> str:
    return str(resources.files("pipeline.quant.recipe").joinpath("presets"))


def list_presets() -> list[tuple[str, str, str]]:
    """(model type, quant type, file) of every shipped preset."""
    import yaml

    out = []
    for name in sorted(os.listdir(preset_dir())):
        if not name.endswith(".yaml"):
            continue
        path = os.path.join(preset_dir(), name)
        with open(path, encoding="utf-8") as f:
            meta = (yaml.safe_load(f) or {}).get("metadata") or {}
        quant = "w8a8c8" if (meta.get("label") or {}).get("kv_cache") else "w8a8"
        out += [(mt, quant, path) for mt in meta.get("verified_model_types") or ()]
    return out


def preset_path(model_type: str, quant_type: str) -> str:
    """The preset file for ``model_type`` and ``quant_type``; a clear error naming what exists otherwise."""
    check_model_type(model_type)
    if quant_type not in QUANT_TYPES:
        raise QuantError(f"--quant-type: unknown quant type {quant_type!r} (known: {', '.join(QUANT_TYPES)})")
    for mt, qt, path in list_presets():
        if mt == model_type and qt == quant_type:
            return path
    have = ", ".join(f"{mt} {qt}" for mt, qt, _ in list_presets())
    raise QuantError(f"no preset for --model-type {model_type} --quant-type {quant_type} (presets: {have})")


def presets_help() -> str:
    """One line per preset, for ``--help``."""
    by_file: dict[str, list[str]] = {}
    for mt, qt, path in list_presets():
        by_file.setdefault(f"{qt}: {os.path.basename(path)}", []).append(mt)
    return "; ".join(f"{k} ({', '.join(v)})" for k, v in by_file.items())
