"""Contiguous partitions: which units each pipeline stage owns (pure arithmetic on unit costs).

A unit's cost is a blend of its share of the stored bytes and of the calibration FLOPs (see
:func:`unit_cost_shares`); ``embed`` may not be cut from the first layer nor ``head`` from the last main
layer (:func:`atoms_of`). :func:`partition` is exact: the smallest possible largest part (binary search over
the O(n^2) contiguous sums with a greedy feasibility test), then, among those, the largest possible
smallest part (a DP), so that no stage is left nearly idle.
"""

from __future__ import annotations

import math
from typing import Sequence

from pipeline.quant.job.costs import EMBED, HEAD, LayerCost
from pipeline.quant.plan.types import PlanError




def atoms_of(units: Sequence[LayerCost]) -> list[list[int]]:
    """Indices of ``units`` grouped into what may not be split: embed with the next unit, head with the
    previous one."""
    atoms: list[list[int]] = []
    for i, u in enumerate(units):
        if atoms and (u.unit == HEAD or units[i - 1].unit == EMBED):
            atoms[-1].append(i)
        else:
            atoms.append([i])
    return atoms


def partition(costs: Sequence[float], k: int) -> list[tuple[int, int]]:
    """[start, end) ranges of ``k`` contiguous non-empty parts of ``costs``: the largest part as small as
    possible, then the smallest part as large as possible."""
    n = len(costs)
    if not 1 <= k <= n:
        raise PlanError(f"cannot cut {n} units into {k} stages")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    eps = 1e-12 * max(pre[-1], 1e-300)

    def parts_needed(limit: float) -> int:
        parts, run = 1, 0.0
        for c in costs:
            if run + c > limit + eps:
                parts, run = parts + 1, c
            else:
                run += c
        return parts

    candidates = sorted({pre[j] - pre[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # the smallest candidate limit that <= k parts can meet (max(costs) <= it always)
        mid = (lo + hi) // 2
        if candidates[mid] >= max(costs) - eps and parts_needed(candidates[mid]) <= k:
            hi = mid
        else:
            lo = mid + 1
    limit = candidates[lo] + eps
    # best[j][i]: the largest possible smallest part when the first i costs form j parts, each <= limit
    NEG = -math.inf
    best = [[NEG] * (n + 1) for _ in range(k + 1)]
    back = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = math.inf
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for m in range(i - 1, j - 2, -1):  # the last part grows as m falls: stop past the limit
                s = pre[i] - pre[m]
                if s > limit:
                    break
                if best[j - 1][m] == NEG:
                    continue
                v = min(best[j - 1][m], s)
                if v > best[j][i]:
                    best[j][i], back[j][i] = v, m
    out, i = [], n
    for j in range(k, 0, -1):
        out.append((back[j][i], i))
        i = back[j][i]
    return out[::-1]


def unit_cost_shares(units: Sequence[LayerCost], bytes_weight: float) -> list[float]:
    tb = sum(u.stored_bytes for u in units) or 1
    tf = sum(u.flops_per_token for u in units) or 1.0
    return [bytes_weight * u.stored_bytes / tb + (1 - bytes_weight) * u.flops_per_token / tf for u in units]


def stage_units(units: Sequence[LayerCost], k: int, bytes_weight: float) -> list[list[LayerCost]]:
    """The units of each of ``k`` stages (see :func:`partition`)."""
    atoms = atoms_of(units)
    if not 1 <= k <= len(atoms):
        raise PlanError(f"stages must be in 1..{len(atoms)} for this model ({len(atoms)} placeable units: "
                        f"embed goes with the first layer, norm+lm_head with the last main layer)")
    share = unit_cost_shares(units, bytes_weight)
    ranges = partition([sum(share[i] for i in a) for a in atoms], k)
    return [[units[i] for a in atoms[s:e] for i in a] for s, e in ranges]
