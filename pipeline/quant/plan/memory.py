"""Per-actor memory estimates of a plan (the formulas are in :mod:`pipeline.quant.plan.planner`'s docstring)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from pipeline.quant.job.costs import LayerCost
from pipeline.quant.plan.partition import stage_units
from pipeline.quant.plan.types import Plan, PlanParams

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
    pipeline.quant.job.run.quantize_weights runs it: the writer streams each tensor into a planned shard (no
    shard queue), the reader holds one stored batch at a time, and the next layer is prefetched, so the
    peak is a layer's float weights and int8 output plus the next layer's float weights, plus one read
    batch for each of the two threads."""
    if not units or not written:
        return 0
    nxt = [u.float_bytes for u in units[1:]] + [0]
    return max(u.float_bytes + u.output_bytes + n for u, n in zip(units, nxt)) + 2 * READ_BATCH_BYTES


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
