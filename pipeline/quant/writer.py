"""Write a quantized checkpoint directory in either msModelSlim dialect (spec/format.md), layer by layer.

::

    with QuantizedWriter(dst, "seed", model_dtype="bfloat16") as w:
        for tensors, types in layers:          # per layer: {name: Tensor}, {name: "W8A8" | ...}
            w.add(tensors, types)
        w.finish(source_config, src_dir, job={"calib": "..."})

``add`` takes a layer in the project's canonical form (the seed dialect's dtypes: scales in the model
dtype, weight_scale/weight_offset on static layers too) and converts it to the writer's dialect with
:func:`to_dialect` (for ascendV1: scales float32, no weight_scale/weight_offset on W8A8 static layers,
MTP-only FLOAT tensors float32, the router bias in the model dtype), then checks it with the checker's
per-tensor rules before anything is written.

Sharding and commit. Tensors go into shards in ``add`` order, a shard closing as soon as the next tensor
would take it past ``shard_bytes`` of tensor data, so a shard passes the limit only when one tensor alone
does. A safetensors header precedes the data, so a shard can be written once its tensors are known:
declared up front with :meth:`QuantizedWriter.plan` (each tensor's name, dtype and shape, in order;
``quantize_layer.layer_output_specs`` computes them from the config and the recipe), shards are laid out
at once and ``add`` writes every tensor straight out, holding none; without a plan ``add`` queues the
tensors handed to it (references: do not modify them afterwards), up to one shard's worth. Both write the
same files. The number of shards, and so every final name (``-00001-of-0000N``), is known only at the end,
so each complete shard is first committed under a hidden part name (``.<stem>.part-<run>-00001
.safetensors``) and ``finish`` renames the parts to their final names. ``finish`` then writes config.json,
copies the tokenizer files, generation_config.json and ``*.py`` from the source, writes ``manifest.json``
(every file's size and sha256, computed while writing, plus the caller's ``job`` info), and last the
index and ``quant_model_description.json``: a directory with a description is complete, and a crash at
any point before leaves none. On an exception inside ``with``, everything this writer wrote is removed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from pipeline import layout, storage
from pipeline.checkpoint import CONFIG_NAME
from pipeline.quant.checker_rules import MD_NAMES, check_tensors, is_fa_module, split_name
from pipeline.quant.description import (
    ASCEND_V1, DESCRIPTION_NAME, FA_QUANT_TYPE, FAQUANT, FLOAT, LAYER_ENTRY_SUFFIX, LAYER_QUANT_TYPE, MANIFEST_NAME,
    NAMING, SEED, TENSOR_TYPES, W8A8, W8A8_DYNAMIC, build_description, check_dialect, encode_description, model_quant_type,
)
from pipeline.safetensors_io import DTYPE_NAMES, SafetensorsWriter, TensorSpec, encode_header

SHARD_BYTES = 4 * 1024**3  # msModelSlim's part_file_size
COPIED_NAMES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json")
_MTP_ONLY = re.compile(r"model\.layers\.\d+\.(" + "|".join(map(re.escape, layout.MTP_ONLY_MODULES)) + r")\.weight")
_PART = re.compile(r"\..*\.part-[0-9a-f]+-\d{5}\.safetensors(\.tmp-.*)?")

DtypeLike = Union[str, torch.dtype]


def _torch_dtype(model_dtype: DtypeLike) -> torch.dtype:
    dt = getattr(torch, model_dtype) if isinstance(model_dtype, str) and model_dtype in MD_NAMES else model_dtype
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"model_dtype must be bfloat16, float16 or float32, got {model_dtype!r}")
    return dt


def to_dialect(tensors: Mapping[str, torch.Tensor], types: Mapping[str, str], dialect: str,
               model_dtype: DtypeLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A layer in the canonical (seed) form -> the same layer as ``dialect`` stores it. Idempotent; only
    floating tensors are cast (a wrong integer dtype is left for the rules to report)."""
    md = _torch_dtype(model_dtype)
    v1 = check_dialect(dialect) == ASCEND_V1
    scale_dt = torch.float32 if v1 else md
    weight_type = {split_name(n)[0]: t for n, t in types.items() if n.endswith(".weight")}
    out_t: dict[str, torch.Tensor] = {}
    out_y: dict[str, str] = {}
    for name, t in tensors.items():
        module, leaf = split_name(name)
        wt = weight_type.get(module)
        cast: Optional[torch.dtype] = None
        if is_fa_module(module) and leaf == "scale":
            cast = scale_dt
        elif wt in (W8A8, W8A8_DYNAMIC) and leaf in ("input_scale", "input_offset", "weight_scale", "weight_offset"):
            if v1 and wt == W8A8 and leaf in ("weight_scale", "weight_offset"):
                continue  # ascendV1 writes no weight_scale/weight_offset on static layers
            cast = scale_dt
        elif v1 and wt in (W8A8, W8A8_DYNAMIC) and leaf == "bias":
            cast = torch.float32
        elif v1 and types.get(name) == FLOAT:
            cast = torch.float32 if _MTP_ONLY.fullmatch(name) else md if leaf == "e_score_correction_bias" else None
        out_t[name] = t.to(cast) if cast is not None and t.is_floating_point() else t
        out_y[name] = types[name]
    return out_t, out_y


