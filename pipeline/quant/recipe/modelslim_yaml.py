"""msModelSlim's modelslim_v1 recipe files: read one into a :class:`~pipeline.quant.recipe.recipe.Recipe`, and write the
recipe a job ran next to its weights (``<model_type>_best_practice.yaml``, as msModelSlim does), in a form
that runs again as it is (docs/recipes.md).

What is read, strictly (a key or process type not listed is an error naming it, never ignored):

    apiversion: modelslim_v1
    metadata: {...}                       free-form, kept
    <name>: {act: ..., weight: ...}        qconfig definitions for YAML anchors (``&default_w8a8``)
    spec:
      process:                            in order
        - type: quarot | iter_smooth | flex_smooth_quant          pre-processing (pipeline.quant.recipe.steps)
        - type: group, configs: [linear_quant, ...]                 the linear rules
        - type: linear_quant, qconfig, include, exclude             a linear rule
        - type: fa3_quant, include, exclude[, qconfig]              the int8 latent cache (FA3)
      dataset: calib.json                 resolved next to the recipe, then in the working directory
      save: [{type: ascendv1_saver | mindie_format_saver, part_file_size: 4}]
      runner: auto | layer_wise | model_wise                         accepted (this project runs layer-wise)
    dsquant: {...}                        this project's own Recipe fields on top (fa_exclude_layers, ...),
                                          and dataset_sha256: the content spec.dataset must have

Anchors and aliases are YAML's own (``yaml.safe_load`` resolves them).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import yaml

from pipeline.format.description import ASCEND_V1, SEED
from pipeline.quant.recipe.linear_rules import LinearRule, default_rules, kind_of_qconfig
from pipeline.quant.recipe.patterns import check_patterns
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.recipe.steps import STEP_TYPES, step_from_dict, step_to_yaml

API_VERSION = "modelslim_v1"
MAX_RECIPE_BYTES = 4 * 1024 ** 2   # a recipe is a few KiB; tens of thousands of patterns still fit
TOP_KEYS = ("apiversion", "metadata", "spec", "dsquant")
SPEC_KEYS = ("process", "dataset", "save", "runner")
RUNNERS = ("auto", "layer_wise", "model_wise", "dp_layer_wise")
SAVERS = {"ascendv1_saver": ASCEND_V1, "mindie_format_saver": SEED}
FA3_QCONFIG = {"dtype": "int8", "scope": "per_head", "symmetric": True, "method": "minmax"}
# msModelSlim process types this project does not run, so that the error says what they are
NOT_SUPPORTED = ("smooth_quant", "awq", "flex_awq_ssz", "kv_smooth", "gptq", "autoround", "flat_quant",
                 "adapt_rotation", "dynamic_cache", "module_func", "load", "histogram", "laos", "pdmix", "ssz",
                 "float_sparse")
DATASET_SHA256 = "dataset_sha256"   # dsquant's pin of spec.dataset's content (written by the job)
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# Recipe fields the dsquant section may set (the rest come from spec)
DSQUANT_KEYS = ("fa_exclude_layers", "dynamic", "quantize_mtp", "drop_mtp", "smooth", "q_ratio", "k_ratio",
                "v_ratio", "calib_products", "dialect", "calibration", "mlp_smooth_layers", "mlp_smooth_alpha")


@dataclass(frozen=True)
class RecipeFile:
    """A parsed recipe file: the Recipe, and what else it says about the job."""

    recipe: Recipe
    path: Optional[str] = None              # where it was read from (None: built in code)
    dataset: Optional[str] = None           # spec.dataset as written
    dataset_sha256: Optional[str] = None    # dsquant.dataset_sha256: the content the dataset must have
    saver: str = "ascendv1_saver"
    part_file_size: Optional[float] = None  # GiB, None: not given
    metadata: dict = field(default_factory=dict)

    def dataset_path(self, cwd: Optional[str] = None) -> Optional[str]:
        """``spec.dataset`` as a file: an absolute path or URL as is; a bare name next to the recipe
        file, then in the working directory. A clear error when it is in neither place."""
        if self.dataset is None:
            return None
        d = self.dataset
        if "://" in d or os.path.isabs(d):
            return self._pinned(d)
        tried = []
        if self.path is not None and "://" not in self.path:
            near = os.path.join(os.path.dirname(os.path.abspath(self.path)), d)
            tried.append(near)
            if os.path.exists(near):
                return self._pinned(near)
        here = os.path.join(cwd or os.getcwd(), d)
        tried.append(here)
        if os.path.exists(here):
            return self._pinned(here)
        raise QuantError(f"{self.path or 'recipe'}: spec.dataset {d!r} not found (looked at {', '.join(tried)}); "
                         "give --calib-data to use another file")


    def _pinned(self, path: str) -> str:
        """``path``, after checking its content against ``dsquant.dataset_sha256`` when the recipe pins it."""
        if self.dataset_sha256 is None:
            return path
        from pipeline.io import storage

        try:
            got = storage.file_sha256(path)[1]
        except OSError as e:
            raise QuantError(f"{self.path or 'recipe'}: spec.dataset {path}: cannot be read "
                             f"({storage.describe_os_error(e)})") from None
        if got != self.dataset_sha256:
            raise QuantError(f"{self.path or 'recipe'}: spec.dataset {path} is not the data the recipe was run with "
                             f"(sha256 {got[:12]}..., dsquant.dataset_sha256 {self.dataset_sha256[:12]}...); give "
                             "--calib-data to use it anyway")
        return path


def dataset_pin(path: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(absolute location, sha256) of the calibration data a job read, for the recipe it writes: a rerun
    from anywhere reads the same file or stops. (None, None) for the default texts; no sha256 when the file
    cannot be read (the job then fails on it anyway)."""
    if path is None:
        return None, None
    from pipeline.io import storage

    where = path if storage.is_url(path) else os.path.abspath(path[len("file://"):] if path.startswith("file://")
                                                            else path)
    try:
        return where, storage.file_sha256(where)[1]
    except (OSError, ValueError):
        return where, None


