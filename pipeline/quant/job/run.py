"""Single-process quantization of a checkpoint: calibrate, optionally smooth, quantize layer by layer, write.

By default (``QuantizeOptions.layerwise``) the checkpoint is read ONCE: layer-wise calibration
(:mod:`pipeline.quant.calibration.layerwise`) reads layer i, runs every sample's hidden state through it with its
observers, quantizes layer i from the same tensors and streams it into the writer, with layer i+1 read on
a thread meanwhile. Byte-identical to the reference below (tested), in about one layer plus one layer
boundary of activations of memory.

The reference (``layerwise=False``, ``jobs.quantize --two-pass``) runs two phases:

1. calibration: the float model (model dtype, as msModelSlim runs it) over each calibration sample
   (batch of one); with dsquant's ``smooth`` first the smoothing statistics and their fold into the model,
   then the W8A8/FA3 statistics of the smoothed model;
2. weights (:func:`quantize_weights`): one layer at a time from the source, the same smoothing fold
   applied to its tensors (bit-identical to phase 1's), quantized module by module (FP8 weights straight
   from their codes, never dequantized whole) and streamed into the writer, which knows every output
   tensor ahead (:func:`output_specs`) and writes (and hashes) each piece on its own thread while the next
   is computed. The next layer is read in a background thread meanwhile (``QuantizeOptions.prefetch``):
   peak memory is about two layers as stored (the one being quantized and the next) plus a piece or two
   of int8 output.

A data-free recipe (nothing reads a statistic) runs phase 2 alone. The summary's ``bytes_read`` counts
the source's stored tensor bytes the job read (one read per unit per phase, from the headers) and
``rchar`` the process's read bytes measured by the kernel (``/proc/self/io``; every file, None off Linux).
The distributed pipeline runs the same two phases per layer range and must produce identical files.
"""

from __future__ import annotations

import time
from contextlib import closing
from typing import Callable, Optional

import torch

from pipeline import layout
from pipeline.quant.numerics import native
from pipeline.io.destination.lock import DestinationLock
from pipeline.io.checkpoint import CheckpointReader
from pipeline.model.loading import load_model
from pipeline.quant.calibration.calibrate import collect_stats
from pipeline.quant.numerics.products import resolved
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.job.options import SHARD_BYTES, QuantizeOptions, calibration_samples  # noqa: F401 (re-exported)
from pipeline.quant.job.estimate import announce
from pipeline.quant.job.preflight import check_job, data_free_notes
from pipeline.quant.calibration.progress import weights_bar
from pipeline.config import model_dtype
from pipeline.quant.writing.quantize_layer import quantize_globals, quantize_layer_pieces
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.writing.shard_layout import output_units
from pipeline.quant.transforms.recipe_plan import resolve
from pipeline.quant.transforms.smooth import ChannelAbsMax
from pipeline.quant.writing.unit_writer import read_layer
from pipeline.quant.calibration.layer_reads import prefetched, unit_bytes
from pipeline.quant.calibration.layerwise import calibrate_layerwise
from pipeline.quant.writing.writer import QuantizedWriter
from pipeline.io.safetensors_io import TensorSpec

LayerHook = Callable[[int, dict], None]     # (layer id, its float tensors as quantized): quantize_checkpoint's on_layer


def prepare_float_model(src: str, recipe: Recipe, samples: list[list[int]], opts: QuantizeOptions):
    """The float model in the model dtype, smoothed when the recipe says so (its plan's ``smoothing``).
    Returns (model, smoothing statistics or None)."""
    reader_cfg = CheckpointReader(src).config
    model = load_model(src, dtype=model_dtype(reader_cfg), device=opts.device or "cpu", with_mtp=not recipe.drop_mtp)
    smooth_stats = resolve(recipe, reader_cfg).smoothing.fold_into(model, samples, opts.smooth_alpha,
                                                                   recipe.calib_products)
    return model, smooth_stats


def calibrate(src: str, recipe: Recipe, opts: QuantizeOptions, samples: Optional[list[list[int]]] = None
              ) -> tuple[Stats, Optional[dict[str, ChannelAbsMax]]]:
    """Phase 1: (W8A8/FA3 statistics, smoothing statistics or None). ``samples``: the calibration
    samples when already tokenized (default: read and tokenized here)."""
    if samples is None:
        samples = calibration_samples(src, opts, CheckpointReader(src).config.max_position_embeddings)
    model, smooth_stats = prepare_float_model(src, recipe, samples, opts)
    with torch.inference_mode():
        stats = collect_stats(model, samples, recipe, progress=opts.progress)  # a bar in tokens/s
    return stats, smooth_stats


