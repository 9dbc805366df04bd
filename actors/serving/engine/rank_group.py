"""A sharded replica's ranks as Ray actors (pipeline.parallel for the layout; pipeline.engine.sharding.dist_runner for
how they run).

The calling process (a job's driver, or a Serve replica) is rank 0: it holds the engine. Ranks 1..N-1
are :class:`RankWorker` actors, one per device, in a placement group: the one the caller runs in when it
has bundles to spare (a Serve replica started with ``placement_group_bundles``), else one made here
(``PACK``: a tp group's ranks land on one node when they fit). All join one ``torch.distributed`` process
group (gloo on CPU, NCCL on CUDA) through rank 0's address; each loads only its own slices of the
quantized directory. The actors are owned by the caller: when it dies they die with it (the replica goes
down as a unit), and :func:`build_sharded_engine`'s engine stops them when its runner is closed.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import asdict
from typing import Optional

import ray
import torch
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipeline.engine.sharding.comm import Comm
from pipeline.engine.sharding.dist_runner import DPRunner, ShardedRunner, follow
from pipeline.engine.sharding.dp_engine import DPEngine
from pipeline.engine.config import EngineConfig
from pipeline.engine.core.engine import LLMEngine, make_runner
from pipeline.engine.layers.qlinear import EXACT
from pipeline.engine.sharding.shard_loader import load_sharded, resident_bytes
from pipeline.engine.sharding.sharded import REDUCE
from pipeline.parallel import ParallelConfig

_log = logging.getLogger("dsquant.engine")

DEFAULT_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _load(path: str, comm: Comm, config: EngineConfig, epilogue: str, combine: str):
    return load_sharded(path, comm, device=config.device, with_mtp=config.mtp, epilogue=epilogue, combine=combine)


@ray.remote(max_concurrency=2)
class RankWorker:
    """Rank ``rank`` of a sharded replica: joins the group, loads its shard, then follows rank 0."""

    def __init__(self, path: str, parallel: dict, rank: int, init_method: str, config: dict, epilogue: str,
                 combine: str, threads: int, timeout_s: float):
        torch.set_num_threads(max(1, threads))
        self.rank = rank
        self.comm = Comm.init(ParallelConfig(**parallel), rank, init_method, timeout_s=timeout_s)
        cfg = EngineConfig(**config)
        self.loaded = _load(path, self.comm, cfg, epilogue, combine)
        self.runner = make_runner(self.loaded, cfg, scratch=self.comm.parallel.dp > 1)

    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "resident_bytes": resident_bytes(self.loaded.model), "bytes_sent": self.comm.bytes_sent}

    def run(self) -> int:
        return follow(self.runner, self.comm)


def _placement(world: int, cpus: float, gpus: float, strategy: str):
    """(placement group, first bundle index for ranks 1..N-1, whether it was made here)."""
    current = get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= world:
        return current, 1, False
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([bundle] * (world - 1), strategy=strategy)
    ray.get(pg.ready(), timeout=300)
    return pg, 0, True


def build_sharded_engine(path: str, parallel: ParallelConfig, config: EngineConfig = EngineConfig(),
                         tokenizer=None, *, epilogue: str = EXACT, combine: str = REDUCE,
                         cpus_per_rank: float = 1.0, gpus_per_rank: float = 0.0, strategy: str = "PACK",
                         threads_per_rank: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                         log=print) -> "LLMEngine | DPEngine":
    """An engine whose model runs over ``parallel.world`` ranks (this process is rank 0; Ray must be up).
    ``engine.runner.workers``: the other ranks' actors; ``engine.runner.close()`` stops them.

    ``threads_per_rank`` defaults to this process's torch thread count: every rank must compute the float
    parts (the router above all, which every rank runs on every token) with the same arithmetic, and a
    CPU GEMM's summation order depends on its thread count (measured: the router's weights then differ in
    the last bit between a 1-thread and a 2-thread rank)."""
    threads_per_rank = threads_per_rank or torch.get_num_threads()
    world = parallel.world
    pg, first, own_pg = _placement(world, cpus_per_rank, gpus_per_rank, strategy)
    host = ray.util.get_node_ip_address()
    init_method = f"tcp://{host}:{_free_port()}"
    log(f"sharded replica: {parallel.describe()}; rank 0 here, ranks 1..{world - 1} as Ray actors "
        f"({'in the caller' if not own_pg else 'in a new'} placement group, {strategy})")
    workers = [RankWorker.options(
        num_cpus=cpus_per_rank, num_gpus=gpus_per_rank,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + r - 1)
    ).remote(path, parallel.to_dict(), r, init_method, asdict(config), epilogue, combine, threads_per_rank,
             timeout_s) for r in range(1, world)]
    try:
        comm = Comm.init(parallel, 0, init_method, timeout_s=timeout_s)
        loaded = _load(path, comm, config, epilogue, combine)
        infos = ray.get([w.info.remote() for w in workers], timeout=timeout_s)
    except BaseException:
        for w in workers:
            ray.kill(w)
        if own_pg:
            remove_placement_group(pg)
        raise
    runs = [w.run.remote() for w in workers]

    def stop() -> None:
        try:
            ray.get(runs, timeout=10)
        except Exception:  # noqa: BLE001 - a rank that died or hangs is killed below
            pass
        for w in workers:
            ray.kill(w)
        if own_pg:
            remove_placement_group(pg)

    runner = make_runner(loaded, config, cls=DPRunner if parallel.dp > 1 else ShardedRunner, comm=comm,
                         on_close=stop)
    runner.workers, runner.runs, runner.rank_info = workers, runs, [
        {"rank": 0, "pid": os.getpid(), "resident_bytes": resident_bytes(loaded.model)}] + infos
    _log.info("sharded engine (%s) on %s: kernels %s", parallel.describe(), config.device, loaded.kernels.describe())
    if parallel.dp > 1:   # DP-attention: a scheduler and cache per dp group, stepped together
        return DPEngine([LLMEngine(loaded, config, tokenizer, runner=runner) for _ in range(parallel.dp)], runner)
    return LLMEngine(loaded, config, tokenizer, runner=runner)

