"""The distributed job's plan, from the source's index and safetensors headers alone (pure; no Ray, no
weight read): which pipeline stage owns which contiguous units, which output shard holds which tensors,
and what each actor is estimated to need. ``python -m jobs.plan`` prints it.

Units (:mod:`pipeline.quant.job.costs`): ``embed``, layers ``0..L-1``, ``head`` (norm + lm_head), MTP layers.
``embed`` is glued to layer 0 and ``head`` to layer L-1 (the stage that runs them runs those layers); the
MTP layer is a unit of its own, on the last stage or a stage of its own.

Balance. A unit's cost is a blend of its share of the stored bytes (what drives reading, dequantizing,
quantizing and writing) and of the calibration FLOPs (what drives the forward):

    cost(u) = bytes_weight * stored(u) / sum(stored) + (1 - bytes_weight) * flops(u) / sum(flops)

(``bytes_weight`` 0.5 by default). The stages are the contiguous partition that minimizes the largest
stage cost (exact: binary search over the O(n^2) contiguous sums with a greedy feasibility test), and
among those the one that maximizes the smallest stage cost (an exact DP), so no stage is left nearly idle
(:mod:`pipeline.quant.plan.partition`).

Output shards: the writer's rule (:mod:`pipeline.quant.writing.shard_layout`: the globals, then each layer, a shard
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
              weight phase (layer by layer, as pipeline.quant.job.run): max over units of stored + float + output
                         bytes, + the writer's queue (up to one shard)
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from pipeline.format.description import NAMING
from pipeline.io.checkpoint import CheckpointReader
from pipeline.io.safetensors_io import itemsize
from pipeline.quant.job.costs import EMBED, HEAD, MD_NAMES, LayerCost, unit_costs
from pipeline.quant.plan.memory import calib_memory, weight_memory
from pipeline.quant.plan.partition import partition, stage_units, unit_cost_shares
from pipeline.quant.plan.types import (
    DEFAULT_CALIB_SAMPLES, DEFAULT_SEQ_LEN, RUNTIME_BYTES, SHARD_BYTES, Plan, PlanError, PlanParams, ShardPlan, StagePlan,
    WorkerPlan,
)
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.writing.shard_layout import split_sizes


def _pack_shards(groups: Sequence[Sequence[LayerCost]], outputs: Mapping[str, list[tuple[str, int]]],
                 shard_bytes: int) -> list[dict]:
    """The output's shards in file order, by the rule of :mod:`pipeline.quant.writing.shard_layout`: the globals
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
