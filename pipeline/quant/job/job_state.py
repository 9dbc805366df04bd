"""What a quantization job has done, kept beside its output so that a rerun does only what is left.

Layout, under the destination (hidden from the output's file list)::

    .dsquant/job.json                 the fingerprints of the run that last worked here
    .dsquant/calibration.parquet      the reduced calibration statistics (pipeline.quant.job.stats_io), with
                                      the calibration fingerprint in its metadata
    .dsquant/shards/<file>.json       one commit record per committed shard: its size and sha256, its
                                      tensors and their types, and the fingerprint of the unit it holds

Fingerprints (sha256 of canonical JSON, hex):

    source file    its size and its ETag (object stores) or mtime (local/NFS): no weight is read
    calibration    every source file's fingerprint, the recipe, the calibration samples' token ids
    unit           the recipe, the weight-phase options (smoothing alpha, shard size), the fingerprints of
                   the source files holding the unit, and the unit's own statistics (W8A8/FA3 and
                   smoothing): a unit whose inputs are all unchanged gives the same bytes
    job            the calibration fingerprint and the options that change the output files

A shard is *done* when its record exists, names the current unit fingerprint and the planned tensors, and
the stored file has the recorded size (and, with ``verify="sha256"``, the recorded sha256 when re-read).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from pipeline.io import storage
from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.writing.output_files import ShardRecord, completeness_first, file_sha256, is_leftover, is_output_entry
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.writing.shard_layout import Shard, unit_layer
from pipeline.quant.transforms.smooth import ChannelAbsMax

STATE_DIR = ".dsquant"
JOB_NAME = "job.json"
CALIBRATION_NAME = "calibration.parquet"
SHARDS_DIR = "shards"
VERIFY_MODES = ("size", "sha256")


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def state_path(dst: str, *names: str) -> str:
    return storage.join(dst, STATE_DIR, *names)


def source_fingerprints(reader: CheckpointReader) -> dict[str, str]:
    """Base name -> fingerprint of every weight file and config.json of the source."""
    files = [*reader.files, storage.join(reader.path, "config.json")]
    return {f.rsplit("/", 1)[-1]: digest(storage.version(f)) for f in files}


def stats_fingerprint(layer_id: Optional[int], stats: Stats, smooth: Optional[Mapping[str, ChannelAbsMax]]) -> str:
    """The statistics one layer's quantization reads (none for the globals)."""
    if layer_id is None:
        return digest(None)
    prefix = f"model.layers.{layer_id}."
    sm = {k: v.value.double().tolist() for k, v in sorted((smooth or {}).items())
          if (k + ".").startswith(prefix) and v.value is not None}
    return digest({"stats": stats.select(prefix).to_dict(), "smooth": sm})


@dataclass(frozen=True)
class JobKey:
    """The fingerprints of one job's inputs (module doc)."""

    source: dict[str, str]
    recipe: dict
    samples: str                # digest of the calibration token ids
    weight_options: dict        # smooth_alpha, shard_bytes
    output_options: dict        # mindie_format

    @classmethod
    def of(cls, reader: CheckpointReader, recipe: Recipe, samples: Sequence[Sequence[int]], *, smooth_alpha: float,
           shard_bytes: int, mindie_format: bool) -> "JobKey":
        return cls(source_fingerprints(reader), recipe.fingerprint(), digest([list(s) for s in samples]),
                   {"smooth_alpha": smooth_alpha, "shard_bytes": shard_bytes}, {"mindie_format": mindie_format})

    @property
    def calibration(self) -> str:
        return digest({"source": self.source, "recipe": self.recipe, "samples": self.samples,
                       "alpha": self.weight_options["smooth_alpha"]})

    @property
    def job(self) -> str:
        return digest({"calibration": self.calibration, "weights": self.weight_options, "output": self.output_options})

    def unit(self, reader: CheckpointReader, unit: str, stats: Stats,
             smooth: Optional[Mapping[str, ChannelAbsMax]]) -> str:
        lid = unit_layer(unit)
        files = {f.rsplit("/", 1)[-1] for f in reader.files_of(lid)} | {"config.json"}
        return digest({"unit": unit, "recipe": self.recipe, "weights": self.weight_options,
                       "files": {f: self.source[f] for f in sorted(files)},
                       "stats": stats_fingerprint(lid, stats, smooth)})

    def to_dict(self) -> dict:
        return {"job": self.job, "calibration": self.calibration, "source": self.source, "recipe": self.recipe,
                "samples": self.samples, "weight_options": self.weight_options,
                "output_options": self.output_options}


@dataclass(frozen=True)
class Commit:
    """A shard's commit record."""

    shard: str                  # file name
    unit: str
    unit_fingerprint: str
    record: ShardRecord
    types: dict[str, str]

    def to_dict(self) -> dict:
        return {"shard": self.shard, "unit": self.unit, "unit_fingerprint": self.unit_fingerprint,
                "record": self.record.to_dict(), "types": self.types}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Commit":
        return cls(str(raw["shard"]), str(raw["unit"]), str(raw["unit_fingerprint"]),
                   ShardRecord.from_dict(raw["record"]), dict(raw["types"]))


def save_commit(dst: str, commit: Commit) -> None:
    storage.write_bytes(state_path(dst, SHARDS_DIR, commit.shard + ".json"),
                        json.dumps(commit.to_dict(), indent=1).encode())


