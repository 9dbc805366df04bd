"""``quant_model_description.json`` and the file names of the two msModelSlim dialects (docs/format.md).

The description is a flat JSON object: one ``"<tensor name>": "<type>"`` entry per tensor in the weight
files, plus top-level keys. The two dialects differ in those keys and in the weight file names:

==================  ==========================================  ==========================================
                    ``seed`` (legacy API, MindIE docs)          ``ascendV1`` (YAML pipeline, the fixture)
==================  ==========================================  ==========================================
weights             ``quant_model_weight_w8a8.safetensors``,    ``quant_model_weights-0000i-of-0000N``
                    sharded ``quant_model_weight_w8a8-0000i-    ``.safetensors`` + index, even for one file
                    of-0000N.safetensors`` + index              (``quant_model_weights.safetensors``
                                                                without index when msModelSlim's
                                                                part_file_size is 0)
top-level keys      ``model_quant_type``, ``fa_quant_type``     ``fa_quant_type``, ``version`` "1.0.0",
                                                                ``model_quant_type``, ``metadata`` {},
                                                                ``group_size`` 0, ``optional`` {}
model_quant_type    ``W8A8_DYNAMIC`` if any linear is dynamic,  the highest type present, by msModelSlim's
                    else ``W8A8``                               priority FLOAT < W8A8_DYNAMIC < W8A8
per-layer entries   none                                        ``model.layers.N.self_attn.quant_type``:
                                                                ``"INT8"`` on every FA3 layer (names no
                                                                tensor), right after ``fa_q.offset``
==================  ==========================================  ==========================================
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

from pipeline.io.json_input import parse_json
from pipeline.io.safetensors_io import CheckpointError

DESCRIPTION_NAME = "quant_model_description.json"
MANIFEST_NAME = "manifest.json"  # this project's record of every file's size and sha256 (not msModelSlim's)
# the safetensors metadata of every weight shard this project writes (msModelSlim's have none): an output
# of ours is recognisable by it, and must then have its manifest (pipeline.format.checker)
SHARD_METADATA = {"producer": "dsquant"}

FLOAT, W8A8, W8A8_DYNAMIC, FAQUANT = "FLOAT", "W8A8", "W8A8_DYNAMIC", "FAQuant"
TENSOR_TYPES = (FLOAT, W8A8, W8A8_DYNAMIC, FAQUANT)
QUANT_KINDS = (W8A8, W8A8_DYNAMIC)   # the types of a linear computed with int8 weights
FA_QUANT_TYPE = "FAKQuant"
LAYER_QUANT_TYPE = "INT8"  # ascendV1's per-layer ``self_attn.quant_type`` value on FA3 layers
VERSION = "1.0.0"

SEED, ASCEND_V1 = "seed", "ascendV1"
DIALECTS = (SEED, ASCEND_V1)

# Top-level keys each dialect writes (in the order msModelSlim writes them).
SEED_KEYS = ("model_quant_type", "fa_quant_type")
ASCEND_V1_KEYS = ("fa_quant_type", "version", "model_quant_type", "metadata", "group_size", "optional")
TOP_LEVEL_KEYS = frozenset(SEED_KEYS + ASCEND_V1_KEYS)
LAYER_ENTRY_SUFFIX = ".self_attn.quant_type"

# msModelSlim's ascendV1 saver (QUANT_TYPE_PRIORITY, restricted to the types of this format).
_ASCEND_V1_PRIORITY = (FLOAT, W8A8_DYNAMIC, W8A8)


class DescriptionError(CheckpointError):
    """A description file that is not a JSON object of the expected shape; the message names the file."""


@dataclass(frozen=True)
class WeightNaming:
    """The weight file names of a dialect: ``<stem>.safetensors`` alone, or shards
    ``<stem>-00001-of-0000N.safetensors`` (5-digit index and total) with ``<stem>.safetensors.index.json``."""

    stem: str
    single_when_one: bool  # what our writer does with one shard: the single name (seed) or -00001-of-00001

    @property
    def single_name(self) -> str:
        return f"{self.stem}.safetensors"

    @property
    def index_name(self) -> str:
        return f"{self.stem}.safetensors.index.json"

    def shard_name(self, index: int, total: int) -> str:
        """1-based ``index`` of ``total``."""
        if not 1 <= index <= total <= 99999:
            raise ValueError(f"shard {index} of {total} cannot be named with 5 digits")
        return f"{self.stem}-{index:05d}-of-{total:05d}.safetensors"

    def file_names(self, total: int) -> list[str]:
        """The names our writer gives ``total`` shards."""
        if total == 1 and self.single_when_one:
            return [self.single_name]
        return [self.shard_name(i, total) for i in range(1, total + 1)]

    def parse_shard(self, name: str) -> Optional[tuple[int, int]]:
        """(index, total) of a shard name of this dialect, else None."""
        m = re.fullmatch(re.escape(self.stem) + r"-(\d{5})-of-(\d{5})\.safetensors", name)
        return (int(m.group(1)), int(m.group(2))) if m else None

    def owns(self, name: str) -> bool:
        """Whether ``name`` is a weight file or index of this dialect."""
        return name in (self.single_name, self.index_name) or self.parse_shard(name) is not None


NAMING: dict[str, WeightNaming] = {
    SEED: WeightNaming("quant_model_weight_w8a8", single_when_one=True),
    ASCEND_V1: WeightNaming("quant_model_weights", single_when_one=False),
}


def check_dialect(dialect: str) -> str:
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r} (known: {', '.join(DIALECTS)})")
    return dialect


# ----- building ----------------------------------------------------------------------------------------
def model_quant_type(types: Iterable[str], dialect: str) -> str:
    """The top-level ``model_quant_type`` a dialect writes for tensors of these types."""
    present = set(types)
    if check_dialect(dialect) == SEED:
        return W8A8_DYNAMIC if W8A8_DYNAMIC in present else W8A8 if W8A8 in present else FLOAT
    return max((t for t in present if t in _ASCEND_V1_PRIORITY), key=_ASCEND_V1_PRIORITY.index, default=FLOAT)


def layer_entry_key(layer_id: int) -> str:
    """The ascendV1 per-layer entry of an FA3 layer: ``model.layers.N.self_attn.quant_type``."""
    return f"model.layers.{layer_id}{LAYER_ENTRY_SUFFIX}"


def fa_layers(names: Iterable[str]) -> list[int]:
    """Layer ids that hold FA3 tensors (``model.layers.N.self_attn.fa_{q,k,v}.*``), sorted."""
    out = set()
    for n in names:
        m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.fa_[qkv]\.\w+", n)
        if m:
            out.add(int(m.group(1)))
    return sorted(out)


def build_description(types: Mapping[str, str], fa_quant: bool, dialect: str,
                      extra_entries: Optional[Mapping[str, Any]] = None,
                      optional: Optional[Mapping[str, Any]] = None) -> dict:
    """The description object for tensors ``types`` (name -> type, in write order).

    ``fa_quant`` must agree with the types (FAQuant tensors present iff True). ``extra_entries`` are
    further top-level keys (e.g. a future ``kv_quant_type``), written after the tensor entries as
    msModelSlim does with its appended keys; they may not reuse a key this function writes. ``optional``:
    ascendV1's ``optional`` object (QuaRot's ``{"quarot": {"rotation_map": ...}}``); the seed dialect has none.
    """
    check_dialect(dialect)
    bad = {n: t for n, t in types.items() if t not in TENSOR_TYPES}
    if bad:
        raise ValueError(f"unknown tensor types {dict(list(bad.items())[:5])} (known: {TENSOR_TYPES})")
    has_fa = FAQUANT in types.values()
    if has_fa != bool(fa_quant):
        raise ValueError(f"fa_quant={fa_quant} but FAQuant tensors are {'present' if has_fa else 'absent'}")
    clash = set(extra_entries or ()) & (set(types) | TOP_LEVEL_KEYS)
    if clash:
        raise ValueError(f"extra_entries {sorted(clash)} clash with keys the description already has")
    mqt = model_quant_type(types.values(), dialect)

    out: dict[str, Any] = {}
    if dialect == SEED:
        out["model_quant_type"] = mqt
        if fa_quant:
            out["fa_quant_type"] = FA_QUANT_TYPE
        out.update(types)
        out.update(extra_entries or {})
        return out

    fa = set(fa_layers(types))
    for name, t in types.items():
        out[name] = t
        m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.fa_q\.offset", name)
        if m and int(m.group(1)) in fa:
            out[layer_entry_key(int(m.group(1)))] = LAYER_QUANT_TYPE
            fa.discard(int(m.group(1)))
    for lid in sorted(fa):  # an FA layer without fa_q.offset (the checker will say so): entry at the end
        out[layer_entry_key(lid)] = LAYER_QUANT_TYPE
    if fa_quant:
        out["fa_quant_type"] = FA_QUANT_TYPE
    out.update(extra_entries or {})
    out.update({"version": VERSION, "model_quant_type": mqt, "metadata": {}, "group_size": 0,
                "optional": dict(optional or {})})
    return out


def encode_description(desc: Mapping[str, Any]) -> bytes:
    """The file's bytes exactly as msModelSlim writes them: 4-space indented JSON, no trailing newline."""
    return json.dumps(desc, indent=4).encode("utf-8")


