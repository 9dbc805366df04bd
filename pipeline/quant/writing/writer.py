"""Write a quantized checkpoint directory in either msModelSlim dialect (docs/format.md), layer by layer.

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

Sharding and commit (:mod:`pipeline.quant.writing.shard_layout`). Each ``add`` is one unit (the globals or a
layer); a shard never spans two units, and within a unit a shard closes as soon as the next tensor would
take it past ``shard_bytes`` of tensor data. A safetensors header precedes the data, so a shard can be
written once its tensors are known: declared up front with :meth:`QuantizedWriter.plan` (each unit's
tensors' names, dtypes and shapes, in order; ``shard_layout.output_units`` computes them from the headers
and the recipe), shards are laid out at once and every tensor is written as it comes, in consecutive
pieces of a unit if the caller likes; without a plan ``add`` queues a whole unit's tensors and writes them
at its end. By default a writer thread writes (and a hashing thread hashes) what ``add`` hands over while
the caller computes the next tensors, at most ``in_flight_bytes`` ahead (references: do not modify them
afterwards); ``background=False`` writes within ``add``. Both write the same files, and the distributed
job writes the same again. Each complete shard is first committed under a hidden part name
(``.<stem>.part-<run>-00001.safetensors``) and ``finish`` renames the parts to their final names
(``-00001-of-0000N``) and writes the other files with :func:`pipeline.quant.writing.output_files.finalize`:
config.json, copies of the tokenizer files, generation_config.json and ``*.py`` from the source,
``manifest.json`` (every file's size and sha256, computed while writing, plus the caller's ``job`` info),
and last the index and ``quant_model_description.json``: a directory with a description is complete, and
a crash at any point before leaves none. On an exception inside ``with``, everything this writer wrote is removed.
One job writes a destination at a time: the jobs hold its lock (:mod:`pipeline.io.destination.lock`) and pass
its ``ensure`` as ``guard``, called before anything already in ``dst`` is removed.
An earlier output in ``dst`` (``overwrite``) is left whole until every new shard is written: only then is
it removed, description first, and the parts renamed (:func:`pipeline.quant.writing.output_files.existing_output`
refuses a destination that is the source or holds anything else).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Container, Mapping, Optional, Sequence, Union

import torch

from pipeline import layout
from pipeline.io import storage
from pipeline.format.checker_rules import MD_NAMES, check_tensors, is_fa_module, split_name
from pipeline.format.description import (
    ASCEND_V1, FLOAT, LAYER_ENTRY_SUFFIX, LAYER_QUANT_TYPE, NAMING, SEED,
    TENSOR_TYPES, W8A8, W8A8_DYNAMIC, check_dialect,
)
from pipeline.quant.writing.output_files import (  # noqa: F401 (build_config re-exported)
    ShardFile, ShardRecord, build_config, completeness_first, existing_output, finalize, is_leftover,
)
from pipeline.quant.writing.shard_layout import split_unit
from pipeline.io.safetensors_io import DTYPE_NAMES, TensorSpec

SHARD_BYTES = 4 * 1024**3  # msModelSlim's part_file_size
IN_FLIGHT_BYTES = 512 * 1024**2  # tensors handed to the writer thread and not yet written, at most
_MTP_ONLY = re.compile(r"model\.layers\.\d+\.(" + "|".join(map(re.escape, layout.MTP_ONLY_MODULES)) + r")\.weight")

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


class QuantizedWriter:
    """Streams a quantized checkpoint into ``dst`` (a local path or fsspec URL); see the module doc."""

    def __init__(self, dst: str, dialect: str = SEED, *, model_dtype: DtypeLike,
                 shard_bytes: int = SHARD_BYTES, overwrite: bool = False, background: bool = True,
                 in_flight_bytes: int = IN_FLIGHT_BYTES, src: Optional[str] = None,
                 guard: Callable[[], None] = lambda: None):
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
        self._part: Optional[ShardFile] = None  # the part being written
        self._parts: list[ShardRecord] = []
        self._written: list[str] = []  # every path this writer created, for abort()
        self._pool: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(1, "shard-writer") if background else None
        self._jobs: deque[tuple[Future, int]] = deque()  # (write, bytes) handed to the writer thread, in order
        self._in_flight_bytes = in_flight_bytes
        self._write_failed = False
        self._state = "open"
        self._guard = guard  # called before anything in dst is removed (the destination lock's ensure)
        # An earlier output is checked now but kept until the new shards are all written (_swap_out).
        self._replacing = existing_output(self.dst, overwrite, src)

    def _swap_out(self) -> None:
        """With every new shard complete under its hidden part name: remove the earlier output (description
        first, so that it stops looking complete at once) and any crashed writer's leftovers."""
        self._guard()
        mine = {p.path.rsplit("/", 1)[-1] for p in self._parts}
        leftovers = [e for e in storage.listdir(self.dst) if is_leftover(e) and e not in mine]
        for e in completeness_first(self._replacing) + leftovers:
            storage.remove(storage.join(self.dst, e))
        self._replacing = []

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
        self._stop_background()
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
    def plan(self, units: Sequence[Sequence[TensorSpec]]) -> None:
        """Declare every tensor ``add`` will get, unit by unit (each unit one ``add``), in order, as this
        dialect stores them: shards are laid out now (:mod:`pipeline.quant.writing.shard_layout`) and ``add``
        writes each tensor as it comes (module doc). Only before the first ``add``."""
        self._require_open()
        if self._planned is not None or self._types:
            raise RuntimeError(f"{self.dst}: plan() must come once, before the first add()")
        flat = [s for unit in units for s in unit]
        names = [s.name for s in flat]
        if len(set(names)) != len(names):
            raise ValueError(f"planned tensors repeat names: {sorted({n for n in names if names.count(n) > 1})[:5]}")
        self._planned, self._shard_ends = flat, []
        for unit in units:
            for shard in split_unit(unit, self.shard_bytes):
                self._shard_ends.append((self._shard_ends[-1] if self._shard_ends else 0) + len(shard))

    def add(self, tensors: Mapping[str, torch.Tensor], types: Mapping[str, str]) -> None:
        """Write one unit, a layer or the global tensors: whole modules, every tensor with its type, in
        either dialect's form (:func:`prepare_unit`). With a plan, a unit may also come in consecutive
        pieces (``quantize_layer_pieces``: whole modules, the attention's together, as the format checks
        pair them): the shards are the plan's either way. Raises ValueError naming the tensors for a
        mismatch of names, a repeated name, a broken format rule, or a tensor that is not the next one
        planned; nothing is written then.

        With ``background`` (the default) the tensors are checked here and written by a writer thread
        (hashed and streamed out, in order) while the caller computes the next ones: ``add`` waits only
        while more than ``in_flight_bytes`` would be waiting to be written (one call's tensors at least),
        and an error writing them is raised by a later ``add`` or by ``finish`` (the writer is failed
        then). Do not modify the tensors afterwards."""
        self._require_open()
        conv, conv_types, specs = prepare_unit(tensors, types, self.dialect, self.model_dtype, self._types)
        start = len(self._types)
        if self._planned is not None:
            check_next(list(specs.values()), self._planned, start)
        nbytes = sum(sp.nbytes for sp in specs.values())
        self._wait(max(0, self._in_flight_bytes - nbytes))
        self._types.update((n, conv_types[n]) for n in conv)
        if self._pool is None:
            self._checked(self._write_unit, conv, specs, start)
        else:
            self._jobs.append((self._pool.submit(self._write_unit, conv, specs, start), nbytes))

    def _write_unit(self, conv: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec], start: int) -> None:
        if self._write_failed:  # writes queued behind a failed one must not go on into a new part
            raise RuntimeError(f"{self.dst}: an earlier write failed")
        try:
            for k, (name, t) in enumerate(conv.items(), start=start):
                if self._planned is not None:
                    self._write_planned(name, t, k)
                else:
                    nbytes = specs[name].nbytes
                    if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
                        self._flush()
                    self._pending.append((name, t))
                    self._pending_bytes += nbytes
            self._flush()  # a shard never spans two units
        except BaseException:
            self._write_failed = True
            self._discard_part()
            raise

    def _checked(self, fn, *args):
        try:
            return fn(*args)
        except BaseException:
            self._state = "failed"
            raise

    def _wait(self, keep_bytes: int = 0) -> None:
        """Wait for written tensors until at most ``keep_bytes`` remain in flight (0: all written); an
        error from the writer thread is raised here (and fails the writer)."""
        while self._jobs and (self._jobs[0][0].done() or sum(b for _, b in self._jobs) > keep_bytes):
            job, _ = self._jobs.popleft()
            try:
                self._checked(job.result)
            except BaseException:
                self._stop_background()
                raise

    def _stop_background(self) -> None:
        """Let the writes handed over end (their outcome does not matter here), then stop the thread."""
        jobs, self._jobs = [j for j, _ in self._jobs], deque()
        if jobs:
            futures_wait(jobs)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _part_path(self) -> str:
        return storage.join(self.dst, f".{self.naming.stem}.part-{self._run}-{len(self._parts) + 1:05d}.safetensors")

    def _write_planned(self, name: str, t: torch.Tensor, i: int) -> None:
        """The next planned tensor (index ``i`` in the plan) into its shard's part: the part (its header)
        opened first, committed after its last tensor."""
        k = len(self._parts)  # the shard
        if self._part is None:
            self._part = ShardFile(self._part_path(), self._planned[self._shard_ends[k - 1] if k else 0:
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
        self._part = ShardFile(self._part_path(), [TensorSpec.of(n, t) for n, t in self._pending])
        for name, t in self._pending:
            self._part.write(name, t)
        self._parts.append(self._part.close())
        self._part = None
        self._pending, self._pending_bytes = [], 0

    def finish(self, config: Mapping[str, Any], src_dir: Optional[str] = None, *, mindie_format: bool = False,
               job: Optional[Mapping[str, Any]] = None, extra: Optional[Mapping[str, bytes]] = None,
               optional: Optional[Mapping[str, Any]] = None) -> dict:
        """Commit the shards and write the other files, the description last; returns the manifest.
        ``config``: the source's config.json object; ``src_dir``: where to copy tokenizer files etc.
        from (None: nothing copied); ``job``: free-form JSON-able info recorded in the manifest."""
        self._require_open()
        check_finish_args(self.dst, config, src_dir, self.model_dtype)
        self._wait()
        self._stop_background()
        return self._checked(self._finish, config, src_dir, mindie_format, job, extra, optional)

    def _finish(self, config, src_dir, mindie_format, job, extra, optional) -> dict:
        self._flush()
        if self._planned is not None and len(self._types) != len(self._planned):
            missing = [s.name for s in self._planned[len(self._types):]]
            raise ValueError(f"{self.dst}: {len(missing)} planned tensors were never added: {missing[:5]}")
        if not self._parts:
            raise ValueError(f"{self.dst}: no tensors were added")
        self._swap_out()
        committed = []
        for part, final in zip(self._parts, self.naming.file_names(len(self._parts))):
            path = storage.join(self.dst, final)
            storage.move(part.path, path)
            self._written.append(path)
            committed.append(dataclasses.replace(part, path=path))
        self._parts = []
        manifest = finalize(self.dst, self.dialect, committed, self._types, config, src_dir,
                            mindie_format=mindie_format, job=job, wrote=self._written.append, extra=extra,
                            optional=optional)
        self._state = "finished"
        return manifest


def prepare_unit(tensors: Mapping[str, torch.Tensor], types: Mapping[str, str], dialect: str,
                 model_dtype: DtypeLike, added: Container[str] = ()
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, TensorSpec]]:
    """One unit (the globals or a layer) checked and converted to ``dialect``: (tensors, types, specs).
    ascendV1's per-layer ``self_attn.quant_type: "INT8"`` entries may be in ``types``: they are checked
    and dropped, as the description derives them from the FA3 tensors. ``added``: names already written.
    Raises ValueError naming the tensors for a mismatch of names, a repeated name, an unknown type or a
    broken format rule."""
    entries = {n: t for n, t in types.items() if n.endswith(LAYER_ENTRY_SUFFIX) and n not in tensors}
    if any(t != LAYER_QUANT_TYPE for t in entries.values()):
        raise ValueError(f"per-layer entries {entries} must be {LAYER_QUANT_TYPE!r}")
    types = {n: t for n, t in types.items() if n not in entries}
    if set(tensors) != set(types):
        raise ValueError(f"tensors without a type: {sorted(set(tensors) - set(types))[:5]}; "
                         f"types without a tensor: {sorted(set(types) - set(tensors))[:5]}")
    repeated = [n for n in tensors if n in added]
    if repeated:
        raise ValueError(f"tensors already added: {repeated[:5]}")
    unknown = {n: t for n, t in types.items() if t not in TENSOR_TYPES}
    if unknown:
        raise ValueError(f"unknown types {dict(list(unknown.items())[:5])} (known: {TENSOR_TYPES})")
    md = _torch_dtype(model_dtype)
    conv, conv_types = to_dialect(tensors, types, dialect, md)
    specs = {n: TensorSpec.of(n, t) for n, t in conv.items()}
    broken = check_tensors(specs, conv_types, dialect, DTYPE_NAMES[md])
    if broken:
        raise ValueError(f"{len(broken)} format violations in the {dialect} dialect: "
                         + "; ".join(str(v) for v in broken[:5]))
    return conv, conv_types, specs


def check_next(got: Sequence[TensorSpec], planned: Sequence[TensorSpec], start: int) -> None:
    """``got`` must be ``planned[start:start + len(got)]``; else ValueError naming the first difference."""
    for k, g in enumerate(got, start=start):
        want = planned[k] if k < len(planned) else None
        if g != want:
            raise ValueError(f"tensor {g.name!r} {g.dtype} {list(g.shape)} is not the next planned one: "
                             + (f"{want.name!r} {want.dtype} {list(want.shape)}" if want else "all were added"))


def check_finish_args(dst: str, config: Mapping[str, Any], src_dir: Optional[str], model_dtype: DtypeLike) -> None:
    """The source config must be the quantized model's (its dtype) and the source must not be ``dst``."""
    md = _torch_dtype(model_dtype)
    dtype = config.get("torch_dtype", config.get("dtype"))
    if dtype is not None and MD_NAMES.get(dtype) != DTYPE_NAMES[md]:
        raise ValueError(f"config.json says torch_dtype {dtype!r} but the tensors were written for "
                         f"{md}; pass the config of the model that was quantized")
    if src_dir is not None and storage.same_location(src_dir, dst):
        raise ValueError(f"{dst}: the destination is the source {src_dir}; choose another --save-path")
