"""Single-process quantization of a checkpoint: calibrate, optionally smooth, quantize layer by layer, write.

Two phases, so that the memory-heavy part is only the calibration forward:

1. calibration: the float model (model dtype, as msModelSlim runs it) over each calibration sample
   (batch of one); with ``recipe.smooth`` first the smoothing statistics and their fold into the model,
   then the W8A8/FA3 statistics of the smoothed model;
2. weights (:func:`quantize_weights`): one layer at a time from the source, the same smoothing fold
   applied to its tensors (bit-identical to phase 1's), quantized module by module (FP8 weights straight
   from their codes, never dequantized whole) and streamed into the writer, which knows every output
   tensor ahead (:func:`output_specs`) and writes (and hashes) each piece on its own thread while the next
   is computed. The next layer is read in a background thread meanwhile (``QuantizeOptions.prefetch``):
   peak memory is about two layers as stored (the one being quantized and the next) plus a piece or two
   of int8 output.

The distributed pipeline runs the same two phases per layer range and must produce identical files.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Callable, Iterable, Iterator, Optional

import torch

from pipeline import layout
from pipeline.quant import native
from pipeline.io.checkpoint import CheckpointReader
from pipeline.model.loading import load_model
from pipeline.quant.calibrate import collect_stats
from pipeline.quant.observers import Stats
from pipeline.quant.options import SHARD_BYTES, QuantizeOptions, calibration_samples  # noqa: F401 (re-exported)
from pipeline.quant.estimate import announce
from pipeline.quant.preflight import check_job, data_free_notes
from pipeline.quant.progress import weights_bar
from pipeline.config import model_dtype
from pipeline.quant.quantize_layer import quantize_globals, quantize_layer_pieces
from pipeline.quant.recipe import Recipe
from pipeline.quant.shard_layout import output_units
from pipeline.quant.smooth import ChannelAbsMax, apply_smoothing, collect_smoothing_stats
from pipeline.quant.unit_writer import read_layer
from pipeline.quant.writer import QuantizedWriter
from pipeline.io.safetensors_io import TensorSpec

def prepare_float_model(src: str, recipe: Recipe, samples: list[list[int]], opts: QuantizeOptions):
    """The float model in the model dtype, smoothed when the recipe says so. Returns (model,
    smoothing statistics or None)."""
    reader_cfg = CheckpointReader(src).config
    model = load_model(src, dtype=model_dtype(reader_cfg), device=opts.device or "cpu")
    smooth_stats = None
    if recipe.smooth:
        layers = None if recipe.quantize_mtp else range(reader_cfg.num_hidden_layers)
        smooth_stats = collect_smoothing_stats(model, samples, layer_ids=layers)
        apply_smoothing(model, smooth_stats, opts.smooth_alpha)
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
                        log: Callable[[str], None] = print) -> dict:
    """Quantize ``src`` into ``dst`` (any fsspec locations); returns the job summary (also in the
    manifest). Every input is checked first (:func:`pipeline.quant.preflight.check_job`); nothing in
    ``dst`` looks complete until the very end, and an earlier output there (``opts.overwrite``) stays
    whole until the new shards are all written."""
    t0 = time.time()
    job = check_job(src, dst, recipe, opts)
    reader, cfg, md = job.reader, job.reader.config, job.model_dtype
    est = announce(reader, recipe, job.samples, opts.device, log, dst=dst) if opts.estimate else None
    if job.needs_calibration:
        log(f"calibrating {src} ({cfg.num_hidden_layers} layers + {len(cfg.mtp_layer_ids)} MTP, {md})")
        stats, smooth_stats = calibrate(src, recipe, opts, job.samples)
    else:
        for line in data_free_notes(src):
            log(line)
        stats, smooth_stats = Stats(), None
    t1 = time.time()
    summary = {"source": src, "recipe": recipe.to_dict(), "calibration_s": round(t1 - t0, 3),
               "weight_kernel": native.status(), **({"estimate": est.to_dict()} if est else {})}
    with QuantizedWriter(dst, recipe.dialect, model_dtype=md, shard_bytes=opts.shard_bytes,
                         overwrite=opts.overwrite, src=src) as writer:
        quantize_weights(reader, writer, stats, recipe, smooth_stats, opts.smooth_alpha, prefetch=opts.prefetch,
                         progress=opts.progress)
        summary["quantize_write_s"] = round(time.time() - t1, 3)
        writer.finish(job.raw_config, src_dir=src, mindie_format=opts.mindie_format, job=summary)
    summary["total_s"] = round(time.time() - t0, 3)
    calib = f"calibration {summary['calibration_s']:.1f}s" if job.needs_calibration else "no calibration"
    log(f"wrote {dst} in {summary['total_s']:.1f}s ({calib}; weights with {summary['weight_kernel'].split(' (')[0]})")
    return summary


def output_specs(reader: CheckpointReader, recipe: Recipe) -> list[TensorSpec]:
    """Every tensor :func:`quantize_weights` writes, in order, from the source's headers alone."""
    return [s for _, specs in output_units(reader, recipe) for s in specs]


def quantize_weights(reader: CheckpointReader, writer: QuantizedWriter, stats: Stats, recipe: Recipe,
                     smooth_stats: Optional[dict[str, ChannelAbsMax]] = None, smooth_alpha: float = 0.5, *,
                     prefetch: bool = True, progress: bool = False) -> None:
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
        with closing(_prefetched(layer_ids, load, prefetch)) as layers:
            for k, (i, tensors) in enumerate(layers, start=2):
                for piece in quantize_layer_pieces(cfg, i, tensors, stats, recipe):
                    writer.add(*piece)  # written on the writer's thread while the next piece is computed
                del tensors  # before the next layer arrives
                _advance(bar, units[k - 1][1], k, len(units))
    finally:
        bar.close()


def _advance(bar, specs: list[TensorSpec], done: int, total: int) -> None:
    bar.update(sum(s.nbytes for s in specs))
    bar.set_postfix_str(f"{done}/{total} units")


def _prefetched(ids: list[int], load: Callable[[int], dict], enabled: bool) -> Iterator[tuple[int, dict]]:
    """(i, load(i)) for each id, the next one loading in a background thread while the caller works on
    this one (one deep). Closing the generator waits for that thread; its errors surface here."""
    if not enabled:
        yield from ((i, load(i)) for i in ids)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="prefetch-layer") as pool:
        nxt = pool.submit(load, ids[0]) if ids else None
        try:
            for k, i in enumerate(ids):
                tensors = nxt.result()
                nxt = pool.submit(load, ids[k + 1]) if k + 1 < len(ids) else None
                yield i, tensors
                del tensors
        finally:
            if nxt is not None:
                nxt.cancel()