# ----- parsing -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Description:
    """A parsed description: the entries split by kind, each in file order."""

    tensors: Mapping[str, Any]  # tensor name -> type (as found: the checker judges the values)
    top: Mapping[str, Any]  # top-level keys (known or not)
    layer_entries: Mapping[str, Any] = field(default_factory=dict)  # "model.layers.N.self_attn.quant_type"

    @property
    def fa_quant(self) -> bool:
        return "fa_quant_type" in self.top


def is_top_level_key(key: str) -> bool:
    """Known top-level keys, and any key without a dot (no tensor name lacks one)."""
    return key in TOP_LEVEL_KEYS or "." not in key


def parse_description(raw: Any, source: str = DESCRIPTION_NAME) -> Description:
    """Split a loaded description object into tensor entries, top-level keys and per-layer entries."""
    if not isinstance(raw, dict):
        raise DescriptionError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    tensors: dict[str, Any] = {}
    top: dict[str, Any] = {}
    layers: dict[str, Any] = {}
    for k, v in raw.items():
        if is_top_level_key(k):
            top[k] = v
        elif k.endswith(LAYER_ENTRY_SUFFIX):
            layers[k] = v
        else:
            tensors[k] = v
    return Description(tensors=tensors, top=top, layer_entries=layers)


def loads_json_object(data: bytes, source: str) -> dict:
    """Parse a JSON object, refusing duplicate keys (``json`` would silently keep the last one)."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        seen: dict[str, Any] = {}
        for k, v in pairs:
            if k in seen:
                raise DescriptionError(f"{source}: key {k!r} appears more than once")
            seen[k] = v
        return seen

    raw = parse_json(data, source, DescriptionError, object_pairs_hook=no_duplicates)
    if not isinstance(raw, dict):
        raise DescriptionError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    return raw


def detect_dialect(desc: Union[Description, Mapping[str, Any], None], weight_files: Iterable[str]) -> str:
    """The dialect a directory is written in: by its weight file names when they are one dialect's,
    else by the description (ascendV1's extra top-level keys or per-layer entries), else seed."""
    files = list(weight_files)
    owners = {d for d, naming in NAMING.items() for f in files if naming.owns(f)}
    if len(owners) == 1:
        return owners.pop()
    if desc is None:
        return SEED
    parsed = desc if isinstance(desc, Description) else parse_description(dict(desc))
    markers = set(parsed.top) & {"version", "metadata", "group_size", "optional"}
    return ASCEND_V1 if markers or parsed.layer_entries else SEED