def build_config(config: Mapping[str, Any], types: Mapping[str, str], mindie_format: bool = False) -> dict:
    """config.json of the output: the source's, without its ``quantization_config`` (the FP8 one of the
    release: the output holds no FP8 tensor; msModelSlim drops any), and with ``mindie_format`` also
    ``quantize`` (the seed model_quant_type, lower case: "w8a8_dynamic" for the DeepSeek mix),
    ``mla_quantize`` (the attention linears' type: "w8a8" in the mix), ``quantization_config``
    {"fa_quant_type": "FAKQuant"} when FA3 is on, and ``model_type`` "deepseekv2"."""
    out = copy.deepcopy(dict(config))
    out.pop("quantization_config", None)
    if mindie_format:
        out["quantize"] = model_quant_type(types.values(), SEED).lower()
        attn = [t for n, t in types.items() if ".self_attn." in n and n.endswith(".weight") and t in (W8A8, W8A8_DYNAMIC)]
        out["mla_quantize"] = (attn[0] if attn else W8A8).lower()
        if FAQUANT in types.values():
            out["quantization_config"] = {"fa_quant_type": FA_QUANT_TYPE}
        out["model_type"] = "deepseekv2"
    return out


def _json_bytes(obj: Any, indent: int) -> bytes:
    return json.dumps(obj, indent=indent).encode("utf-8")


def _file_entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}




@dataclass(frozen=True)
class _Part:
    path: str
    names: tuple[str, ...]
    nbytes: int  # tensor data bytes
    size: int  # file bytes
    sha256: str


