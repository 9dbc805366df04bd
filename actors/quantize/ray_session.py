"""Connecting to Ray, creating the stage actors, and telling a failure worth retrying from a bug."""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import ray

from actors.cluster.ray_start import init_ray
from pipeline.io import storage
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.stage import StageSpec

GiB = 1024 ** 3
class JobFailed(RuntimeError):
    """An unrecoverable failure of the distributed job (the message names what failed)."""


@dataclass(frozen=True)
class DistOptions:
    """How the distributed job runs (what it computes is the Recipe's and QuantizeOptions')."""

    stages: int = 2
    replicas: int = 1                       # data-parallel copies of every stage
    address: Optional[str] = None           # Ray address; None: RAY_ADDRESS, else a private local Ray
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    memory_per_actor: int = 0               # bytes reserved with Ray's memory resource (0: none)
    resources: Mapping[str, float] = field(default_factory=dict)  # custom resources per actor
    in_flight: int = 4                      # calibration samples in flight per replica chain (backpressure)
    max_restarts: int = 4                   # per actor
    attempts: int = 3                       # per sample chain and per unit, the first included
    restart_wait_s: float = 120.0           # how long an actor met restarting is waited for (no attempt spent)
    verify: str = "sha256"                  # how committed shards of an earlier run are checked on resume
    object_store_memory: int = GiB // 2     # for a local Ray started here
    name: str = "dsquant"
    progress_s: float = 10.0                # seconds between progress lines
    ray_logs: bool = True                   # Ray's own log lines and the workers' output in this process

    def __post_init__(self):
        for f in ("stages", "replicas", "in_flight", "attempts"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be an integer >= 1, got {v!r}")
        if not self.restart_wait_s >= 0:
            raise ValueError(f"restart_wait_s must be >= 0, got {self.restart_wait_s!r}")
        if self.cpus_per_actor <= 0 and self.gpus_per_actor <= 0:
            raise ValueError("an actor needs cpus_per_actor > 0 or gpus_per_actor > 0")


def connect(dist: DistOptions, n_actors: int) -> bool:
    """Use the Ray this process is already in, or join the cluster at ``dist.address`` / RAY_ADDRESS, or
    start a private local Ray sized for ``n_actors`` with a capped object store (never a cluster that
    merely runs on this machine: see actors.cluster.ray_start). Returns whether Ray was initialised here (the
    caller shuts it down)."""
    if ray.is_initialized():
        return False
    cpus = max(os.cpu_count() or 1, math.ceil(n_actors * max(dist.cpus_per_actor, 0)))
    init_ray(dist.address, num_cpus=cpus, object_store_memory=dist.object_store_memory, flag="--ray-address",
             log=print if dist.ray_logs else (lambda _m: None), **_quiet(dist))
    return True


def _quiet(dist: DistOptions) -> dict:
    return {} if dist.ray_logs else {"log_to_driver": False, "logging_level": "ERROR"}


def make_actors(src: str, specs: list[StageSpec], recipe: Recipe, dist: DistOptions) -> list[list[Any]]:
    """actors[stage][replica], named ``<name>-<run>-stage<k>-r<r>`` for the dashboard and for tests."""
    from actors.quantize.stage import StageWorker

    run = uuid.uuid4().hex[:6]
    cls = ray.remote(StageWorker)
    opts: dict[str, Any] = {"num_cpus": dist.cpus_per_actor, "num_gpus": dist.gpus_per_actor,
                            "max_restarts": dist.max_restarts, "max_task_retries": 0}
    if dist.memory_per_actor:
        opts["memory"] = dist.memory_per_actor
    if dist.resources:
        opts["resources"] = dict(dist.resources)
    threads = max(1, int(dist.cpus_per_actor))
    device = "cuda" if dist.gpus_per_actor > 0 else "cpu"
    return [[cls.options(name=f"{dist.name}-{run}-stage{sp.index}-r{r}", **opts).remote(
        src, sp, recipe.to_dict(), storage.options(), threads, device) for r in range(dist.replicas)]
        for sp in specs]


def cluster_resources() -> dict:
    """What the connected Ray reports, in the shape ``Plan.check_resources`` reads: the cluster's totals
    (actors that do not fit at once wait for resources; a plan beyond the totals never runs)."""
    avail = ray.cluster_resources()
    nodes = [{"name": n.get("NodeManagerAddress", n.get("NodeID", "?")),
              "memory": n["Resources"].get("memory", 0), "CPU": n["Resources"].get("CPU", 0),
              "GPU": n["Resources"].get("GPU", 0)} for n in ray.nodes() if n.get("Alive")]
    return {"memory": avail.get("memory", 0), "CPU": avail.get("CPU", 0), "GPU": avail.get("GPU", 0),
            "nodes": nodes}