def _err(where: str, msg: str) -> QuantError:
    return QuantError(f"{where}: {msg}")


def _list(raw: Any, where: str) -> list:
    if not isinstance(raw, list):
        raise _err(where, f"expected a list, got {type(raw).__name__}")
    return raw


def _patterns(raw: Mapping, key: str, where: str, default: tuple[str, ...]) -> tuple[str, ...]:
    v = raw.get(key)
    if v is None:
        return default
    if not isinstance(v, list) or not all(isinstance(p, str) and p for p in v):
        shown = repr(v) if len(repr(v)) <= 200 else repr(v)[:197] + "..."
        raise _err(f"{where}.{key}", f"expected a list of module-name patterns, got {shown}")
    return check_patterns(v, f"{where}.{key}")      # each pattern's braces paired and bounded


def _linear(raw: Mapping, where: str) -> LinearRule:
    unknown = sorted(set(raw) - {"type", "qconfig", "include", "exclude"})
    if unknown:
        raise _err(where, f"unknown key(s) {unknown} for linear_quant (known: ['exclude', 'include', 'qconfig', 'type'])")
    if "qconfig" not in raw:
        raise _err(where, "linear_quant needs a qconfig")
    kind = kind_of_qconfig(raw["qconfig"], f"{where}.qconfig")
    return LinearRule(kind, _patterns(raw, "include", where, ("*",)), _patterns(raw, "exclude", where, ()))


