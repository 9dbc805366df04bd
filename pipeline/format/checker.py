"""Check a quantized checkpoint directory (ours or msModelSlim's) against docs/format.md.

:func:`check_dir` detects the dialect (or takes one to hold the directory to), reads config.json, the
description, the index and only the safetensors *headers* (two ranged reads per file; no tensor data),
and returns a :class:`Report` listing every violation with the file, tensor or key it concerns and the
rule's tag. The per-tensor rules are in :mod:`pipeline.format.checker_rules`; the directory-level ones
here:

- ``config``: config.json present, a JSON object that parses as a DeepSeek-V3 config, no FP8
  ``quantization_config`` left; its torch_dtype is the model dtype of the dtype rules and its layout
  gives the shapes (``layout-missing``/``layout-unknown``/``shape``). An output holding no tensor at all of
  the MTP layer(s) config.json counts (msModelSlim's ``--quant_mtp none``, config.json the source's) is
  valid, reported as "MTP layer not carried" (``mtp``); one holding some of them misses the others.
- ``description``: present, a JSON object without repeated keys.
- ``file-names``: weight files and index named as the dialect names them, shards 1..N of one N.
- ``weights``: every ``*.safetensors`` header readable.
- ``index``: a sharded output has the index; its weight_map names every tensor exactly once, at the file
  holding it, and only existing files; total_size is the tensor data bytes; no weight file unreferenced.
- ``key-without-tensor`` / ``tensor-without-key``: description keys = tensor names; ``type-unknown``.
- ``top-level-keys``, ``model-quant-type``, ``fa-quant-type``, ``layer-quant-type``: per dialect (see
  :mod:`pipeline.format.description`).
- ``manifest``: when manifest.json is there (the quantizer writes it; msModelSlim does not), every file it
  lists exists with the recorded size and, with ``verify`` (the default), the recorded sha256: a flipped
  byte is found. The report says which was done (``manifest``). An output whose weight shards carry this
  project's metadata (``SHARD_METADATA``) must have it: without it, the output was tampered with.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from pipeline import layout
from pipeline.io import storage
from pipeline.io.checkpoint import CONFIG_NAME
from pipeline.config import ConfigError, DeepseekV3Config
from pipeline.format.checker_rules import MD_NAMES, Violation, check_layout, check_tensors
from pipeline.format.description import (
    ASCEND_V1_KEYS, DESCRIPTION_NAME, FA_QUANT_TYPE, LAYER_QUANT_TYPE, MANIFEST_NAME, NAMING, SEED, SEED_KEYS,
    SHARD_METADATA, TENSOR_TYPES,
    Description, DescriptionError, check_dialect, detect_dialect, fa_layers, layer_entry_key, loads_json_object,
    model_quant_type, parse_description,
)
from pipeline.io.safetensors_io import CheckpointError, TensorSpec, read_header

__all__ = ["Report", "Violation", "check_dir"]


@dataclass
class Report:
    """What :func:`check_dir` found. ``ok`` when there is no violation."""

    path: str
    dialect: str
    detected: str
    weight_files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_bytes: int = 0
    type_counts: dict[str, int] = field(default_factory=dict)
    fa_layers: list[int] = field(default_factory=list)
    model_quant_type: Optional[str] = None
    mtp: str = "none in config.json"   # the MTP layer(s): "carried", "not carried", or none in config.json
    manifest: str = "none (sizes and hashes not verified)"  # what was verified against manifest.json
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, rule: str, where: str, message: str) -> None:
        self.violations.append(Violation(rule, where, message))

    def to_dict(self) -> dict:
        return {"path": self.path, "dialect": self.dialect, "detected": self.detected, "ok": self.ok,
                "weight_files": self.weight_files, "tensors": self.tensors, "total_bytes": self.total_bytes,
                "type_counts": self.type_counts, "fa_layers": self.fa_layers,
                "model_quant_type": self.model_quant_type, "mtp": self.mtp, "manifest": self.manifest,
                "violations": [{"rule": v.rule, "where": v.where, "message": v.message} for v in self.violations]}

    def to_text(self, per_rule: int = 8) -> str:
        """A readable summary: dialect, counts, FA3 layers, then the violations grouped by rule."""
        how = "detected" if self.dialect == self.detected else f"as asked; detected {self.detected}"
        lines = [f"{self.path}", f"dialect: {self.dialect} ({how})",
                 f"weights: {len(self.weight_files)} file(s), {self.tensors} tensors, {self.total_bytes} bytes",
                 "types: " + (", ".join(f"{t} {n}" for t, n in sorted(self.type_counts.items())) or "none"),
                 f"model_quant_type: {self.model_quant_type}",
                 f"FA3 layers: {', '.join(map(str, self.fa_layers)) or 'none'} ({len(self.fa_layers)})",
                 f"MTP layer: {self.mtp}",
                 f"manifest: {self.manifest}"]
        if self.ok:
            return "\n".join(lines + ["OK: no violations"])
        by_rule = Counter(v.rule for v in self.violations)
        lines.append(f"{len(self.violations)} violation(s):")
        for rule, count in by_rule.most_common():
            lines.append(f"  [{rule}] {count}")
            these = [v for v in self.violations if v.rule == rule]
            lines += [f"    {v.where}: {v.message}" for v in these[:per_rule]]
            if count > per_rule:
                lines.append(f"    ... and {count - per_rule} more")
        return "\n".join(lines)


def check_dir(path: str, dialect: Optional[str] = None, verify: bool = True) -> Report:
    """Check directory ``path`` in ``dialect`` ("seed" or "ascendV1"; default: the detected one);
    ``verify``: re-read every file the manifest lists and compare its sha256 (sizes are always compared).
    Raises CheckpointError only when ``path`` is not a readable directory; all else is a violation."""
    path = path.rstrip("/") or path
    try:
        if not storage.isdir(path):
            raise CheckpointError(f"{path}: not a directory")
        entries = [e for e in storage.listdir(path) if not e.startswith(".")]
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from None
    violations: list[Violation] = []
    cfg, md = _read_config(path, entries, violations)
    desc = _read_description(path, entries, violations)
    detected = detect_dialect(desc, entries)
    report = Report(path=path, dialect=check_dialect(dialect) if dialect else detected, detected=detected,
                    violations=violations)
    specs, ours = _read_weights(path, entries, report)
    report.tensors = len(specs)
    report.total_bytes = sum(s.nbytes for s in specs.values())
    report.fa_layers = fa_layers(specs)
    if md is None:  # no usable config: the dtype the FLOAT tensors mostly have
        floats = Counter(s.dtype for s in specs.values() if s.dtype in ("BF16", "F16"))
        md = floats.most_common(1)[0][0] if floats else "BF16"
    if desc is not None:
        _check_description(desc, specs, report)
        types = {n: t for n, t in desc.tensors.items() if n in specs}
        heads = cfg.num_attention_heads if cfg else None
        report.violations += check_tensors(specs, types, report.dialect, md, heads)
    if cfg is not None:
        carried = layout.carried_config(cfg, specs)
        if cfg.mtp_layer_ids:
            report.mtp = "carried" if carried is cfg else \
                f"not carried (config.json counts {len(cfg.mtp_layer_ids)}; msModelSlim's --quant_mtp none)"
        report.violations += check_layout(specs, carried)
    _check_manifest(path, entries, report, verify, ours)
    return report


def _read_json(path: str, name: str) -> dict:
    return loads_json_object(storage.read_bytes(storage.join(path, name)), name)


def _read_config(path: str, entries: list[str], out: list[Violation]) -> tuple[Optional[DeepseekV3Config], Optional[str]]:
    if CONFIG_NAME not in entries:
        out.append(Violation("config", CONFIG_NAME, "missing: readers need the model's config.json"))
        return None, None
    try:
        raw = _read_json(path, CONFIG_NAME)
    except DescriptionError as e:
        out.append(Violation("config", CONFIG_NAME, str(e).split(": ", 1)[-1]))
        return None, None
    md = MD_NAMES.get(raw.get("torch_dtype", raw.get("dtype")))
    qc = raw.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "fp8":
        out.append(Violation("config", CONFIG_NAME, "the source's FP8 quantization_config is still there; "
                                                    "the output holds no FP8 tensor"))
    try:
        return DeepseekV3Config.from_dict(raw, source=CONFIG_NAME), md
    except ConfigError as e:
        out.append(Violation("config", CONFIG_NAME, f"not a DeepSeek-V3 config ({e}); shapes not checked"))
        return None, md


def _read_description(path: str, entries: list[str], out: list[Violation]) -> Optional[Description]:
    if DESCRIPTION_NAME not in entries:
        out.append(Violation("description", DESCRIPTION_NAME, "missing (readers look for it by this name)"))
        return None
    try:
        return parse_description(_read_json(path, DESCRIPTION_NAME))
    except DescriptionError as e:
        out.append(Violation("description", DESCRIPTION_NAME, str(e).split(": ", 1)[-1]))
        return None


def _read_weights(path: str, entries: list[str], report: Report) -> dict[str, TensorSpec]:
    """File-name and index rules; returns every tensor found (name -> spec) from the headers."""
    naming = NAMING[report.dialect]
    weights = [e for e in entries if e.endswith(".safetensors")]
    report.weight_files = weights
    if not weights:
        report.add("file-names", path, "no *.safetensors weight file")
    wanted = f"{naming.single_name}, or {naming.shard_name(1, 2)}... with {naming.index_name}"
    shards: dict[str, tuple[int, int]] = {}
    for f in weights:
        parsed = naming.parse_shard(f)
        if parsed:
            shards[f] = parsed
        elif f != naming.single_name:
            report.add("file-names", f, f"not a weight file name of the {report.dialect} dialect (it writes {wanted})")
    if shards:
        totals = {n for _, n in shards.values()}
        have = sorted(i for i, _ in shards.values())
        if len(totals) > 1:
            report.add("file-names", path, f"shards disagree on their total: {sorted(totals)}")
        elif have != list(range(1, max(totals) + 1)):
            report.add("file-names", path, f"shards {have} of {max(totals)}: not exactly 1..{max(totals)}")
        if naming.single_name in weights:
            report.add("file-names", naming.single_name, "a single-file name next to shards")
        if naming.index_name not in entries:
            report.add("index", naming.index_name, "missing: a sharded output needs its index")

    owner: dict[str, str] = {}
    specs: dict[str, TensorSpec] = {}
    ours = False
    for f in weights:
        try:
            header = read_header(storage.join(path, f))
        except CheckpointError as e:
            report.add("weights", f, str(e).split(": ", 1)[-1])
            continue
        ours |= all(header.metadata.get(k) == v for k, v in SHARD_METADATA.items())
        for name, info in header.tensors.items():
            if name in owner:
                report.add("index", name, f"in two weight files: {owner[name]} and {f}")
                continue
            owner[name] = f
            specs[name] = TensorSpec(name, info.dtype, info.shape)
    for idx in (e for e in entries if e.endswith(".safetensors.index.json")):
        if idx != naming.index_name:
            report.add("file-names", idx, f"not the {report.dialect} index name ({naming.index_name})")
        _check_index(path, idx, entries, weights, owner, specs, report)
    return specs, ours


def _check_index(path: str, idx: str, entries: list[str], weights: list[str], owner: dict[str, str],
                 specs: dict[str, TensorSpec], report: Report) -> None:
    try:
        raw = _read_json(path, idx)
    except DescriptionError as e:
        report.add("index", idx, str(e).split(": ", 1)[-1])
        return
    wm = raw.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        report.add("index", idx, "weight_map must be an object mapping tensor names to file names")
        return
    total = (raw.get("metadata") or {}).get("total_size") if isinstance(raw.get("metadata"), dict) else None
    data = sum(s.nbytes for s in specs.values())
    if total != data:
        report.add("index", idx, f"metadata.total_size is {total!r}; the tensors hold {data} bytes")
    for f in sorted(set(wm.values()) - set(entries)):
        n = sum(v == f for v in wm.values())
        report.add("index", idx, f"weight_map points {n} tensor(s) at {f}, which does not exist")
    for name, f in wm.items():
        if name in owner and owner[name] != f:
            report.add("index", name, f"{idx} maps it to {f}, but it is in {owner[name]}")
        elif name not in owner and f in entries:
            report.add("index", name, f"{idx} maps it to {f}, but it is in no weight file")
    for name, f in owner.items():
        if name not in wm:
            report.add("index", name, f"{idx} does not name this tensor (in {f})")
    for f in sorted(set(weights) - set(wm.values())):
        report.add("index", f, f"weight file not referenced by {idx}")


def _check_description(desc: Description, specs: dict[str, TensorSpec], report: Report) -> None:
    d = report.dialect
    for name in desc.tensors:
        if name not in specs:
            report.add("key-without-tensor", name, f"described in {DESCRIPTION_NAME} but in no weight file")
    for name in specs:
        if name not in desc.tensors:
            report.add("tensor-without-key", name, f"has no entry in {DESCRIPTION_NAME}")
    for name, t in desc.tensors.items():
        if t not in TENSOR_TYPES:
            report.add("type-unknown", name, f"type {t!r} is not one of {', '.join(TENSOR_TYPES)}")
    types = [t for t in desc.tensors.values() if isinstance(t, str)]
    report.type_counts = dict(Counter(types))
    top = desc.top
    report.model_quant_type = top.get("model_quant_type")

    allowed = SEED_KEYS if d == SEED else ASCEND_V1_KEYS
    extra = [k for k in top if k not in allowed]
    if extra:
        hint = " (seed writes only model_quant_type and fa_quant_type)" if d == SEED else ""
        report.add("top-level-keys", DESCRIPTION_NAME, f"top-level keys {', '.join(extra)} are not written by "
                                                       f"the {d} dialect{hint}")
    if d != SEED:
        missing = [k for k in ASCEND_V1_KEYS if k != "fa_quant_type" and k not in top]
        if missing:
            report.add("top-level-keys", DESCRIPTION_NAME, f"ascendV1 top-level keys missing: {', '.join(missing)}")
        for key, kind in (("version", str), ("metadata", dict), ("group_size", int), ("optional", dict)):
            if key in top and (not isinstance(top[key], kind) or isinstance(top[key], bool)):
                report.add("top-level-keys", key, f"must be a JSON {kind.__name__}, got {top[key]!r}")

    want = model_quant_type(types, d)
    if report.model_quant_type != want:
        report.add("model-quant-type", "model_quant_type",
                   f"is {report.model_quant_type!r}; the {d} dialect writes {want!r} for the types present")
    fa = fa_layers(desc.tensors)
    if fa and top.get("fa_quant_type") != FA_QUANT_TYPE:
        report.add("fa-quant-type", "fa_quant_type", f"is {top.get('fa_quant_type')!r}; FA3 tensors are present, "
                                                     f"so it must be {FA_QUANT_TYPE!r}")
    if not fa and "fa_quant_type" in top:
        report.add("fa-quant-type", "fa_quant_type", "present, but no layer has FA3 tensors")

    if d == SEED:
        for k in desc.layer_entries:
            report.add("layer-quant-type", k, "per-layer quant_type entries name no tensor; only the ascendV1 "
                                              "dialect writes them")
        return
    for lid in fa:
        v = desc.layer_entries.get(layer_entry_key(lid))
        if v != LAYER_QUANT_TYPE:
            report.add("layer-quant-type", layer_entry_key(lid), f"is {v!r}; an ascendV1 FA3 layer has "
                                                                 f"{LAYER_QUANT_TYPE!r}")
    for k in desc.layer_entries:
        if k not in {layer_entry_key(lid) for lid in fa}:
            report.add("layer-quant-type", k, "entry for a layer without FA3 tensors")


def _outside_entry(path: str, name: str) -> Optional[str]:
    """Why manifest entry ``name`` is not a file of directory ``path`` (an absolute path, a step out with
    ``..``, a link leading out, a device or a FIFO), or None. Such an entry is never opened."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or "://" in name or any(p in ("", ".", "..") for p in parts):
        return "not a file name inside the directory (absolute, or stepping out of it): not read"
    if storage.is_url(path):
        return None
    base, where = os.path.realpath(path), os.path.realpath(os.path.join(path, name))
    if not where.startswith(base + os.sep):
        return "leads out of the directory (a symbolic link): not read"
    if os.path.lexists(where) and not os.path.isfile(where):
        return "not a regular file (a directory, device or FIFO): not read"
    return None