def quantize_checkpoint(src: str, dst: str, recipe: Recipe, opts: QuantizeOptions = QuantizeOptions(),
                        log: Callable[[str], None] = print, on_layer: Optional[LayerHook] = None,
                        lock: Optional[DestinationLock] = None) -> dict:
    """Quantize ``src`` into ``dst`` (any fsspec locations); returns the job summary (also in the
    manifest). Every input is checked first (:func:`pipeline.quant.job.preflight.check_job`); nothing in
    ``dst`` looks complete until the very end, and an earlier output there (``opts.overwrite``) stays
    whole until the new shards are all written. The job holds ``dst``'s lock (:mod:`pipeline.io.destination.lock`)
    from the end of the checks to the end: a second job on the same destination stops with
    :class:`~pipeline.io.destination.lock.DestinationBusy` and writes nothing. ``on_layer(layer_id, tensors)``, when
    given, sees each layer's float tensors as they are quantized (smoothed and rotated as the recipe has
    them; FP8 weights still as BlockRows). ``lock``: ``dst``'s lock, already held by the caller (a job
    that writes more than this output beside it)."""
    t0 = time.time()
    rchar0 = _rchar()
    job = check_job(src, dst, recipe, opts)
    if lock is not None:
        lock.ensure()
        return _quantize_checked(src, dst, recipe, opts, log, job, lock, t0, rchar0, on_layer)
    with DestinationLock(dst) as lock:  # one job per destination: a second one stops here, naming this one
        return _quantize_checked(src, dst, recipe, opts, log, job, lock, t0, rchar0, on_layer)


def _quantize_checked(src: str, dst: str, recipe: Recipe, opts: QuantizeOptions, log: Callable[[str], None],
                      job, lock: DestinationLock, t0: float, rchar0: Optional[int],
                      on_layer: Optional[LayerHook] = None) -> dict:
    reader, cfg, md = job.reader, job.reader.config, job.model_dtype
    layerwise = job.needs_calibration and opts.layerwise
    est = announce(reader, recipe, job.samples, opts.device, log, dst=dst, single_read=layerwise) \
        if opts.estimate else None
    source_bytes = sum(unit_bytes(reader).values())
    summary = {"source": src, "recipe": recipe.to_dict()}
    if job.needs_calibration:
        summary["calib_products"] = resolved(recipe.products, md, opts.device or "cpu")
        log(f"calibration products: {summary['calib_products']}")
    if layerwise:
        log(f"calibrating {src} layer by layer, one read ({cfg.num_hidden_layers} layers + "
            f"{len(cfg.mtp_layer_ids)} MTP, {md}, {opts.calib_batch} sample(s) per forward)")
        stats, smooth_stats = Stats(), None  # computed layer by layer (quantize_layerwise)
    elif job.needs_calibration:
        log(f"calibrating {src} ({cfg.num_hidden_layers} layers + {len(cfg.mtp_layer_ids)} MTP, {md})")
        stats, smooth_stats = calibrate(src, recipe, opts, job.samples)
    else:
        for line in data_free_notes(src):
            log(line)
        stats, smooth_stats = Stats(), None
    t1 = time.time()
    summary.update({"calibration_s": round(t1 - t0, 3), "weight_kernel": native.status(),
                    **({"estimate": est.to_dict()} if est else {})})
    with QuantizedWriter(dst, recipe.dialect, model_dtype=md, shard_bytes=opts.shard_bytes,
                         overwrite=opts.overwrite, src=src, guard=lock.ensure) as writer:
        if layerwise:
            res = quantize_layerwise(reader, writer, recipe, job.samples, opts, on_layer)
            summary["calibration_s"] = round(t1 - t0 + res["calibration_s"], 3)
            summary["quantize_write_s"] = round(time.time() - t1 - res["calibration_s"], 3)
            summary["bytes_read"] = res["bytes_read"]
        else:
            quantize_weights(reader, writer, stats, recipe, smooth_stats, opts.smooth_alpha, prefetch=opts.prefetch,
                             progress=opts.progress, on_layer=on_layer)
            summary["quantize_write_s"] = round(time.time() - t1, 3)
            summary["bytes_read"] = source_bytes * (2 if job.needs_calibration else 1)  # the float model, then phase 2
        r = _rchar()
        summary["rchar"] = r - rchar0 if r is not None and rchar0 is not None else None
        files, optional = job.plan.files()
        writer.finish(job.raw_config, src_dir=src, mindie_format=opts.mindie_format, job=summary,
                      extra={**recipe_files(opts), **files}, optional=optional)
    summary["total_s"] = round(time.time() - t0, 3)
    calib = f"calibration {summary['calibration_s']:.1f}s" if job.needs_calibration else "no calibration"
    log(f"wrote {dst} in {summary['total_s']:.1f}s ({calib}; read {summary['bytes_read'] / 1e9:.3g} GB of the "
        f"source; weights with {summary['weight_kernel'].split(' (')[0]})")
    return summary


