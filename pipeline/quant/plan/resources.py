"""Refuse a plan that the cluster cannot hold, with a message that says what to change.

``available`` is what Ray reports, as a plain dict (jobs/plan.py builds it; nothing here imports Ray)::

    {"memory": bytes, "CPU": n, "GPU": n,            # ray.available_resources()
     "gpu_memory": bytes,                            # per GPU (optional; Ray does not report it)
     "nodes": [{"name": str, "memory": bytes, "CPU": n, "GPU": n}, ...]}   # optional, alive nodes

Checks, in order: every actor's estimated peak memory fits the largest node (or the cluster's memory
when no node list is given); with GPUs per actor and ``gpu_memory``, every stage's calibration working set
fits its GPUs; the CPUs and GPUs the actors ask for exist; and all actors pack onto the nodes (first fit,
largest first, memory/CPU/GPU together). A key that is absent is not checked.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from pipeline.quant.plan.memory import replan_memory
from pipeline.quant.plan.partition import atoms_of
from pipeline.quant.plan.types import RUNTIME_BYTES, Plan, PlanError, StagePlan, gib


def _peaks(plan: Plan, **changes: Any) -> list[tuple[str, int]]:
    """(actor, estimated peak) of the same model re-planned with some params changed (none: the plan's)."""
    if not changes:
        return plan.actor_peaks()
    replicas = changes.get("replicas", plan.params.replicas)
    out = [(f"stage {si} replica {r}", max(c, w) + RUNTIME_BYTES)
           for si, c, w in replan_memory(plan, **changes) for r in range(replicas)]
    return out + [(f"weight worker {w.index}", w.peak_memory) for w in plan.workers]


def _pack(peaks: list[tuple[str, int]], nodes: list[dict], cpus: float, gpus: float) -> Optional[str]:
    """First-fit decreasing of the actors onto the nodes; the name of the first actor that finds no node."""
    inf = float("inf")  # a node that does not state its CPUs or GPUs is not limited by them
    free = [{"memory": float(n.get("memory", 0)), "CPU": float(n.get("CPU", inf)), "GPU": float(n.get("GPU", inf))}
            for n in nodes]
    for name, peak in sorted(peaks, key=lambda a: -a[1]):
        fits = [f for f in free if f["memory"] >= peak and f["CPU"] >= cpus and f["GPU"] >= gpus]
        if not fits:
            return name
        f = max(fits, key=lambda f: f["memory"])
        f["memory"] -= peak
        f["CPU"] -= cpus
        f["GPU"] -= gpus
    return None


def _stuck(plan: Plan, available: Mapping[str, Any], **changes: Any) -> Optional[str]:
    """The first actor that finds no room (on the nodes, else in the cluster's memory), or None."""
    peaks = _peaks(plan, **changes)
    if available.get("nodes"):
        return _pack(peaks, list(available["nodes"]), plan.params.cpus_per_actor, plan.params.gpus_per_actor)
    if "memory" in available and sum(pk for _, pk in peaks) > float(available["memory"]):
        return max(peaks, key=lambda a: a[1])[0]
    return None


def _fixes(plan: Plan, available: Mapping[str, Any]) -> list[str]:
    """Changes of the plan that make every actor fit, most specific first."""
    p, tips = plan.params, []
    for n in range(p.stages + 1, len(atoms_of(plan.units)) + 1):
        if _stuck(plan, available, stages=n) is None:
            tips.append(f"use at least {n} stages (raise --stages to {n})")
            break
    for r in range(p.replicas - 1, 0, -1):
        if _stuck(plan, available, replicas=r) is None:
            tips.append(f"fewer replicas (--replicas {r} fits)")
            break
    if p.memory_model == "resident" and _stuck(plan, available, memory_model="streaming") is None:
        peak = max(pk for _, pk in _peaks(plan, memory_model="streaming"))
        tips.append(f"use --memory-model streaming (est. {gib(peak)} per actor)")
    return tips


def _stage_advice(plan: Plan, s: StagePlan, cap: float, where: str, available: Mapping[str, Any]) -> str:
    msg = (f"stage {s.index} (units {s.label}) needs an estimated {gib(s.peak_memory)} per actor "
           f"(calibration {gib(s.calib_memory)} with memory model '{plan.params.memory_model}', weight phase "
           f"{gib(s.weight_memory)}, + {gib(RUNTIME_BYTES)} runtime), but {where} has {gib(cap)}: ")
    if s.calib_memory < s.weight_memory:
        return msg + (f"the weight phase holds one layer's stored, float and output bytes plus a shard, which "
                      f"more stages do not shrink; use a node with >= {gib(s.peak_memory)}, or a smaller "
                      f"--shard-gib, or --weight-workers on larger nodes")
    return msg + ", or ".join([*_fixes(plan, available), f"use a node with >= {gib(s.peak_memory)}"])


def check_resources(plan: Plan, available: Mapping[str, Any]) -> None:
    """Raise :class:`PlanError` when ``available`` (see the module docstring) cannot run ``plan``."""
    p = plan.params
    nodes = [dict(n) for n in available.get("nodes") or []]
    if nodes:
        big = max(nodes, key=lambda n: n.get("memory", 0))
        cap, where = float(big.get("memory", 0)), f"the largest node ({big.get('name', '?')})"
    elif "memory" in available:
        cap, where = float(available["memory"]), "the cluster's Ray 'memory' resource"
    else:
        cap, where = None, ""
    if cap is not None:
        for s in plan.stages:
            if s.peak_memory > cap:
                raise PlanError(_stage_advice(plan, s, cap, where, available))
        for w in plan.workers:
            if w.peak_memory > cap:
                raise PlanError(f"weight worker {w.index} needs an estimated {gib(w.peak_memory)} but {where} "
                                f"has {gib(cap)}: use a node with >= {gib(w.peak_memory)}, or a smaller --shard-gib")
    gpu_mem = available.get("gpu_memory")
    if p.gpus_per_actor and gpu_mem:
        gcap = p.gpus_per_actor * float(gpu_mem)
        for s in plan.stages:
            if s.calib_memory > gcap:
                n = next((n for n in range(p.stages + 1, len(atoms_of(plan.units)) + 1)
                          if max(c for _, c, _ in replan_memory(plan, stages=n)) <= gcap), None)
                tip = f"use at least {n} stages (raise --stages to {n}), or " if n else ""
                raise PlanError(f"stage {s.index} (units {s.label}) needs an estimated {gib(s.calib_memory)} of GPU "
                                f"memory for calibration but {p.gpus_per_actor:g} GPU(s) of {gib(gpu_mem)} hold "
                                f"{gib(gcap)}: {tip}raise --gpus-per-actor, or use --memory-model streaming")
    stage_actors = p.stages * p.replicas
    for key, per in (("CPU", p.cpus_per_actor), ("GPU", p.gpus_per_actor)):
        n_actors = plan.n_actors if key == "CPU" else stage_actors
        if key not in available:
            continue
        need, have = n_actors * per, float(available[key])
        if per and need > have:
            fit = int(have // (per * p.stages)) if p.stages * per else 0
            tip = f"fewer replicas (--replicas {fit} fits)" if 1 <= fit < p.replicas else \
                f"fewer stages or --{key.lower()}s-per-actor below {per:g}, or more nodes"
            raise PlanError(f"the plan's {n_actors} actors ask for {need:g} {key} in all (--{key.lower()}s-per-actor "
                            f"{per:g}) but Ray reports {have:g}: {tip}")
    stuck = _stuck(plan, available)
    if stuck is not None:
        peaks = plan.actor_peaks()
        nodes = list(available.get("nodes") or [])
        room = sum(float(n.get("memory", 0)) for n in nodes) if nodes else float(available.get("memory", 0))
        tips = _fixes(plan, available) or ["use more or larger nodes"]
        raise PlanError(f"the plan's {len(peaks)} actors need an estimated {gib(sum(pk for _, pk in peaks))} in all "
                        f"and do not fit the cluster ({gib(room)} of memory; {stuck} finds no node with room): "
                        + ", or ".join(tips))
