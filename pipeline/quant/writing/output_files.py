"""The files of a quantized output besides the weights, and the streaming shard file they describe.

:class:`ShardFile` writes one safetensors shard (tensors declared up front, written one by one) through
:func:`pipeline.io.storage.atomic_write`, computing its sha256 along; closing it commits the file and gives
its :class:`ShardRecord`. :func:`finalize` turns committed shards into a complete output: config.json,
the tokenizer and other files copied from the source, ``manifest.json`` (every file's size and sha256,
plus the job's info), then the index and, last, ``quant_model_description.json``: a directory with a
description is complete, and a crash before it leaves none.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from pipeline.io import storage
from pipeline.io.checkpoint import CONFIG_NAME
from pipeline.io.destination.rule import check_not_source, is_leftover
from pipeline.format.description import (
    DESCRIPTION_NAME, FA_QUANT_TYPE, FAQUANT, MANIFEST_NAME, NAMING, SHARD_METADATA, W8A8, W8A8_DYNAMIC, SEED,
    build_description, encode_description, model_quant_type,
)
from pipeline.io.safetensors_io import SafetensorsWriter, TensorSpec, encode_header
from pipeline.io.storage import file_sha256  # noqa: F401 (re-exported: the job state verifies shards with it)

COPIED_NAMES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json")
PART_NAME = re.compile(r"\..*\.part-[0-9a-f]+-\d{5}\.safetensors(\.tmp-.*)?")  # QuantizedWriter's parts
MANIFEST_FORMAT = "msmodelslim W8A8 + FA3"


@dataclass(frozen=True)
class ShardRecord:
    """A committed shard: where it is, what it holds, and its file's size and sha256."""

    path: str
    names: tuple[str, ...]
    nbytes: int   # tensor data bytes
    size: int     # file bytes
    sha256: str

    def to_dict(self) -> dict:
        return {"path": self.path, "names": list(self.names), "nbytes": self.nbytes, "size": self.size,
                "sha256": self.sha256}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ShardRecord":
        return cls(str(raw["path"]), tuple(raw["names"]), int(raw["nbytes"]), int(raw["size"]), str(raw["sha256"]))


_hasher_lock = threading.Lock()
_hasher: Optional[ThreadPoolExecutor] = None


def _forget_hashing_thread() -> None:
    """In a forked child the parent's thread does not exist: the next shard starts a new one."""
    global _hasher
    _hasher = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_hashing_thread)


def _hashing_thread() -> ThreadPoolExecutor:
    """The process's one hashing thread: tasks run in submission order, so each shard's digest sees its
    bytes in file order; hashlib releases the GIL on large buffers, so it runs beside the file write."""
    global _hasher
    with _hasher_lock:
        if _hasher is None:
            _hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        return _hasher


