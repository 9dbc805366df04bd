"""An engine replica's engine, for the engine and prefill deployments: one process, or sharded over the
ranks its ``parallel`` config names (this replica rank 0, the others Ray actors in its placement group).
``model_path`` may be a quantized directory or a float checkpoint (pipeline.engine.worker.loader.load_model); a
float checkpoint is served by one process only (the shard loader reads quantized directories)."""

from __future__ import annotations

from actors.serving.serve_config import ServeConfig


def make_engine(config: ServeConfig, deployment: str, tok):
    """The engine of one replica of ``deployment`` ("llm" or "prefill"): in this process, or sharded over
    ``config.parallel_of(deployment).world`` ranks (this replica is rank 0; the others Ray actors in the
    replica's placement group, actors.serving.engine.rank_group); each step delayed by ``config.step_delay_s`` (tests)."""
    engine = _make_engine(config, deployment, tok)
    if config.step_delay_s > 0:
        engine.step = _delayed(engine.step, config.step_delay_s)
    return engine


def _delayed(step, delay_s: float):
    import time

    def delayed_step():
        time.sleep(delay_s)
        return step()

    return delayed_step


def _make_engine(config: ServeConfig, deployment: str, tok):
    from pipeline.engine.core.engine import LLMEngine
    from pipeline.engine.worker.loader import FLOAT_CHECKPOINT, dir_kind, load_model

    parallel = config.parallel_of(deployment)
    if parallel.single:
        engine = LLMEngine(load_model(config.model_path, dtype=config.dtype, device=config.engine.device,
                                      with_mtp=config.engine.mtp), config.engine, tok)   # no MTP: not loaded
        engine.warm_up()                # the first full step's one-time costs, before the first request
        return engine
    if dir_kind(config.model_path) == FLOAT_CHECKPOINT:
        raise ValueError(f"{config.model_path}: a float checkpoint is served by one process only; the sharded "
                         f"engine ({parallel.describe()}) loads quantized directories (pipeline.engine.sharding.shard_loader)")
    from actors.serving.engine.rank_group import build_sharded_engine

    opts = getattr(config, deployment).ray_actor_options
    engine = build_sharded_engine(config.model_path, parallel, config.engine, tok, combine=config.moe_combine,
                                  cpus_per_rank=float(opts.get("num_cpus", 1) or 0),
                                  gpus_per_rank=float(opts.get("num_gpus", 0) or 0),
                                  threads_per_rank=config.torch_threads)
    engine.warm_up()        # every rank runs rank 0's warm-up step (its runner broadcasts it); dp groups together
    return engine


def placement(config: ServeConfig, deployment: str) -> dict:
    """Serve options that give a sharded replica one bundle per rank (its own actor in the first)."""
    world = config.parallel_of(deployment).world
    if world == 1:
        return {}
    opts = getattr(config, deployment).ray_actor_options
    bundle = {"CPU": float(opts.get("num_cpus", 1) or 0)}
    if opts.get("num_gpus"):
        bundle["GPU"] = float(opts["num_gpus"])
    return {"placement_group_bundles": [bundle] * world, "placement_group_strategy": "PACK"}
