"""A :class:`pipeline.quant.plan.Plan` as a dict (strict round trip) and as a readable table."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pipeline.quant.plan.types import GiB, Plan, PlanError, PlanParams, ShardPlan, StagePlan, WorkerPlan, units_label
from pipeline.quant.job.costs import LayerCost
from pipeline.strict import build, check_keys

_DERIVED = ("totals",)


def plan_to_dict(plan: Plan) -> dict:
    def rows(items):
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(x).items()} for x in items]

    return {
        "model": plan.model,
        "params": dataclasses.asdict(plan.params),
        "hidden_bytes_per_token": plan.hidden_bytes_per_token,
        "units": [u.to_dict() for u in plan.units],
        "stages": rows(plan.stages),
        "shards": rows(plan.shards),
        "workers": rows(plan.workers),
        "totals": {
            "stored_bytes": plan.total("stored_bytes"), "float_bytes": plan.total("float_bytes"),
            "output_bytes": plan.total("output_bytes"), "shards": len(plan.shards), "actors": plan.n_actors,
            "read_bytes": plan.read_bytes, "calib_flops": plan.total("flops_per_token") * plan.params.calib_tokens,
        },
    }


def _build(cls, raw: Any, where: str):
    """A frozen dataclass from a dict: unknown or missing keys raise; lists become tuples."""
    return build(cls, raw, f"plan: {where}", PlanError)


def plan_from_dict(raw: Mapping[str, Any]) -> Plan:
    check_keys({k: v for k, v in raw.items() if k not in _DERIVED} if isinstance(raw, Mapping) else raw, Plan,
               "plan", PlanError)
    missing = sorted({"model", "params", "hidden_bytes_per_token", "units", "stages", "shards"} - set(raw))
    if missing:
        raise PlanError(f"plan: missing key(s) {missing}")
    units = []
    for i, u in enumerate(raw["units"]):
        _build(LayerCost, u, f"units[{i}]")  # strict key check; from_dict restores the types
        units.append(LayerCost.from_dict(u))
    return Plan(
        model=raw["model"], params=_build(PlanParams, raw["params"], "params"),
        hidden_bytes_per_token=raw["hidden_bytes_per_token"], units=tuple(units),
        stages=tuple(_build(StagePlan, s, f"stages[{i}]") for i, s in enumerate(raw["stages"])),
        shards=tuple(_build(ShardPlan, s, f"shards[{i}]") for i, s in enumerate(raw["shards"])),
        workers=tuple(_build(WorkerPlan, w, f"workers[{i}]") for i, w in enumerate(raw.get("workers", []))))


def _g(n: float, unit: int = GiB) -> str:
    return f"{n / unit:,.1f}"


def _unit(largest: float) -> tuple[str, int]:
    """GiB for a large model, MiB for a small one, so the table shows digits."""
    return ("GiB", GiB) if largest >= GiB else ("MiB", 1024 ** 2)


def _flops(n: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} FLOP"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def plan_to_text(plan: Plan) -> str:
    p = plan.params
    mtp = [u.unit for u in plan.units if u.layer_id is not None and not u.forward]
    total_flops = plan.total("flops_per_token") or 1.0
    out = [
        f"model      {plan.model}",
        f"units      {len(plan.units)} ({units_label([u.unit for u in plan.units])})"
        + (f"; not in the calibration forward: {', '.join(mtp)}" if mtp else ""),
        f"bytes      stored {plan.total('stored_bytes') / 1e9:,.3f} GB, float {plan.total('float_bytes') / 1e9:,.3f} GB, "
        f"output {plan.total('output_bytes') / 1e9:,.3f} GB in {len(plan.shards)} shards of <= "
        f"{_g(p.shard_bytes)} GiB ({p.dialect})",
        f"calibrate  {p.calib_tokens:,} tokens in micro-batches of {p.seq_len}, "
        f"{_flops(total_flops * p.calib_tokens)} in all; memory model {p.memory_model}",
        f"actors     {p.stages} stages x {p.replicas} replicas"
        + (f" + {p.weight_workers} weight workers" if p.weight_workers else "")
        + f" = {plan.n_actors}; read {_g(plan.read_bytes, _unit(plan.read_bytes)[1])} "
        f"{_unit(plan.read_bytes)[0]} in all",
        "",
    ]
    name, unit = _unit(max(s.read_bytes for s in plan.stages))
    rows = []
    for s in plan.stages:
        sh = f"{s.shards[0] + 1}-{s.shards[-1] + 1}" if s.shards else "-"
        rows.append([str(s.index), s.label, _g(s.read_bytes, unit), _g(s.float_bytes, unit),
                     _g(s.output_bytes, unit), sh, _g(s.peak_memory), f"{100 * s.flops_per_token / total_flops:.1f}%",
                     f"{100 * s.cost:.1f}%"])
    out += _table(["stage", "units", f"read {name}", f"float {name}", f"output {name}", "shards", "peak GiB",
                   "FLOPs", "cost"], rows)
    if plan.workers:
        out.append("")
        wrows = [[str(w.index), f"{w.shards[0] + 1}-{w.shards[-1] + 1}", _g(w.read_bytes, unit),
                  _g(w.write_bytes, unit), _g(w.peak_memory)] for w in plan.workers]
        out += _table(["worker", "shards", f"read {name}", f"write {name}", "peak GiB"], wrows)
    out.append("")
    out.append("read/peak are per actor (the largest replica); shards are 1-based file numbers.")
    return "\n".join(out)
