"""The plan's data: parameters, per-stage / per-shard / per-worker plans, and :class:`Plan` itself, with
the sizes every planning module shares. Pure data; the planning is in :mod:`pipeline.quant.plan.planner`, the
dict/text forms in :mod:`pipeline.quant.plan.report`, the resource check in :mod:`pipeline.quant.plan.resources`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pipeline.quant.job.costs import EMBED, HEAD, LayerCost


class PlanError(ValueError):
    """A plan that cannot be made or would not fit; the message says what to change."""


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
