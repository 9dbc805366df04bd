"""Print the distributed job's plan for a checkpoint, from its index and headers alone (no weight is read).

    python -m jobs.plan [--model-path SRC] [--stages N] [--replicas R] [--seq-len S] [--calib-samples K]
                        [--memory-model resident|streaming] [--cluster-memory-gib X [--nodes N]]
                        [--check-ray ADDRESS|auto] [--estimate NODESxGPUS] [--json]

With --cluster-memory-gib (N nodes sharing X GiB) or --check-ray (what Ray reports: available resources
and the alive nodes' totals) the plan is checked against those resources. Exit status: 0 the plan fits
(or was not checked), 2 refused (the message says what to change) or unreadable input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

from pipeline.config import ConfigError
from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.quant.plan.planner import plan
from pipeline.quant.plan.report import plan_to_dict, plan_to_text
from pipeline.quant.plan.resources import check_resources
from pipeline.quant.plan.types import DEFAULT_CALIB_SAMPLES, DEFAULT_SEQ_LEN, MEMORY_MODELS, GiB, PlanError
from pipeline.quant.plan.timing import Cluster, estimate_wall_time
from pipeline.format.description import DIALECTS
from pipeline.quant.recipe.recipe import Recipe
from pipeline.io.safetensors_io import CheckpointError

CHECK_OBJECT_STORE = 80 * 2**20   # bytes: a private Ray for --check-ray local stores nothing


def ray_resources(address: str) -> dict:
    """What Ray reports, in the shape Plan.check_resources reads: the cluster at ``address`` ('auto': the
    one this machine runs), or a private local Ray started here for the check ('local')."""
    import ray

    from actors.quantize.ray_session import cluster_resources
    from actors.cluster.ray_start import init_ray

    init_ray(address, num_cpus=os.cpu_count() or 1, object_store_memory=CHECK_OBJECT_STORE, flag="--check-ray",
             log=lambda m: print(m, file=sys.stderr), logging_level="ERROR", log_to_driver=False)
    try:
        return cluster_resources()
    finally:
        ray.shutdown()


def _cluster(spec: str, args) -> Cluster:
    try:
        nodes, gpus = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise PlanError(f"--estimate wants NODESxGPUS_PER_NODE such as 4x8, got {spec!r}") from None
    return Cluster(nodes=nodes, gpus_per_node=gpus, disk_read_gbps=args.disk_read_gbps,
                   network_gbps=args.network_gbps, gpu_tflops=args.gpu_tflops,
                   disk_write_gbps=args.disk_write_gbps, quantize_gbps=args.quantize_gbps)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jobs.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=EMBEDDED_MODEL_DIR, help="source checkpoint (default: the embedded model)")
    ap.add_argument("--stages", type=int, default=1,
                    help="pipeline stages the main layers are split into, 1..num_hidden_layers, as jobs.quantize "
                         "--stages (default: %(default)s)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="data-parallel copies of every stage (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help=f"tokens per calibration micro-batch (default: {DEFAULT_SEQ_LEN}, or the model's maximum)")
    ap.add_argument("--calib-samples", type=int, default=DEFAULT_CALIB_SAMPLES,
                    help="calibration samples (default: %(default)s)")
    ap.add_argument("--shard-gib", type=float, default=4.0, help="weight shard size limit, GiB (default: %(default)s)")
    ap.add_argument("--weight-workers", type=int, default=0,
                    help="separate weight-phase workers (0: the stage actors quantize their own layers)"
                         " (default: %(default)s)")
    ap.add_argument("--memory-model", choices=MEMORY_MODELS, default="resident",
                    help="resident: a stage holds all its layers dequantized; streaming: one unit at a time"
                         " (default: %(default)s)")
    ap.add_argument("--bytes-weight", type=float, default=0.5,
                    help="weight of bytes against FLOPs when balancing the stages (default: %(default)s)")
    ap.add_argument("--cpus-per-actor", type=float, default=1.0,
                    help="CPUs each stage actor asks Ray for (default: %(default)s)")
    ap.add_argument("--gpus-per-actor", type=float, default=0.0,
                    help="GPUs each stage actor asks Ray for (default: %(default)s)")
    ap.add_argument("--dialect", choices=DIALECTS, default="seed",
                    help="output format dialect (as jobs.quantize) (default: %(default)s)")
    ap.add_argument("--quantize-mtp", action="store_true", help="plan for quantizing the MTP layer too (default: off)")
    ap.add_argument("--cluster-memory-gib", type=float, default=None,
                    help="check against this much memory (default: no check)")
    ap.add_argument("--nodes", type=int, default=1,
                    help="with --cluster-memory-gib: split over this many nodes (default: %(default)s)")
    ap.add_argument("--gpu-memory-gib", type=float, default=None,
                    help="memory per GPU, for the check (default: unchecked)")
    ap.add_argument("--check-ray", metavar="ADDRESS", default=None,
                    help="check against a Ray cluster: its address, 'auto' (the one this machine runs), or "
                         "'local' (a private one started here for the check) (default: no check)")
    ap.add_argument("--estimate", metavar="NODESxGPUS", default=None,
                    help="estimate the wall time on such a cluster, e.g. 4x8 (default: no estimate)")
    ap.add_argument("--disk-read-gbps", type=float, default=5.0,
                    help="for --estimate: GB/s read per node (default: %(default)s)")
    ap.add_argument("--disk-write-gbps", type=float, default=None,
                    help="for --estimate: GB/s written per node (default: --disk-read-gbps)")
    ap.add_argument("--network-gbps", type=float, default=25.0,
                    help="for --estimate: GB/s of network per node (default: %(default)s)")
    ap.add_argument("--gpu-tflops", type=float, default=400.0,
                    help="for --estimate: effective TFLOP/s per GPU (default: %(default)s)")
    ap.add_argument("--quantize-gbps", type=float, default=20.0,
                    help="for --estimate: float weight GB/s quantized per GPU (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON instead of text (default: off)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    out: dict[str, Any] = {}
    try:
        from pipeline.io.checkpoint import CheckpointReader
        from pipeline.io.storage import check_reachable

        check_reachable(args.model_path)        # a mute object store: seconds, not minutes
        reader = CheckpointReader(args.model_path)
        layers = reader.config.num_hidden_layers
        if not 1 <= args.stages <= layers:  # as jobs.quantize --stages: the main layers are what stages split
            raise PlanError(f"stages must be 1..{layers} (the model's main layers), got {args.stages}")
        seq_len = args.seq_len or min(DEFAULT_SEQ_LEN, reader.config.max_position_embeddings)
        recipe = Recipe(dialect=args.dialect, quantize_mtp=args.quantize_mtp)
        p = plan(reader, args.stages, args.replicas, recipe, calib_tokens=args.calib_samples * seq_len,
                 seq_len=seq_len, shard_bytes=int(args.shard_gib * GiB), weight_workers=args.weight_workers,
                 memory_model=args.memory_model, bytes_weight=args.bytes_weight,
                 cpus_per_actor=args.cpus_per_actor, gpus_per_actor=args.gpus_per_actor)
        out["plan"] = plan_to_dict(p)
        wall = estimate_wall_time(p, _cluster(args.estimate, args)) if args.estimate else None
        if wall is not None:
            out["wall_time"] = wall.to_dict()
        print(json.dumps(out, indent=1) if args.json else plan_to_text(p) + (f"\n{wall.to_text()}" if wall else ""))
        available = None
        if args.check_ray:
            from actors.cluster.ray_start import NoCluster

            try:
                available = ray_resources(args.check_ray)
            except NoCluster as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        elif args.cluster_memory_gib is not None:
            per = args.cluster_memory_gib * GiB / max(args.nodes, 1)
            available = {"memory": args.cluster_memory_gib * GiB,
                         "nodes": [{"name": f"node{i}", "memory": per} for i in range(max(args.nodes, 1))]}
        if available is not None:
            if args.gpu_memory_gib is not None:
                available["gpu_memory"] = args.gpu_memory_gib * GiB
            check_resources(p, available)
            if not args.json:
                print(f"fits: every actor's estimated peak fits the cluster ({p.n_actors} actors)")
    except PlanError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