def _fa3(raw: Mapping, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    unknown = sorted(set(raw) - {"type", "qconfig", "include", "exclude", "details"})
    if unknown:
        raise _err(where, f"unknown key(s) {unknown} for fa3_quant (known: ['details', 'exclude', 'include', "
                          "'qconfig', 'type'])")
    if raw.get("details") is not None:
        raise _err(f"{where}.details", "per-branch FA3 settings (fp8 q/k/v) are not supported: this format "
                                       "holds int8 per-head FA3 (leave details out)")
    q = raw.get("qconfig")
    if q is not None:
        if not isinstance(q, Mapping) or set(q) - set(FA3_QCONFIG):
            raise _err(f"{where}.qconfig", f"expected {FA3_QCONFIG}, got {q!r}")
        diff = {k: q[k] for k in q if q[k] != FA3_QCONFIG[k]}
        if diff:
            raise _err(f"{where}.qconfig", f"{diff} is not supported (FA3 here is {FA3_QCONFIG})")
    return _patterns(raw, "include", where, ("*",)), _patterns(raw, "exclude", where, ())


def _unknown_type(kind: Any, where: str) -> QuantError:
    if kind in NOT_SUPPORTED:
        return _err(where, f"process type {kind!r} is msModelSlim's but not supported here "
                           f"(supported: {sorted([*STEP_TYPES, 'group', 'linear_quant', 'fa3_quant'])})")
    return _err(where, f"unknown process type {kind!r} (known: {sorted([*STEP_TYPES, 'group', 'linear_quant', 'fa3_quant'])})")


def _top_level_ok(key: str, value: Any) -> bool:
    """An extra top-level key is a qconfig (or a set of them) defined for anchors, as msModelSlim's
    lab_practice files and its own export write them."""
    if not isinstance(value, Mapping):
        return False
    return set(value) <= {"act", "weight"} or set(value) <= set(FA3_QCONFIG)


def parse(raw: Any, path: Optional[str] = None, base: Recipe = Recipe()) -> RecipeFile:
    """A loaded modelslim_v1 document -> RecipeFile. ``base`` gives the fields the file does not set
    (the job's own options: dialect defaults to the saver's)."""
    where = path or "recipe"
    if not isinstance(raw, Mapping):
        raise _err(where, f"expected a mapping at the top, got {type(raw).__name__}")
    if raw.get("apiversion") != API_VERSION:
        raise _err(where, f"apiversion must be {API_VERSION!r}, got {raw.get('apiversion')!r}")
    for key, value in raw.items():
        if key not in TOP_KEYS and not _top_level_ok(key, value):
            raise _err(where, f"unknown top-level key {key!r} (known: {list(TOP_KEYS)}, and qconfig definitions "
                              "for anchors)")
    spec = raw.get("spec")
    if not isinstance(spec, Mapping):
        raise _err(f"{where}: spec", "missing, or not a mapping")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise _err(f"{where}: spec", f"unknown key(s) {unknown} (known: {list(SPEC_KEYS)})")
    runner = spec.get("runner", "auto")
    if runner not in RUNNERS:
        raise _err(f"{where}: spec.runner", f"unknown runner {runner!r} (known: {list(RUNNERS)})")

    steps, rules = [], []
    fa: Optional[tuple[tuple[str, ...], tuple[str, ...]]] = None
    quantizing = False
    for k, item in enumerate(_list(spec.get("process"), f"{where}: spec.process")):
        at = f"{where}: spec.process[{k}]"
        if not isinstance(item, Mapping):
            raise _err(at, f"expected a mapping with a type, got {item!r}")
        kind = item.get("type")
        if kind in STEP_TYPES:
            if quantizing:
                raise _err(at, f"{kind} after a quantization step: anti-outlier and rotation steps run before "
                               "linear_quant / fa3_quant")
            steps.append(step_from_dict(item, at))
        elif kind == "group":
            extra = sorted(set(item) - {"type", "configs"})
            if extra:
                raise _err(at, f"unknown key(s) {extra} for group (known: ['configs', 'type'])")
            for j, sub in enumerate(_list(item.get("configs"), f"{at}.configs")):
                sat = f"{at}.configs[{j}]"
                if not isinstance(sub, Mapping):
                    raise _err(sat, f"expected a mapping with a type, got {sub!r}")
                if sub.get("type") == "linear_quant":
                    rules.append(_linear(sub, sat))
                elif sub.get("type") == "fa3_quant":
                    if fa is not None:
                        raise _err(sat, "a second fa3_quant")
                    fa = _fa3(sub, sat)
                else:
                    raise _unknown_type(sub.get("type"), sat)
            quantizing = True
        elif kind == "linear_quant":
            rules.append(_linear(item, at))
            quantizing = True
        elif kind == "fa3_quant":
            if fa is not None:
                raise _err(at, "a second fa3_quant")
            fa = _fa3(item, at)
            quantizing = True
        else:
            raise _unknown_type(kind, at)
    if not rules:
        raise _err(f"{where}: spec.process", "no linear_quant: the recipe quantizes nothing")

    saver, part = "ascendv1_saver", None
    saves = spec.get("save")
    if saves is not None:
        saves = _list(saves, f"{where}: spec.save")
        if len(saves) != 1:
            raise _err(f"{where}: spec.save", f"exactly one saver is supported, got {len(saves)}")
        s = saves[0]
        if not isinstance(s, Mapping) or s.get("type") not in SAVERS:
            raise _err(f"{where}: spec.save[0]", f"type must be one of {sorted(SAVERS)}, got "
                                                 f"{s.get('type') if isinstance(s, Mapping) else s!r}")
        extra = sorted(set(s) - {"type", "part_file_size", "ext"})
        if extra:
            raise _err(f"{where}: spec.save[0]", f"unknown key(s) {extra} (known: ['ext', 'part_file_size', 'type'])")
        if s.get("ext"):
            raise _err(f"{where}: spec.save[0].ext", f"saver extensions are not supported, got {s['ext']!r}")
        saver = s["type"]
        if "part_file_size" in s:
            part = s["part_file_size"]
            if isinstance(part, bool) or not isinstance(part, (int, float)) or not 0 <= part < math.inf:
                raise _err(f"{where}: spec.save[0].part_file_size", f"must be a finite number of GiB >= 0 (0: one "
                                                                     f"file), got {part!r}")
    dataset = spec.get("dataset")
    if dataset is not None and (not isinstance(dataset, str) or not dataset):
        raise _err(f"{where}: spec.dataset", f"expected a file name, got {dataset!r}")

    fields = {"linear_rules": () if tuple(rules) == default_rules() else tuple(rules), "steps": tuple(steps),
              "fa_quant": fa is not None, "fa_include": fa[0] if fa else ("*",), "fa_exclude": fa[1] if fa else (),
              "quantize_mtp": True, "dialect": SAVERS[saver]}
    own = raw.get("dsquant") or {}
    if not isinstance(own, Mapping):
        raise _err(f"{where}: dsquant", f"expected a mapping, got {own!r}")
    bad = sorted(set(own) - set(DSQUANT_KEYS) - {DATASET_SHA256})
    if bad:
        raise _err(f"{where}: dsquant", f"unknown key(s) {bad} (known: {[*DSQUANT_KEYS, DATASET_SHA256]})")
    pin = own.get(DATASET_SHA256)
    if pin is not None and not (isinstance(pin, str) and SHA256_HEX.fullmatch(pin)):
        raise _err(f"{where}: dsquant.{DATASET_SHA256}", f"expected 64 lowercase hex digits, got {pin!r}")
    if pin is not None and dataset is None:
        raise _err(f"{where}: dsquant.{DATASET_SHA256}", "pins spec.dataset, which the recipe does not give")
    fields.update({k: tuple(v) if isinstance(v, list) else v for k, v in own.items() if k != DATASET_SHA256})
    if own.get("drop_mtp") is True and "quantize_mtp" not in own:  # the MTP layer left out: nothing to quantize
        fields["quantize_mtp"] = False
    recipe = dataclasses.replace(base, **fields)
    metadata = raw.get("metadata") or {}
    return RecipeFile(recipe, path, dataset, pin, saver, part, dict(metadata) if isinstance(metadata, Mapping) else {})


def load(path: str, base: Recipe = Recipe()) -> RecipeFile:
    """Read and parse a recipe file (local path or URL); one-line errors for an unreadable or invalid file."""
    from pipeline.io import storage

    try:
        text = storage.read_small(path, MAX_RECIPE_BYTES, "recipe file").decode("utf-8")
    except FileNotFoundError:
        raise QuantError(f"{path}: recipe file not found") from None
    except UnicodeDecodeError as e:
        raise QuantError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except IsADirectoryError:
        raise QuantError(f"{path}: is a directory, not a recipe file") from None
    except storage.StorageError as e:      # not a regular file, too large, a store that refuses
        raise QuantError(str(e)) from None
    except OSError as e:
        raise QuantError(f"{path}: recipe file cannot be read ({e.strerror or e})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise QuantError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise QuantError(f"{path}: nested too deeply") from None
    return parse(raw, path, base)


def to_yaml(recipe: Recipe, *, dataset: Optional[str] = None, saver: Optional[str] = None,
            part_file_size: Optional[float] = None, metadata: Optional[Mapping[str, Any]] = None,
            notes: Optional[Mapping[str, Any]] = None, dataset_sha256: Optional[str] = None) -> str:
    """The recipe as a modelslim_v1 document (what :func:`parse` reads back to the same Recipe): the
    process list, then ``dsquant`` with this project's fields that differ from the defaults, and
    ``notes`` (free-form, e.g. where the FA3 exclusion list came from) as comments."""
    process: list[dict] = [step_to_yaml(st) for st in recipe.steps]
    configs = []
    for rule in recipe.rules:
        c: dict[str, Any] = {"type": "linear_quant", "qconfig": rule.qconfig(), "include": list(rule.include)}
        if rule.exclude:
            c["exclude"] = list(rule.exclude)
        configs.append(c)
    process.append({"type": "group", "configs": configs})
    if recipe.fa_quant:
        fa: dict[str, Any] = {"type": "fa3_quant", "include": list(recipe.fa_include)}
        if recipe.fa_exclude:
            fa["exclude"] = list(recipe.fa_exclude)
        process.append(fa)
    spec: dict[str, Any] = {"process": process}
    if dataset is not None:
        spec["dataset"] = dataset
    saver = saver or ("ascendv1_saver" if recipe.dialect == ASCEND_V1 else "mindie_format_saver")
    spec["save"] = [{"type": saver, **({"part_file_size": part_file_size} if part_file_size is not None else {})}]
    own = {}
    default = Recipe(quantize_mtp=True, dialect=SAVERS[saver])
    for k in DSQUANT_KEYS:
        v = getattr(recipe, k)
        if v != getattr(default, k):
            own[k] = list(v) if isinstance(v, tuple) else v
    if dataset is not None and dataset_sha256 is not None:
        own[DATASET_SHA256] = dataset_sha256
    doc: dict[str, Any] = {"apiversion": API_VERSION, "metadata": dict(metadata or {}), "spec": spec}
    if own:
        doc["dsquant"] = own
    head = "".join(f"# {k}: {v}\n" for k, v in (notes or {}).items())
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
