"""The distributed job's plan, from the source's index and safetensors headers alone (pure; no Ray, no
weight read): which pipeline stage owns which contiguous units, which output shard holds which tensors,
and what each actor is estimated to need. ``python -m jobs.plan`` prints it.

Units (:mod:`pipeline.plan_costs`): ``embed``, layers ``0..L-1``, ``head`` (norm + lm_head), MTP layers.
``embed`` is glued to layer 0 and ``head`` to layer L-1 (the stage that runs them runs those layers); the
MTP layer is a unit of its own, on the last stage or a stage of its own.

Balance. A unit's cost is a blend of its share of the stored bytes (what drives reading, dequantizing,
quantizing and writing) and of the calibration FLOPs (what drives the forward):

    cost(u) = bytes_weight * stored(u) / sum(stored) + (1 - bytes_weight) * flops(u) / sum(flops)

(``bytes_weight`` 0.5 by default). The stages are the contiguous partition that minimizes the largest
stage cost (exact: binary search over the O(n^2) contiguous sums with a greedy feasibility test), and
among those the one that maximizes the smallest stage cost (an exact DP), so no stage is left nearly idle
(:mod:`pipeline.plan_partition`).

Output shards: the writer's rule (:mod:`pipeline.quant.shard_layout`: the globals, then each layer, a shard
never spanning two of them), so a shard never spans two stages and every shard's final name
(``-0000i-of-0000N``, N over the whole job) is known before anything runs; the globals' shards go to stage 0.

Per-actor estimates (each of the ``replicas`` copies of a stage is one actor):

    read      calibration: the stored bytes of the stage's forward units (every replica reads them); weight
              phase: the stored bytes of every unit feeding the shards the actor writes (the stage's shards
              are split into ``replicas`` contiguous groups; with ``weight_workers`` > 0 separate workers
              take contiguous groups of all shards instead)
    written   the bytes of the shards it writes
    FLOPs     sum of flops_per_token over the stage x calib_tokens / replicas
    memory    max(calibration, weight phase) + RUNTIME_BYTES, where, with act = the largest act_bytes of the
              stage + queue_depth in-flight micro-batches of hidden states:
              resident:  every forward unit's weights dequantized (float_bytes) + act
              streaming: one unit at a time (its stored + float bytes) + act + the hidden states of all the
                         actor's calibration tokens, in and out (the stage runs layer by layer over all tokens)
              weight phase (layer by layer, as pipeline.quant.run): max over units of stored + float + output
                         bytes, + the writer's queue (up to one shard)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from pipeline.checkpoint import CheckpointReader
from pipeline.plan_costs import EMBED, HEAD, MD_NAMES, LayerCost, unit_costs
from pipeline.plan_partition import PlanError, atoms_of, partition, stage_units, unit_cost_shares
from pipeline.quant.description import NAMING
from pipeline.quant.recipe import Recipe
from pipeline.quant.shard_layout import split_sizes
from pipeline.safetensors_io import itemsize

__all__ = ["Plan", "PlanError", "PlanParams", "ShardPlan", "StagePlan", "WorkerPlan", "plan", "make_plan",
           "replan_memory", "calib_memory", "weight_memory", "atoms_of", "partition", "stage_units",
           "unit_cost_shares", "units_label", "GiB", "SHARD_BYTES", "RUNTIME_BYTES", "MEMORY_MODELS"]

GiB = 1024 ** 3
SHARD_BYTES = 4 * GiB
RUNTIME_BYTES = 2 * GiB   # Python, torch, a Ray worker and read buffers, per actor
MEMORY_MODELS = ("resident", "streaming")
DEFAULT_SEQ_LEN = 2048
DEFAULT_CALIB_SAMPLES = 128


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


@dataclass(frozen=True)
class PlanParams:
    stages: int
    replicas: int = 1
    seq_len: int = DEFAULT_SEQ_LEN
    calib_tokens: int = DEFAULT_CALIB_SAMPLES * DEFAULT_SEQ_LEN
    shard_bytes: int = SHARD_BYTES
    weight_workers: int = 0
    memory_model: str = "resident"
    bytes_weight: float = 0.5
    queue_depth: int = 2
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    dialect: str = "seed"

    def __post_init__(self):
        for f in ("stages", "replicas", "seq_len", "calib_tokens", "shard_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{f} must be an integer >= 1, got {v!r}")
        for f in ("weight_workers", "queue_depth"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"{f} must be an integer >= 0, got {v!r}")
        if self.memory_model not in MEMORY_MODELS:
            raise PlanError(f"memory_model must be one of {MEMORY_MODELS}, got {self.memory_model!r}")
        if not 0 <= self.bytes_weight <= 1:
            raise PlanError(f"bytes_weight must be in [0, 1], got {self.bytes_weight!r}")
        if self.cpus_per_actor < 0 or self.gpus_per_actor < 0:
            raise PlanError("cpus_per_actor and gpus_per_actor must be >= 0")


@dataclass(frozen=True)
class StagePlan:
    """One stage; the estimates are per actor (the largest over the stage's replicas)."""

    index: int
    units: tuple[str, ...]
    cost: float
    stored_bytes: int
    float_bytes: int
    output_bytes: int
    flops_per_token: float
    calib_flops: float
    read_bytes: int
    write_bytes: int
    calib_memory: int
    weight_memory: int
    peak_memory: int
    shards: tuple[int, ...]

    @property
    def label(self) -> str:
        return units_label(self.units)


@dataclass(frozen=True)
class ShardPlan:
    index: int                 # 0-based, global
    name: str
    stage: int
    units: tuple[str, ...]
    first: str                 # first and last tensor names, in write order
    last: str
    nbytes: int
    tensors: int


@dataclass(frozen=True)
class WorkerPlan:
    """A weight-phase worker (only with weight_workers > 0)."""

    index: int
    shards: tuple[int, ...]
    read_bytes: int
    write_bytes: int
    peak_memory: int


def units_label(units: Sequence[str]) -> str:
    """Runs of consecutive layers joined with embed/head: ("embed", "0", ..., "14") -> "embed+0-14";
    ("45", ..., "60", "head", "61") -> "45-60+head+61"."""
    parts: list[list[str]] = []
    for u in units:
        if u not in (EMBED, HEAD) and parts and parts[-1][0] not in (EMBED, HEAD) \
                and int(parts[-1][-1]) + 1 == int(u):
            parts[-1].append(u)
        else:
            parts.append([u])
    return "+".join(p[0] if len(p) == 1 else f"{p[0]}-{p[-1]}" for p in parts)


# ----- memory -------------------------------------------------------------------------------------------
def calib_memory(units: Sequence[LayerCost], p: PlanParams, hidden_bytes_per_token: int) -> int:
    """Calibration working set of one actor holding ``units`` (see the module docstring)."""
    fwd = [u for u in units if u.forward]
    if not fwd:
        return 0
    act = max(u.act_bytes for u in fwd) + p.queue_depth * p.seq_len * hidden_bytes_per_token
    if p.memory_model == "resident":
        return sum(u.float_bytes for u in fwd) + act
    tokens = math.ceil(p.calib_tokens / p.replicas)
    return max(u.stored_bytes + u.float_bytes for u in fwd) + act + 2 * tokens * hidden_bytes_per_token


READ_BATCH_BYTES = 64 * 1024 ** 2   # the reader dequantizes a layer in batches of at most this many stored bytes


def weight_memory(units: Sequence[LayerCost], written: int, p: PlanParams) -> int:
    """Weight phase of one actor quantizing ``units`` layer by layer and writing ``written`` bytes, as
    pipeline.quant.run.quantize_weights runs it: the writer streams each tensor into a planned shard (no
    shard queue), the reader holds one stored batch at a time, and the next layer is prefetched, so the
    peak is a layer's float weights and int8 output plus the next layer's float weights, plus one read
    batch for each of the two threads."""
    if not units or not written:
        return 0
    nxt = [u.float_bytes for u in units[1:]] + [0]
    return max(u.float_bytes + u.output_bytes + n for u, n in zip(units, nxt)) + 2 * READ_BATCH_BYTES


# ----- the plan -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    model: str
    params: PlanParams
    hidden_bytes_per_token: int
    units: tuple[LayerCost, ...]
    stages: tuple[StagePlan, ...]
    shards: tuple[ShardPlan, ...]
    workers: tuple[WorkerPlan, ...] = field(default=())

    @property
    def n_actors(self) -> int:
        return self.params.stages * self.params.replicas + self.params.weight_workers

    def actor_peaks(self) -> list[tuple[str, int]]:
        """(actor name, estimated peak memory) of every actor."""
        out = [(f"stage {s.index} replica {r}", s.peak_memory)
               for s in self.stages for r in range(self.params.replicas)]
        return out + [(f"weight worker {w.index}", w.peak_memory) for w in self.workers]

    def total(self, key: str) -> float:
        """Sum over units of a LayerCost field (stored_bytes, float_bytes, output_bytes, flops_per_token)."""
        return sum(getattr(u, key) for u in self.units)

    @property
    def read_bytes(self) -> int:
        return self.params.replicas * sum(s.read_bytes for s in self.stages) + sum(w.read_bytes for w in self.workers)

    def to_dict(self) -> dict:
        """JSON-ready; :meth:`from_dict` restores an equal Plan (strict: unknown keys raise)."""
        from pipeline.plan_report import plan_to_dict

        return plan_to_dict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Plan":
        from pipeline.plan_report import plan_from_dict

        return plan_from_dict(raw)

    def to_text(self) -> str:
        """A readable summary and one table row per stage (and per weight worker)."""
        from pipeline.plan_report import plan_to_text

        return plan_to_text(self)

    def check_resources(self, available: Mapping[str, Any]) -> None:
        """Raise PlanError saying what to change when ``available`` (Ray's resources as a dict: "memory",
        "CPU", "GPU", "gpu_memory", "nodes": [...]; see pipeline.plan_resources) cannot run the plan."""
        from pipeline.plan_resources import check_resources

        check_resources(self, available)


def _pack_shards(groups: Sequence[Sequence[LayerCost]], outputs: Mapping[str, list[tuple[str, int]]],
                 shard_bytes: int) -> list[dict]:
    """The output's shards in file order, by the rule of :mod:`pipeline.quant.shard_layout`: the globals
    (``embed`` then ``head``'s tensors, on the stage that runs embed), then each layer, a shard never
    spanning two of these units."""
    stage_of = {u.unit: si for si, g in enumerate(groups) for u in g}
    units = [((EMBED, HEAD), outputs[EMBED] + outputs[HEAD])]
    units += [((u.unit,), outputs[u.unit]) for g in groups for u in g if u.unit not in (EMBED, HEAD)]
    shards: list[dict] = []
    for names, outs in units:
        k = 0
        for c in split_sizes([n for _, n in outs], shard_bytes):
            part = outs[k:k + c]
            k += c
            shards.append({"stage": stage_of[names[0]], "units": list(names), "first": part[0][0],
                           "last": part[-1][0], "nbytes": sum(n for _, n in part), "tensors": c})
    return shards


def _writer_groups(shard_ids: Sequence[int], shards: Sequence[ShardPlan], groups: int) -> list[list[int]]:
    """``shard_ids`` cut into at most ``groups`` contiguous groups balanced by bytes."""
    k = min(groups, len(shard_ids))
    if k == 0:
        return []
    ranges = partition([float(shards[i].nbytes) for i in shard_ids], k)
    return [list(shard_ids[s:e]) for s, e in ranges]


def _group_io(group: Sequence[int], shards: Sequence[ShardPlan], by_name: Mapping[str, LayerCost],
              p: PlanParams) -> tuple[int, int, int]:
    """(read, written, weight-phase memory) of one writer of ``group``: it reads every unit its shards
    draw from (a unit split across two writers is read by both)."""
    touched = list(dict.fromkeys(u for i in group for u in shards[i].units))
    units = [by_name[u] for u in touched]
    written = sum(shards[i].nbytes for i in group)
    return sum(u.stored_bytes for u in units), written, weight_memory(units, written, p)


def make_plan(model: str, units: Sequence[LayerCost], outputs: Mapping[str, list[tuple[str, int]]],
              params: PlanParams, hidden_bytes_per_token: int) -> Plan:
    """The plan from unit costs (see :func:`plan`)."""
    p = params
    groups = stage_units(units, p.stages, p.bytes_weight)
    packed = _pack_shards(groups, outputs, p.shard_bytes)
    names = NAMING[p.dialect].file_names(len(packed))
    shards = tuple(ShardPlan(index=i, name=names[i], stage=d["stage"], units=tuple(d["units"]), first=d["first"],
                             last=d["last"], nbytes=d["nbytes"], tensors=d["tensors"]) for i, d in enumerate(packed))
    by_name = {u.unit: u for u in units}
    share = dict(zip((u.unit for u in units), unit_cost_shares(units, p.bytes_weight)))
    stages = []
    for si, g in enumerate(groups):
        ids = [s.index for s in shards if s.stage == si]
        calib_read = sum(u.stored_bytes for u in g if u.forward)
        if p.weight_workers:
            io = [(0, 0, 0)]
        else:
            io = [_group_io(grp, shards, by_name, p) for grp in _writer_groups(ids, shards, p.replicas)]
        cm = calib_memory(g, p, hidden_bytes_per_token)
        wm = max(m for _, _, m in io)
        fpt = sum(u.flops_per_token for u in g)
        stages.append(StagePlan(
            index=si, units=tuple(u.unit for u in g), cost=sum(share[u.unit] for u in g),
            stored_bytes=sum(u.stored_bytes for u in g), float_bytes=sum(u.float_bytes for u in g),
            output_bytes=sum(u.output_bytes for u in g), flops_per_token=fpt,
            calib_flops=fpt * p.calib_tokens / p.replicas, read_bytes=calib_read + max(r for r, _, _ in io),
            write_bytes=max(w for _, w, _ in io), calib_memory=cm, weight_memory=wm,
            peak_memory=max(cm, wm) + RUNTIME_BYTES, shards=tuple(ids)))
    workers = []
    for wi, grp in enumerate(_writer_groups(range(len(shards)), shards, p.weight_workers)):
        r, w, m = _group_io(grp, shards, by_name, p)
        workers.append(WorkerPlan(index=wi, shards=tuple(grp), read_bytes=r, write_bytes=w,
                                  peak_memory=m + RUNTIME_BYTES))
    return Plan(model=model, params=p, hidden_bytes_per_token=hidden_bytes_per_token, units=tuple(units),
                stages=tuple(stages), shards=shards, workers=tuple(workers))


def plan(source: Union[str, CheckpointReader], stages: int, replicas: int = 1, recipe: Optional[Recipe] = None,
         calib_tokens: int = DEFAULT_CALIB_SAMPLES * DEFAULT_SEQ_LEN, seq_len: int = DEFAULT_SEQ_LEN,
         shard_bytes: int = SHARD_BYTES, weight_workers: int = 0, **options: Any) -> Plan:
    """Plan the job for checkpoint ``source`` (a path/URL or an open CheckpointReader) from its index and
    headers only. ``options``: the other :class:`PlanParams` fields (memory_model, bytes_weight,
    queue_depth, cpus_per_actor, gpus_per_actor). Raises :class:`PlanError` for impossible parameters and
    CheckpointError for a checkpoint that does not match its config."""
    recipe = recipe or Recipe()
    params = PlanParams(stages=stages, replicas=replicas, seq_len=seq_len, calib_tokens=calib_tokens,
                        shard_bytes=shard_bytes, weight_workers=weight_workers, dialect=recipe.dialect, **options)
    reader = source if isinstance(source, CheckpointReader) else CheckpointReader(source)
    cfg = reader.config
    if seq_len > cfg.max_position_embeddings:
        raise PlanError(f"seq_len {seq_len} exceeds the model's max_position_embeddings "
                        f"{cfg.max_position_embeddings}")
    units, outputs = unit_costs(reader, recipe, seq_len)
    hbt = cfg.hidden_size * itemsize(MD_NAMES[cfg.torch_dtype])
    return make_plan(reader.path, units, outputs, params, hbt)


def replan_memory(plan_: Plan, **changes: Any) -> list[tuple[int, int, int]]:
    """(stage, calibration memory, weight-phase memory) per stage of the same model with some params
    changed (stages, memory_model, replicas, ...), without the shard packing: for suggestions."""
    p = dataclasses.replace(plan_.params, **changes)
    out = []
    for si, g in enumerate(stage_units(plan_.units, p.stages, p.bytes_weight)):
        out_bytes = sum(u.output_bytes for u in g)
        wm = 0 if p.weight_workers else weight_memory(g, out_bytes, p)
        out.append((si, calib_memory(g, p, plan_.hidden_bytes_per_token), wm))
    return out