def load_commits(dst: str) -> dict[str, Commit]:
    """Every readable commit record by shard name (an unreadable one counts as absent)."""
    folder = state_path(dst, SHARDS_DIR)
    if not storage.exists(folder):
        return {}
    out = {}
    for entry in storage.listdir(folder):
        if not entry.endswith(".json") or entry.startswith("."):
            continue
        try:
            c = Commit.from_dict(json.loads(storage.read_bytes(storage.join(folder, entry))))
        except (ValueError, KeyError, TypeError):
            continue
        out[c.shard] = c
    return out


def verify_shard(dst: str, shard: Shard, commit: Optional[Commit], unit_fp: str, verify: str = "sha256") -> bool:
    """Whether ``shard`` is done (module doc)."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if commit is None or commit.unit_fingerprint != unit_fp or commit.unit != shard.unit:
        return False
    if commit.record.names != tuple(s.name for s in shard.specs) or set(commit.types) != set(commit.record.names):
        return False
    path = storage.join(dst, shard.name)
    try:
        if storage.size(path) != commit.record.size:
            return False
        return verify == "size" or file_sha256(path) == (commit.record.size, commit.record.sha256)
    except FileNotFoundError:
        return False


def load_job(dst: str) -> Optional[dict]:
    path = state_path(dst, JOB_NAME)
    if not storage.exists(path):
        return None
    try:
        return json.loads(storage.read_bytes(path))
    except ValueError:
        return None


def save_job(dst: str, key: JobKey, **extra: Any) -> None:
    storage.write_bytes(state_path(dst, JOB_NAME), json.dumps({**key.to_dict(), **extra}, indent=1).encode())


def changed_files(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    return sorted(f for f in set(old) | set(new) if old.get(f) != new.get(f))


def units_to_redo(shards: Iterable[Shard], done: Mapping[str, bool]) -> list[str]:
    """The units with any shard not done, in output order."""
    return list(dict.fromkeys(s.unit for s in shards if not done.get(s.name)))


SUMMARY_NAME = "job_summary.json"


def owned_entries(dst: str) -> list[str]:
    """The entries of ``dst`` that belong to a quantized output, its job state, or a crashed writer."""
    if not storage.exists(dst):
        return []
    return [e for e in storage.listdir(dst) if is_output_entry(e) or e in (STATE_DIR, SUMMARY_NAME) or is_leftover(e)]


def is_up_to_date(dst: str, key: JobKey) -> bool:
    """A complete output (description present) whose manifest was written for the same job fingerprint,
    with every file it lists at its recorded size."""
    from pipeline.format.description import DESCRIPTION_NAME, MANIFEST_NAME

    if not storage.exists(storage.join(dst, DESCRIPTION_NAME)) or not storage.exists(storage.join(dst, MANIFEST_NAME)):
        return False
    try:
        manifest = json.loads(storage.read_bytes(storage.join(dst, MANIFEST_NAME)))
        if manifest.get("job", {}).get("fingerprint") != key.job:
            return False
        return all(storage.size(storage.join(dst, f)) == e["size"] for f, e in manifest["files"].items())
    except (ValueError, KeyError, TypeError, FileNotFoundError):
        return False


def staging_dir(dst: str) -> str:
    """Where an overwriting run writes its output, beside ``dst``, until it is complete and swapped in
    (:func:`pipeline.io.storage.replace_dir`): a hidden sibling directory."""
    return storage.sibling(dst, f".{dst.rstrip('/').rsplit('/', 1)[-1]}.overwrite")


def open_destination(dst: str, overwrite: bool) -> str:
    """Make ``dst`` ready for a (re)run and say what was there: "new", "resume" (an earlier run's state:
    its committed shards stay, to be verified), or "replaced" (``overwrite``: everything of an earlier
    output removed). An existing output stops looking complete first (description, then index and
    manifest removed). Refuses an output that has no job state (written by the single-process writer or
    another tool) unless ``overwrite``."""
    from pipeline.format.description import DESCRIPTION_NAME, MANIFEST_NAME

    ours = owned_entries(dst)
    if not ours:
        return "new"
    first = completeness_first(ours)
    if overwrite:
        for e in first:
            storage.remove(storage.join(dst, e))
        return "replaced"
    if STATE_DIR not in ours:
        raise FileExistsError(f"{dst}: already holds quantized output without job state ({', '.join(ours[:4])}); "
                              "pass overwrite (--overwrite) to replace it")
    for e in first:
        if e in (DESCRIPTION_NAME, MANIFEST_NAME) or e.endswith(".index.json"):
            storage.remove(storage.join(dst, e))
    return "resume"


def remove_stale(dst: str, keep: Iterable[str]) -> list[str]:
    """Remove the weight files of ``dst`` not in ``keep`` (a layout that changed between runs) and any
    part or temporary file a crashed writer left; returns their names."""
    from pipeline.format.description import NAMING

    keep = set(keep)
    stale = [e for e in owned_entries(dst) if e not in keep and e != STATE_DIR and (
        is_leftover(e) or (e.endswith(".safetensors") and any(n.owns(e) for n in NAMING.values())))]
    for e in stale:
        storage.remove(storage.join(dst, e))
    return stale