def _check_manifest(path: str, entries: list[str], report: Report, verify: bool, ours: bool) -> None:
    """``ours``: the weights carry this project's shard metadata (SHARD_METADATA): the manifest must be there."""
    if MANIFEST_NAME not in entries:
        if ours:
            report.add("manifest", MANIFEST_NAME, "missing, but the weights were written by dsquant (their safetensors "
                                                  "metadata says so), which always writes one: the output was altered "
                                                  "or is incomplete")
        return
    try:
        files = _read_json(path, MANIFEST_NAME).get("files")
    except DescriptionError as e:
        report.add("manifest", MANIFEST_NAME, str(e).split(": ", 1)[-1])
        return
    if not isinstance(files, dict):
        report.add("manifest", MANIFEST_NAME, "has no 'files' object")
        return
    for name, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        where = storage.join(path, name)
        outside = _outside_entry(path, name)
        if outside:
            report.add("manifest", name, outside)
        elif (name not in entries) if "/" not in name else not storage.exists(where):  # optional/... in a folder
            report.add("manifest", name, "listed in the manifest but missing")
        elif size != storage.size(where):
            report.add("manifest", name, f"size {storage.size(where)}, the manifest says {size}")
        elif verify and (got := storage.file_sha256(where)[1]) != digest:
            report.add("manifest", name, f"sha256 {got}, the manifest says {digest!r}: the file changed after "
                                         "it was written")
    report.manifest = (f"{len(files)} files, sizes and sha256 verified" if verify
                       else f"{len(files)} files, sizes verified (sha256 skipped: --no-verify)")
