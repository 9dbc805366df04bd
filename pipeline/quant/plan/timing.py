"""Wall-time estimate of a planned job on a stated cluster (used for the README's 671B figure).

Actors are spread evenly, ``ceil(actors / nodes)`` per node, and share their node's bandwidths; the
stage actors share the GPUs evenly (``nodes * gpus_per_node / (stages * replicas)`` each). The phases
run one after the other and nothing inside a phase overlaps, so the total is an upper bound:

    read       the stored bytes each actor's calibration forward needs, per node / disk_read_gbps
    calibrate  GPipe schedule per replica: (M + stages - 1) steps of the slowest stage, M = the replica's
               micro-batches; a step = stage FLOPs of one micro-batch / (actor GPUs * gpu_tflops)
               + one hidden-state hand-off (seq_len * hidden * 2 bytes) / network_gbps
    reread     the weight phase reads again what no stage holds: with the resident memory model and no
               separate weight workers, a stage quantizes its own layers from its calibration weights
               and re-reads only the layers that were not in its forward (the globals, a FLOAT MTP layer);
               otherwise every layer is read again. Per node / disk_read_gbps
    quantize   dequantize + quantize: the float bytes each writer handles / (quantize_gbps * its GPUs, or
               quantize_gbps alone without GPUs)
    write      the output bytes per node / min(disk_write_gbps, network_gbps)

Without GPUs (``gpus_per_node`` 0) the compute rate is ``node_cpu_tflops`` per node, shared by its actors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from pipeline.quant.plan.types import Plan, PlanError

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    disk_read_gbps: float = 5.0       # GB/s per node, reading the source checkpoint
    network_gbps: float = 25.0        # GB/s per node (200 Gb/s)
    gpu_tflops: float = 400.0         # effective bf16 TFLOP/s per GPU (~40% of an H100's dense peak)
    disk_write_gbps: Optional[float] = None  # GB/s per node; default: disk_read_gbps
    quantize_gbps: float = 20.0       # float weight bytes quantized per second per GPU (host<->device bound)
    node_cpu_tflops: float = 1.0      # used only without GPUs

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 0:
            raise PlanError(f"cluster: nodes must be >= 1 and gpus_per_node >= 0, got {self.nodes}, {self.gpus_per_node}")
        for f in ("disk_read_gbps", "network_gbps", "gpu_tflops", "quantize_gbps", "node_cpu_tflops"):
            if not getattr(self, f) > 0:
                raise PlanError(f"cluster: {f} must be > 0, got {getattr(self, f)!r}")


@dataclass(frozen=True)
class WallTime:
    read_s: float
    calibrate_s: float
    reread_s: float
    quantize_s: float
    write_s: float

    @property
    def total_s(self) -> float:
        return self.read_s + self.calibrate_s + self.reread_s + self.quantize_s + self.write_s

    def to_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}

    def to_text(self) -> str:
        parts = ", ".join(f"{k[:-2]} {_dur(v)}" for k, v in asdict(self).items())
        return f"estimated wall time {_dur(self.total_s)} ({parts})"


def _dur(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def estimate_wall_time(plan: Plan, cluster: Cluster) -> WallTime:
    p, c = plan.params, cluster
    stage_actors = p.stages * p.replicas
    stage_per_node = math.ceil(stage_actors / c.nodes)
    if c.gpus_per_node:
        actor_flops = c.nodes * c.gpus_per_node / stage_actors * c.gpu_tflops * 1e12
        quant_rate = max(c.nodes * c.gpus_per_node / max(stage_actors, 1), 1e-9) * c.quantize_gbps * GB
    else:
        actor_flops = c.node_cpu_tflops * 1e12 / stage_per_node
        quant_rate = c.quantize_gbps * GB
    calib_read = max(sum(u.stored_bytes for u in plan.units if u.unit in s.units and u.forward)
                     for s in plan.stages)
    read_s = stage_per_node * calib_read / (c.disk_read_gbps * GB)

    micro = math.ceil(math.ceil(p.calib_tokens / p.seq_len) / p.replicas)
    step = max(s.flops_per_token for s in plan.stages) * p.seq_len / actor_flops
    step += p.seq_len * plan.hidden_bytes_per_token / (c.network_gbps * GB)
    calibrate_s = (micro + p.stages - 1) * step

    if plan.workers:
        writers = [(w.read_bytes, w.write_bytes) for w in plan.workers]
        floats = max(plan.total("float_bytes") * w.write_bytes / max(plan.total("output_bytes"), 1)
                     for w in plan.workers)
        w_per_node = math.ceil(len(plan.workers) / c.nodes)
    else:
        held = 2 if p.memory_model == "resident" else 1  # resident: the stage still holds its forward units
        writers = []
        for s in plan.stages:
            forward = sum(u.stored_bytes for u in plan.units if u.unit in s.units and u.forward)
            writers.append((max(0, s.read_bytes - held * forward), s.write_bytes))
        floats = max(s.float_bytes * s.write_bytes / max(s.output_bytes, 1) for s in plan.stages)
        w_per_node = stage_per_node
    reread_s = w_per_node * max(r for r, _ in writers) / (c.disk_read_gbps * GB)
    quantize_s = floats / quant_rate
    write_rate = min(c.disk_write_gbps or c.disk_read_gbps, c.network_gbps) * GB
    write_s = w_per_node * max(w for _, w in writers) / write_rate
    return WallTime(read_s=read_s, calibrate_s=calibrate_s, reread_s=reread_s, quantize_s=quantize_s,
                    write_s=write_s)