class _PartWriter:
    """One shard being written under its part name, its sha256 computed along."""

    def __init__(self, path: str, specs: Sequence[TensorSpec]):
        self.path, self.specs = path, list(specs)
        header = encode_header(self.specs)
        self._digest = hashlib.sha256(header)
        self._size = len(header) + sum(s.nbytes for s in self.specs)
        self._file = SafetensorsWriter(path, self.specs)
        self._file.__enter__()

    def write(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            self._digest.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._file.write(name, t)

    def close(self) -> _Part:
        """Commit the part (every tensor written) under its part name."""
        self._file.__exit__(None, None, None)
        nbytes = sum(s.nbytes for s in self.specs)
        return _Part(self.path, tuple(s.name for s in self.specs), nbytes, self._size, self._digest.hexdigest())

    def discard(self) -> None:
        """Drop the part: its temporary file is removed (best effort)."""
        try:
            self._file.__exit__(RuntimeError, RuntimeError("part discarded"), None)
        except Exception:
            pass


class QuantizedWriter:
    """Streams a quantized checkpoint into ``dst`` (a local path or fsspec URL); see the module doc."""

    def __init__(self, dst: str, dialect: str = SEED, *, model_dtype: DtypeLike,
                 shard_bytes: int = SHARD_BYTES, overwrite: bool = False):
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be > 0, got {shard_bytes}")
        self.dst = dst.rstrip("/") or dst
        self.dialect = check_dialect(dialect)
        self.naming = NAMING[dialect]
        self.model_dtype = _torch_dtype(model_dtype)
        self.shard_bytes = shard_bytes
        self._run = uuid.uuid4().hex[:12]
        self._types: dict[str, str] = {}
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self._planned: Optional[list[TensorSpec]] = None  # plan(): every tensor, in order
        self._shard_ends: list[int] = []  # plan(): the index in _planned just past each shard
        self._part: Optional[_PartWriter] = None  # the part being written
        self._parts: list[_Part] = []
        self._written: list[str] = []  # every path this writer created, for abort()
        self._state = "open"
        self._prepare(overwrite)

    def _prepare(self, overwrite: bool) -> None:
        """Refuse a destination that holds an output (complete or not) unless ``overwrite``; then remove
        that output, description first so that the directory stops looking complete at once."""
        if not storage.exists(self.dst):
            return
        ours = [e for e in storage.listdir(self.dst) if e in (DESCRIPTION_NAME, MANIFEST_NAME)
                or any(n.owns(e) for n in NAMING.values()) or _PART.fullmatch(e)]
        if ours and not overwrite:
            raise FileExistsError(f"{self.dst}: already holds quantized output ({', '.join(ours[:4])}); "
                                  "pass overwrite=True to replace it")
        for e in sorted(ours, key=lambda e: (e != DESCRIPTION_NAME, not e.endswith(".index.json"))):
            storage.remove(storage.join(self.dst, e))

    # ----- context manager ---------------------------------------------------------------------------
    def __enter__(self) -> "QuantizedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._state != "finished":
            self.abort()
            if exc_type is None:
                raise RuntimeError(f"{self.dst}: the with block ended without finish(); output removed")
        return False

    def abort(self) -> None:
        """Remove everything this writer wrote (parts, renamed shards, copied files); idempotent, and a
        no-op once finish() has succeeded."""
        if self._state == "finished":
            return
        self._state = "aborted"
        self._pending, self._pending_bytes = [], 0
        self._discard_part()
        for path in reversed(self._written + [p.path for p in self._parts]):
            try:
                storage.remove(path)
            except Exception:  # best effort: the error that led here is the one to report
                pass
        self._written, self._parts = [], []

    def _require_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"{self.dst}: writer is {self._state}; start a new QuantizedWriter")

    # ----- writing -----------------------------------------------------------------------------------
    def plan(self, specs: Sequence[TensorSpec]) -> None:
        """Declare every tensor ``add`` will get, in order, as this dialect stores it: shards are laid out
        now and ``add`` writes each tensor as it comes (module doc). Only before the first ``add``."""
        self._require_open()
        if self._planned is not None or self._types:
            raise RuntimeError(f"{self.dst}: plan() must come once, before the first add()")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"planned tensors repeat names: {sorted({n for n in names if names.count(n) > 1})[:5]}")
        self._planned, self._shard_ends, size = list(specs), [], 0
        for i, spec in enumerate(self._planned):
            if i and size + spec.nbytes > self.shard_bytes:
                self._shard_ends.append(i)
                size = 0
            size += spec.nbytes
        self._shard_ends.append(len(self._planned))

    def add(self, tensors: Mapping[str, torch.Tensor], types: Mapping[str, str]) -> None:
        """Write (without a plan: queue) one layer or the global tensors: whole modules, every tensor with
        its type, in either dialect's form. ascendV1's per-layer ``self_attn.quant_type: "INT8"`` entries
        may be in ``types``: they are checked and dropped, as the description derives them from the FA3
        tensors. Raises
        ValueError naming the tensors for a mismatch of names, a repeated name, a broken format rule, or a
        tensor that is not the next one planned; nothing is written then."""
        self._require_open()
        entries = {n: t for n, t in types.items() if n.endswith(LAYER_ENTRY_SUFFIX) and n not in tensors}
        if any(t != LAYER_QUANT_TYPE for t in entries.values()):
            raise ValueError(f"per-layer entries {entries} must be {LAYER_QUANT_TYPE!r}")
        types = {n: t for n, t in types.items() if n not in entries}
        if set(tensors) != set(types):
            raise ValueError(f"tensors without a type: {sorted(set(tensors) - set(types))[:5]}; "
                             f"types without a tensor: {sorted(set(types) - set(tensors))[:5]}")
        repeated = [n for n in tensors if n in self._types]
        if repeated:
            raise ValueError(f"tensors already added: {repeated[:5]}")
        unknown = {n: t for n, t in types.items() if t not in TENSOR_TYPES}
        if unknown:
            raise ValueError(f"unknown types {dict(list(unknown.items())[:5])} (known: {TENSOR_TYPES})")
        conv, conv_types = to_dialect(tensors, types, self.dialect, self.model_dtype)
        specs = {n: TensorSpec.of(n, t) for n, t in conv.items()}
        broken = check_tensors(specs, conv_types, self.dialect, DTYPE_NAMES[self.model_dtype])
        if broken:
            raise ValueError(f"{len(broken)} format violations in the {self.dialect} dialect: "
                             + "; ".join(str(v) for v in broken[:5]))
        if self._planned is not None:
            for k, got in enumerate(specs.values(), start=len(self._types)):
                want = self._planned[k] if k < len(self._planned) else None
                if got != want:
                    raise ValueError(f"tensor {got.name!r} {got.dtype} {list(got.shape)} is not the next planned "
                                     "one: " + (f"{want.name!r} {want.dtype} {list(want.shape)}" if want else
                                                "all were added"))
        try:
            for name, t in conv.items():
                if self._planned is not None:
                    self._write_planned(name, t)
                else:
                    nbytes = specs[name].nbytes
                    if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
                        self._flush()
                    self._pending.append((name, t))
                    self._pending_bytes += nbytes
                self._types[name] = conv_types[name]
        except BaseException:
            self._state = "failed"
            self._discard_part()
            raise

    def _part_path(self) -> str:
        return storage.join(self.dst, f".{self.naming.stem}.part-{self._run}-{len(self._parts) + 1:05d}.safetensors")

    def _write_planned(self, name: str, t: torch.Tensor) -> None:
        """The next planned tensor into its shard's part: the part (its header) opened first, committed
        after its last tensor."""
        k, i = len(self._parts), len(self._types)  # the shard, the tensor's index in the plan
        if self._part is None:
            self._part = _PartWriter(self._part_path(), self._planned[self._shard_ends[k - 1] if k else 0:
                                                                      self._shard_ends[k]])
        self._part.write(name, t)
        if i + 1 == self._shard_ends[k]:
            self._parts.append(self._part.close())
            self._part = None

    def _discard_part(self) -> None:
        if self._part is not None:
            self._part.discard()
            self._part = None

    def _flush(self) -> None:
        """Write the queued tensors as the next part."""
        if not self._pending:
            return
        self._part = _PartWriter(self._part_path(), [TensorSpec.of(n, t) for n, t in self._pending])
        for name, t in self._pending:
            self._part.write(name, t)
        self._parts.append(self._part.close())
        self._part = None
        self._pending, self._pending_bytes = [], 0

    def _put(self, name: str, data: bytes, files: dict[str, dict]) -> None:
        path = storage.join(self.dst, name)
        storage.write_bytes(path, data)
        self._written.append(path)
        files[name] = _file_entry(data)

    def finish(self, config: Mapping[str, Any], src_dir: Optional[str] = None, *, mindie_format: bool = False,
               job: Optional[Mapping[str, Any]] = None) -> dict:
        """Commit the shards and write the other files, the description last; returns the manifest.
        ``config``: the source's config.json object; ``src_dir``: where to copy tokenizer files etc.
        from (None: nothing copied); ``job``: free-form JSON-able info recorded in the manifest."""
        self._require_open()
        dtype = config.get("torch_dtype", config.get("dtype"))
        if dtype is not None and MD_NAMES.get(dtype) != DTYPE_NAMES[self.model_dtype]:
            raise ValueError(f"config.json says torch_dtype {dtype!r} but the tensors were written for "
                             f"{self.model_dtype}; pass the config of the model that was quantized")
        if src_dir is not None and src_dir.rstrip("/") == self.dst:
            raise ValueError(f"{self.dst}: the destination must differ from the source")
        try:
            return self._finish(config, src_dir, mindie_format, job)
        except BaseException:
            self._state = "failed"
            raise

    def _finish(self, config, src_dir, mindie_format, job) -> dict:
        self._flush()
        if self._planned is not None and len(self._types) != len(self._planned):
            missing = [s.name for s in self._planned[len(self._types):]]
            raise ValueError(f"{self.dst}: {len(missing)} planned tensors were never added: {missing[:5]}")
        if not self._parts:
            raise ValueError(f"{self.dst}: no tensors were added")
        files: dict[str, dict] = {}
        weight_map: dict[str, str] = {}
        total = sum(p.nbytes for p in self._parts)
        finals = self.naming.file_names(len(self._parts))
        for part, final in zip(self._parts, finals):
            storage.move(part.path, storage.join(self.dst, final))
            self._written.append(storage.join(self.dst, final))
            files[final] = {"size": part.size, "sha256": part.sha256}
            weight_map.update(dict.fromkeys(part.names, final))
        self._parts = []

        self._put(CONFIG_NAME, _json_bytes(build_config(config, self._types, mindie_format), 2), files)
        if src_dir is not None:
            for entry in storage.listdir(src_dir):
                if entry in COPIED_NAMES or (entry.endswith(".py") and not entry.startswith(".")):
                    self._put(entry, storage.read_bytes(storage.join(src_dir, entry)), files)

        index = None
        if finals != [self.naming.single_name]:
            index = _json_bytes({"metadata": {"total_size": total}, "weight_map": weight_map}, 2)
            files[self.naming.index_name] = _file_entry(index)
        desc = encode_description(build_description(self._types, FAQUANT in self._types.values(), self.dialect))
        files[DESCRIPTION_NAME] = _file_entry(desc)
        manifest = {"format": "msmodelslim W8A8 + FA3", "dialect": self.dialect, "tensors": len(self._types),
                    "total_size": total, "files": dict(sorted(files.items())), "job": dict(job or {})}
        self._put(MANIFEST_NAME, _json_bytes(manifest, 2), {})
        if index is not None:
            self._put(self.naming.index_name, index, {})
        self._put(DESCRIPTION_NAME, desc, {})  # last: the directory is complete from here on
        self._state = "finished"
        return manifest