class ShardFile:
    """One shard being written at ``path`` (atomically: it appears only once every tensor is in), its
    sha256 computed along, on a hashing thread while this thread writes the same bytes to the file.
    Use :meth:`close` to commit, :meth:`discard` to drop."""

    def __init__(self, path: str, specs: Sequence[TensorSpec]):
        self.path, self.specs = path, list(specs)
        header = encode_header(self.specs, SHARD_METADATA)
        self._digest = hashlib.sha256(header)
        self._hashed: Optional[Future] = None  # the last tensor handed to the hashing thread
        self._size = len(header) + sum(s.nbytes for s in self.specs)
        self._file = SafetensorsWriter(path, self.specs, SHARD_METADATA)
        self._file.__enter__()

    def write(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            self._hashed = _hashing_thread().submit(self._digest.update, data)
        self._file.write(name, t)

    def _digest_hex(self) -> str:
        if self._hashed is not None:
            self._hashed.result()  # and every tensor before it: one thread, in order
        return self._digest.hexdigest()

    def close(self) -> ShardRecord:
        sha256 = self._digest_hex()
        self._file.__exit__(None, None, None)
        return ShardRecord(self.path, tuple(s.name for s in self.specs), sum(s.nbytes for s in self.specs),
                           self._size, sha256)

    def discard(self) -> None:
        try:
            if self._hashed is not None:
                futures_wait([self._hashed])  # the thread may still read the tensors
            self._file.__exit__(RuntimeError, RuntimeError("shard discarded"), None)
        except Exception:  # best effort: the error that led here is the one to report
            pass


def is_output_entry(name: str) -> bool:
    """Whether a directory entry belongs to a quantized output: the description, the manifest, a weight
    file or index of either dialect, or a writer's part."""
    return (name in (DESCRIPTION_NAME, MANIFEST_NAME) or any(n.owns(name) for n in NAMING.values())
            or bool(PART_NAME.fullmatch(name)))


STATE_ENTRIES = (".dsquant", "job_summary.json")  # the distributed job's state and summary beside its output


RECIPE_SUFFIX = "_best_practice.yaml"  # the recipe a job ran, as msModelSlim names it: <model_type>_best_practice.yaml
OPTIONAL_DIR = "optional"  # ascendV1's optional files (QuaRot's global rotation)
FALLBACK_REPORT = "fallback.json"  # what --fa-fallback / --linear-fallback picked and why (pipeline.quant.evaluation.fallback)


def is_companion_entry(name: str) -> bool:
    """Whether a finished output holds ``name`` beside its weights: config.json, the copied files, the
    recipe it was made with, its fallback report, the distributed job's state and summary."""
    return (name in (CONFIG_NAME, OPTIONAL_DIR, FALLBACK_REPORT) or name in COPIED_NAMES or name in STATE_ENTRIES
            or (not name.startswith(".") and name.endswith((".py", RECIPE_SUFFIX))))


def existing_output(dst: str, overwrite: bool, src: Optional[str] = None) -> list[str]:
    """The entries of an earlier output in ``dst`` that a new one will replace (after checking that it may).
    Refuses (ValueError) ``dst`` being, holding or lying inside the source, however spelt
    (:mod:`pipeline.io.destination.rule`); refuses (FileExistsError) a directory
    that holds anything but a quantized output, and an output unless ``overwrite``. A crashed writer's
    leftovers are neither: they are not returned, and do not block."""
    check_not_source(src, dst)
    if not storage.exists(dst):
        return []
    if not storage.isdir(dst):
        raise FileExistsError(f"{dst}: exists and is not a directory")
    entries = [e for e in storage.listdir(dst) if not is_leftover(e)]
    ours = [e for e in entries if is_output_entry(e)]
    foreign = [e for e in entries if not (is_output_entry(e) or e in STATE_ENTRIES or (ours and is_companion_entry(e)))]
    if foreign:
        raise FileExistsError(f"{dst}: holds files that are not a quantized output ({', '.join(foreign[:4])}); "
                              "choose a new or empty directory")
    if ours and not overwrite:
        raise FileExistsError(f"{dst}: already holds quantized output ({', '.join(ours[:4])}); "
                              "use --overwrite to replace it")
    return entries


def completeness_first(entries) -> list[str]:
    """``entries`` in the order to remove them so that the directory stops looking complete at once: the
    description, then the index, then the manifest, then the rest."""
    return sorted(entries, key=lambda e: (e != DESCRIPTION_NAME, not e.endswith(".index.json"), e != MANIFEST_NAME))


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


def json_bytes(obj: Any, indent: int = 2) -> bytes:
    return json.dumps(obj, indent=indent).encode("utf-8")


def file_entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def finalize(dst: str, dialect: str, shards: Sequence[ShardRecord], types: Mapping[str, str],
             config: Mapping[str, Any], src_dir: Optional[str] = None, *, mindie_format: bool = False,
             job: Optional[Mapping[str, Any]] = None, wrote: Callable[[str], None] = lambda path: None,
             extra: Optional[Mapping[str, bytes]] = None, optional: Optional[Mapping[str, Any]] = None) -> dict:
    """Write every non-weight file of the output in ``dst`` for its committed ``shards`` (in file order,
    under their final names) and the ``types`` of all their tensors; the description last. Returns the
    manifest. ``wrote`` is told each path written (for cleanup by the caller on failure). ``extra``: more
    files by name (the recipe, ``optional/quarot.safetensors``), listed in the manifest like the others;
    ``optional``: the description's ``optional`` object (ascendV1)."""
    naming = NAMING[dialect]
    files: dict[str, dict] = {}
    weight_map: dict[str, str] = {}
    for s in shards:
        name = s.path.rsplit("/", 1)[-1]
        files[name] = {"size": s.size, "sha256": s.sha256}
        weight_map.update(dict.fromkeys(s.names, name))
    missing = sorted(set(types) - set(weight_map))
    if missing or len(weight_map) != len(types):
        raise ValueError(f"{dst}: tensors with a type but in no shard: {missing[:5]}; "
                         f"in a shard without a type: {sorted(set(weight_map) - set(types))[:5]}")

    def put(name: str, data: bytes, record: bool = True) -> None:
        path = storage.join(dst, name)
        storage.write_bytes(path, data)
        wrote(path)
        if record:
            files[name] = file_entry(data)

    put(CONFIG_NAME, json_bytes(build_config(config, types, mindie_format)))
    if src_dir is not None:
        for entry in storage.listdir(src_dir):
            if entry in COPIED_NAMES or (entry.endswith(".py") and not entry.startswith(".")):
                put(entry, storage.read_bytes(storage.join(src_dir, entry)))
    for name, data in (extra or {}).items():
        put(name, data)
    total = sum(s.nbytes for s in shards)
    index = None
    if [s.path.rsplit("/", 1)[-1] for s in shards] != [naming.single_name]:
        index = json_bytes({"metadata": {"total_size": total}, "weight_map": weight_map})
        files[naming.index_name] = file_entry(index)
    desc = encode_description(build_description(types, FAQUANT in types.values(), dialect,
                                                optional=optional if dialect != SEED else None))
    files[DESCRIPTION_NAME] = file_entry(desc)
    manifest = {"format": MANIFEST_FORMAT, "dialect": dialect, "tensors": len(types), "total_size": total,
                "files": dict(sorted(files.items())), "job": dict(job or {})}
    put(MANIFEST_NAME, json_bytes(manifest), record=False)
    if index is not None:
        put(naming.index_name, index, record=False)
    put(DESCRIPTION_NAME, desc, record=False)  # last: the directory is complete from here on
    return manifest
