"""The up-front estimate a quantize job prints before its heavy work: what it will read, compute and
write, and roughly how long on this machine.

What: the planner's cost model (:func:`pipeline.quant.job.costs.unit_costs`, from the headers alone): every
unit's stored bytes (read), float bytes (dequantized and quantized), output bytes (written) and forward
FLOPs per calibration token (at the samples' mean length). How fast: a probe of about a second on this
machine (:func:`probe`): a timed read of the source (its largest file, up to ``PROBE_READ`` bytes), a
timed write of ``PROBE_WRITE`` bytes, flushed to the disk, in a hidden temporary file beside a local
destination (removed at once; the read rate stands in for an object store's), the per-channel int8
quantizer on a model-width bf16 matrix, and a bf16 matmul at the model's widths over one mean-length
sample on the job's device. Then:

    calibration   read: every stored byte once (the float model, or each stage's layers)
                  compute: FLOPs per token x calibration tokens (x 2 with smoothing: two passes)
                           / (matmul rate x FORWARD_EFFICIENCY)
    weights       max(read + write, quantize): the weight phase reads the next layer and writes on their
                  own threads while it quantizes (pipeline.quant.job.run); the disk does one after the other
    one read      (``single_read``: the single-process job's layer-wise calibration, pipeline.quant.calibration.layerwise)
                  every stored byte read once, for both: calibration_read_s = 0, and
                  total = max(write, compute + read + dequantize + quantize): one layer at a time on the
                  job's thread (the page cache reads the next one ahead, so no second layer is held; an
                  FP8 source dequantized at the probe's rate; 2.5 bytes of memory new to the process
                  per float byte, at the probe's first-touch rate), the writer's thread writing meanwhile,
                  so weights_s = total - compute
    distributed   compute and quantize shared by the stage actors (an ideal overlap, so a lower bound of
                  those parts), the I/O not (one source, one destination), plus RAY_START_S

A data-free recipe has no calibration line. The figures are rough (the page cache, other load, a disk
whose rate drifts): the job's summary has the measured ones beside them (``estimate``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from pipeline.io import storage
from pipeline.config import model_dtype
from pipeline.io.checkpoint import CheckpointReader
from pipeline.io.safetensors_io import CheckpointError, itemsize
from pipeline.quant.job.costs import LayerCost, unit_costs
from pipeline.quant.numerics.products import AUTO, calibration_products
from pipeline.quant.transforms.recipe_plan import resolve

GB = 1e9
PROBE_READ = 64 * 2**20       # bytes of the source read by the probe
PROBE_WRITE = 32 * 2**20      # bytes written (and fsync'd) by the probe beside a local destination
FORWARD_EFFICIENCY = 0.25     # the calibration forward's rate over the probe's matmul rate (eager
                              # attention, observers, one sample at a time); measured, see the README
RAY_START_S = 10.0            # a private Ray and its actors, measured on a 2-CPU machine
FIXED_PEAK_BYTES = 10**9      # the layer-wise job's memory beside its layer and samples (layerwise_peak)
PROBE_FRESH = 64 * 2**20      # bytes first touched by the probe
FRESH_PER_FLOAT_BYTE = 2.5    # the one-read job's new memory per float byte: the weights, their fake-quantized
                              # copy, the int8 output


@dataclass(frozen=True)
class Probe:
    read_gbps: float          # GB/s reading the source
    write_gbps: float         # GB/s writing to the destination's disk (flushed)
    quantize_gbps: float      # bf16 bytes/s through the per-channel int8 quantizer
    matmul_tflops: float      # bf16 matmul on the job's device
    seconds: float            # what the probe took
    dequant_gbps: float = 0.0 # bf16 bytes/s out of FP8 blocks (BlockRows.materialize); 0: not probed
    fresh_gbps: float = 0.0   # bytes/s of memory new to the process, first touched (page faults); 0: not probed


def _timed(fn, min_s: float = 0.05, max_reps: int = 20) -> float:
    """Seconds per call of ``fn`` (repeated until ``min_s`` has passed; the first call, a warm-up, not counted)."""
    fn()
    reps, t = 0, time.perf_counter()
    while reps < max_reps and (reps == 0 or time.perf_counter() - t < min_s):
        fn()
        reps += 1
    return (time.perf_counter() - t) / reps


def _write_rate(dst: Optional[str], fallback: float) -> float:
    """GB/s of a flushed write of PROBE_WRITE bytes in a hidden temporary file in ``dst`` (or the nearest
    existing directory above it); ``fallback`` for an object store or no ``dst``."""
    import os
    import tempfile

    if not dst or storage.is_url(dst):
        return fallback
    d = os.path.abspath(dst)
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    block = os.urandom(2**20)
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".dsquant-probe-") as f:
            t = time.perf_counter()
            for _ in range(PROBE_WRITE // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
            return PROBE_WRITE / max(time.perf_counter() - t, 1e-6) / GB
    except OSError:
        return fallback


def probe(reader: CheckpointReader, device: str = "cpu", tokens: int = 256, dst: Optional[str] = None,
          products: str = AUTO) -> Probe:
    """Measure this machine's rates for the estimate (module doc); ``tokens``: one sample's length;
    ``dst``: the job's destination (where the write is probed)."""
    from pipeline.quant.numerics.qparams import quantize_weight_per_channel

    t0 = time.perf_counter()
    cfg = reader.config
    largest = max(reader.files, key=storage.size)
    n = min(PROBE_READ, storage.size(largest))
    t = time.perf_counter()
    got = 0
    with storage.open_read(largest) as f:
        while got < n:
            chunk = f.read(min(8 * 2**20, n - got))
            if not chunk:
                break
            got += len(chunk)
    read_gbps = got / max(time.perf_counter() - t, 1e-6) / GB
    write_gbps = _write_rate(dst, read_gbps)

    h = cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    w = torch.randn(max(1, (16 * 2**20) // (2 * h)), h, generator=g).to(torch.bfloat16)
    quantize_gbps = w.numel() * 2 / _timed(lambda: quantize_weight_per_channel(w)) / GB

    inner = cfg.moe_intermediate_size if cfg.n_routed_experts else cfg.intermediate_size
    a = torch.randn(max(1, tokens), h, generator=g).to(torch.bfloat16).to(device)
    b = torch.randn(inner, h, generator=g).to(torch.bfloat16).to(device)

    def mm():
        with calibration_products(products):   # as the calibration forward multiplies (a linear)
            F.linear(a, b)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    tflops = 2 * a.shape[0] * h * inner / _timed(mm) / 1e12
    from pipeline.io.fp8 import BlockRows

    fp8 = torch.randn(inner, h, generator=g).to(torch.float8_e4m3fn)
    rows = BlockRows(fp8, torch.ones(math.ceil(inner / 128), math.ceil(h / 128)), name="probe")
    dequant_gbps = fp8.numel() * 2 / _timed(rows.materialize) / GB
    t = time.perf_counter()
    torch.empty(PROBE_FRESH, dtype=torch.uint8).fill_(1)     # above glibc's mmap threshold: new pages
    fresh_gbps = PROBE_FRESH / max(time.perf_counter() - t, 1e-6) / GB
    return Probe(round(read_gbps, 3), round(write_gbps, 3), round(quantize_gbps, 3), round(tflops, 4),
                 round(time.perf_counter() - t0, 3), round(dequant_gbps, 3), round(fresh_gbps, 3))


@dataclass(frozen=True)
class Estimate:
    read_bytes: int           # source bytes read, both phases (once with single_read)
    float_bytes: int          # bytes through dequantize/quantize
    write_bytes: int          # output tensor bytes
    calib_samples: int
    calib_tokens: int
    calib_flops: float        # all passes
    calibration_read_s: float
    calibration_compute_s: float
    weights_s: float
    ray_s: float
    actors: int               # 0: the single-process job
    probe: Probe
    single_read: bool = False # layer-wise calibration: one read feeds calibration and weights
    peak_bytes: int = 0       # memory of the layer-wise job (:func:`layerwise_peak`; 0: not estimated)
    peak_layer: str = ""      # the unit that sets it

    @property
    def total_s(self) -> float:
        return self.calibration_read_s + self.calibration_compute_s + self.weights_s + self.ray_s

    def to_dict(self) -> dict:
        return {**asdict(self), "total_s": round(self.total_s, 1)}

    def to_text(self) -> list[str]:
        p = self.probe
        where = f"{self.actors} stage actors" if self.actors else "one process"
        lines = [f"estimate ({where}; probe {p.seconds:.1f}s: read {p.read_gbps:.3g} GB/s, write "
                 f"{p.write_gbps:.3g} GB/s, dequantize FP8 {p.dequant_gbps:.3g} GB/s, quantize "
                 f"{p.quantize_gbps:.3g} GB/s, bf16 matmul {p.matmul_tflops * 1e3:.3g} GFLOP/s):"]
        if self.single_read:
            lines.append(f"  calibration: layer by layer from the one read, {self.calib_samples} samples "
                         f"({self.calib_tokens} tokens, {self.calib_flops / 1e12:.3g} TFLOP): "
                         f"~{_dur(self.calibration_compute_s)} of compute")
            lines.append(f"  weights: read {_bytes(self.read_bytes)} (once, for the calibration too), quantize "
                         f"{_bytes(self.float_bytes)}, write {_bytes(self.write_bytes)}: ~{_dur(self.weights_s)} more")
        else:
            if self.calib_samples:
                lines.append(f"  calibration: read {_bytes(self.read_bytes / 2)}, {self.calib_samples} samples "
                             f"({self.calib_tokens} tokens, {self.calib_flops / 1e12:.3g} TFLOP): "
                             f"~{_dur(self.calibration_read_s + self.calibration_compute_s)}")
            else:
                lines.append("  calibration: none (data-free recipe)")
            read = self.read_bytes / (2 if self.calib_samples else 1)
            lines.append(f"  weights: read {_bytes(read)}, quantize {_bytes(self.float_bytes)}, "
                         f"write {_bytes(self.write_bytes)}: ~{_dur(self.weights_s)}")
        lines.append(f"  total: ~{_dur(self.total_s)}" + (f" (Ray start-up ~{_dur(self.ray_s)} included)"
                                                          if self.ray_s else ""))
        if self.peak_bytes:
            lines.append(f"  memory: peak ~{self.peak_bytes / GB:.2f} GB (layer {self.peak_layer}: its weights in the "
                         "model dtype, their fake-quantized copy for the calibration passes, the samples' "
                         "activations; docs/performance.md)")
        return lines


def _bytes(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def _dur(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def estimate_job(reader: CheckpointReader, recipe, samples: Sequence[Sequence[int]], pr: Probe,
                 actors: int = 0, single_read: bool = False) -> Estimate:
    """The estimate of the module doc; ``samples`` empty for a data-free recipe; ``actors``: the
    distributed job's stage actors (0: single process); ``single_read``: the layer-wise single-process
    job (one read; only with samples and no actors)."""
    tokens = sum(len(s) for s in samples)
    mean_len = max(1, round(tokens / len(samples))) if samples else 1
    units, outputs = unit_costs(reader, recipe, min(mean_len, reader.config.max_position_embeddings))
    stored = sum(u.stored_bytes for u in units)
    floats = sum(u.float_bytes for u in units)
    written = sum(u.output_bytes for u in units)
    passes = resolve(recipe, reader.config).calibration_forwards
    flops = sum(u.flops_per_token for u in units) * tokens * passes
    share = max(1, actors)
    read_rate = max(pr.read_gbps, 1e-3) * GB
    write_rate = max(pr.write_gbps, 1e-3) * GB
    calib_read_s = stored / read_rate if samples else 0.0
    calib_s = flops / (max(pr.matmul_tflops, 1e-6) * 1e12 * FORWARD_EFFICIENCY) / share if samples else 0.0
    io_s = stored / read_rate + written / write_rate
    quant_s = floats / (max(pr.quantize_gbps, 1e-3) * GB) / share
    weights_s = max(io_s, quant_s)
    single_read = bool(single_read and samples and not actors)
    peak, peak_unit = 0, ""
    if single_read:
        # one layer at a time on the job's thread: read (the page cache reads the next one ahead), an FP8
        # source dequantized, calibrated, quantized; the writer's thread writes meanwhile
        md = torch.finfo(model_dtype(reader.config)).bits // 8
        stored_as = (reader.header(n) for n in reader.tensor_names())
        fp8 = sum(math.prod(shape) * md for dt, shape in stored_as if dt == "F8_E4M3")
        dequant_s = fp8 / (pr.dequant_gbps * GB) if pr.dequant_gbps else 0.0
        # each layer's memory is new to the process (the heap is handed back between layers): its float
        # weights, their fake-quantized copy and the int8 output, first touched
        fresh_s = FRESH_PER_FLOAT_BYTE * floats / (pr.fresh_gbps * GB) if pr.fresh_gbps else 0.0
        calib_read_s = 0.0
        weights_s = max(written / write_rate,
                        calib_s + stored / read_rate + dequant_s + quant_s + fresh_s) - calib_s
        peak, peak_unit = layerwise_peak(reader, recipe, units, outputs, tokens)
    return Estimate(read_bytes=stored * (2 if samples and not single_read else 1), float_bytes=floats,
                    write_bytes=written, calib_samples=len(samples), calib_tokens=tokens, calib_flops=flops,
                    calibration_read_s=round(calib_read_s, 2), calibration_compute_s=round(calib_s, 2),
                    weights_s=round(weights_s, 2), ray_s=RAY_START_S if actors else 0.0, actors=actors, probe=pr,
                    single_read=single_read, peak_bytes=peak, peak_layer=peak_unit)


def layerwise_peak(reader: CheckpointReader, recipe, units: Sequence[LayerCost],
                   outputs: Mapping[str, Sequence[tuple[str, int]]], tokens: int) -> tuple[int, str]:
    """(peak bytes, the unit that sets it) of the single-process layer-wise job (docs/performance.md, "The
    quantize job at real width"). One layer is held at a time (the next one is read ahead by the page cache;
    from object storage a thread reads it: one more layer), and within it, at most:

        its weights in the model dtype                       float_bytes
        + what the recipe's steps rewrite, beside the originals  (all of them when it rotates)
        + its quantized weights fake-quantized in md          2 x their int8 bytes, for the passes after
        + one sample's working set                            act_bytes
      + every sample's hidden states, in and out            2 x tokens x hidden x md (x2 with ``smooth``)
      + FIXED_PEAK_BYTES                                     the interpreter, torch, the globals' residue
    """
    cfg = reader.config
    plan = resolve(recipe, cfg)
    md = torch.finfo(model_dtype(cfg)).bits // 8
    streams = plan.calibration_forwards    # the smoothing pass keeps a stream of its own
    hidden = 2 * tokens * cfg.hidden_size * md * streams
    local = all(not storage.is_url(f) for f in reader.files)
    best, where = 0, ""
    layers = [u for u in units if u.layer_id is not None]
    for k, u in enumerate(layers):
        outs = dict(outputs[u.unit])
        fake = sum(md * b for n, b in outs.items() if n.endswith(".weight") and n + "_scale" in outs)
        rewritten = plan.rewritten(u.layer_id)
        steps = u.float_bytes if rewritten is None else sum(_float_bytes(reader, n, md) for n in rewritten)
        nxt = 0 if local or k + 1 == len(layers) else layers[k + 1].float_bytes
        need = u.float_bytes + steps + fake + u.act_bytes + nxt
        if need > best:
            best, where = need, u.unit
    return int(best + hidden + FIXED_PEAK_BYTES), where


def _float_bytes(reader: CheckpointReader, name: str, md: int) -> int:
    """Bytes of a stored tensor once read in the model dtype (FP8 dequantized); 0 if the source lacks it."""
    try:
        dt, shape = reader.header(name)
    except CheckpointError:
        return 0
    return math.prod(shape) * (md if dt == "F8_E4M3" else itemsize(dt))


def job_estimate(reader: CheckpointReader, recipe, samples: Sequence[Sequence[int]], device: Optional[str],
                 actors: int = 0, dst: Optional[str] = None, single_read: bool = False) -> Estimate:
    """Probe this machine, then estimate (what the jobs call)."""
    mean_len = math.ceil(sum(len(s) for s in samples) / len(samples)) if samples else 256
    pr = probe(reader, device or "cpu", mean_len, dst, recipe.products)
    return estimate_job(reader, recipe, samples, pr, actors, single_read)


def announce(reader: CheckpointReader, recipe, samples: Sequence[Sequence[int]], device: Optional[str],
             log, actors: int = 0, dst: Optional[str] = None, single_read: bool = False) -> Optional[Estimate]:
    """:func:`job_estimate`, its lines logged; a failure to estimate is one log line, never the job's."""
    try:
        est = job_estimate(reader, recipe, samples, device, actors, dst, single_read)
    except Exception as e:  # noqa: BLE001 - the estimate is advice; the job's own checks have run
        log(f"estimate: unavailable ({type(e).__name__}: {e})")
        return None
    for line in est.to_text():
        log(line)
    return est