def recipe_files(opts: QuantizeOptions) -> dict[str, bytes]:
    """The recipe file written next to the weights, when the job has one, and ``opts.extra_files``."""
    out = {opts.recipe_file[0]: opts.recipe_file[1].encode("utf-8")} if opts.recipe_file else {}
    return {**out, **dict(opts.extra_files)}


def _rchar() -> Optional[int]:
    """This process's bytes read through read() and the like so far (/proc/self/io ``rchar``), or None."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def quantize_layerwise(reader: CheckpointReader, writer: QuantizedWriter, recipe: Recipe,
                       samples: list[list[int]], opts: QuantizeOptions, on_layer: Optional[LayerHook] = None) -> dict:
    """The one-read job into an open ``writer`` (not finished here): the globals, then each layer read,
    calibrated and quantized (:func:`pipeline.quant.calibration.layerwise.calibrate_layerwise`). Returns its
    {"calibration_s", "bytes_read"}."""
    cfg = reader.config
    units = output_units(reader, recipe)
    writer.plan([specs for _, specs in units])
    bar = weights_bar(opts.progress, sum(s.nbytes for _, specs in units for s in specs), len(units),
                      desc="calibrate + quantize")
    spec_of = {unit_layer_id: specs for unit_layer_id, specs in zip([None, *layout.all_layer_ids(cfg)],
                                                                    [specs for _, specs in units])}
    done = [0]

    def write_globals(tensors: dict) -> None:
        writer.add(*quantize_globals(cfg, tensors, recipe))
        done[0] += 1
        _advance(bar, spec_of[None], done[0], len(units))

    def quantize(i: int, tensors: dict, stats: Stats) -> None:
        if on_layer is not None:
            on_layer(i, tensors)
        # quantize_layer_pieces looked up here at each call (tests replace it to inject a failure)
        for piece in quantize_layer_pieces(cfg, i, tensors, stats, recipe):
            writer.add(*piece)
        done[0] += 1
        _advance(bar, spec_of[i], done[0], len(units))

    try:
        return calibrate_layerwise(reader, recipe, samples, write_globals=write_globals, quantize=quantize,
                                   smooth_alpha=opts.smooth_alpha, device=opts.device or "cpu",
                                   prefetch=opts.prefetch, batch=opts.calib_batch)
    finally:
        bar.close()


def output_specs(reader: CheckpointReader, recipe: Recipe) -> list[TensorSpec]:
    """Every tensor :func:`quantize_weights` writes, in order, from the source's headers alone."""
    return [s for _, specs in output_units(reader, recipe) for s in specs]


def quantize_weights(reader: CheckpointReader, writer: QuantizedWriter, stats: Stats, recipe: Recipe,
                     smooth_stats: Optional[dict[str, ChannelAbsMax]] = None, smooth_alpha: float = 0.5, *,
                     prefetch: bool = True, progress: bool = False, on_layer: Optional[LayerHook] = None) -> None:
    """Phase 2 into an open ``writer`` (not finished here): the globals, then each layer read,
    smoothed when ``smooth_stats`` is given, quantized and written. The writer is given every output
    tensor first, so it writes each one as it comes. With ``prefetch``, layer i+1 is read and
    dequantized in a background thread while layer i is quantized and written (module doc)."""
    cfg = reader.config
    units = output_units(reader, recipe)
    writer.plan([specs for _, specs in units])
    bar = weights_bar(progress, sum(s.nbytes for _, specs in units for s in specs), len(units))
    writer.add(*quantize_globals(cfg, reader.read_globals(), recipe))
    _advance(bar, units[0][1], 1, len(units))

    def load(i: int) -> dict:
        return read_layer(reader, i, recipe, smooth_stats, smooth_alpha)

    layer_ids = layout.all_layer_ids(cfg)
    try:
        with closing(prefetched(layer_ids, load, prefetch)) as layers:
            for k, (i, tensors) in enumerate(layers, start=2):
                if on_layer is not None:
                    on_layer(i, tensors)
                for piece in quantize_layer_pieces(cfg, i, tensors, stats, recipe):
                    writer.add(*piece)  # written on the writer's thread while the next piece is computed
                del tensors  # before the next layer arrives
                _advance(bar, units[k - 1][1], k, len(units))
    finally:
        bar.close()


def _advance(bar, specs: list[TensorSpec], done: int, total: int) -> None:
    bar.update(sum(s.nbytes for s in specs))
    bar.set_postfix_str(f"{done}/{total} units")

