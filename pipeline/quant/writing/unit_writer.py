"""The weight phase of one unit (the globals or one layer), as any worker runs it: read the unit from the
source (FP8 dequantized), fold the smoothing in, quantize, and write the unit's shards under their final
names (:mod:`pipeline.quant.writing.shard_layout`), each committed atomically with its size and sha256. The
single-process path (:func:`pipeline.quant.job.run.quantize_weights`) computes the same tensors with the same
functions, so the files are the same.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from pipeline.io import storage
from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.writing.output_files import ShardFile, ShardRecord
from pipeline.io.fp8 import BlockRows
from pipeline.config import model_dtype
from pipeline.quant.writing.quantize_layer import deferred_weights, quantize_globals, quantize_layer
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.writing.shard_layout import GLOBALS, Shard, unit_layer
from pipeline.quant.transforms.smooth import ChannelAbsMax, smooth_layer, smoothed_weights
from pipeline.quant.writing.writer import check_next, prepare_unit


def quantize_unit(reader: CheckpointReader, unit: str, stats: Stats, recipe: Recipe,
                  smooth_stats: Optional[Mapping[str, ChannelAbsMax]] = None, smooth_alpha: float = 0.5
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, types) of ``unit`` in the canonical form, as quantize_weights computes them."""
    cfg = reader.config
    if unit == GLOBALS:
        return quantize_globals(cfg, reader.read_globals(), recipe)
    i = unit_layer(unit)
    return quantize_layer(cfg, i, read_layer(reader, i, recipe, smooth_stats, smooth_alpha), stats, recipe)


def read_layer(reader: CheckpointReader, layer_id: int, recipe: Recipe,
               smooth_stats: Optional[Mapping[str, ChannelAbsMax]] = None, smooth_alpha: float = 0.5
               ) -> dict[str, torch.Tensor | BlockRows]:
    """Layer ``layer_id`` from the source as :func:`quantize_layer` takes it: smoothed when
    ``smooth_stats`` is given, and the FP8 weights it quantizes per channel left as BlockRows (those the
    smoothing does not change): they are dequantized a block row at a time as they are quantized."""
    keep = smoothed_weights(layer_id) if smooth_stats else frozenset()
    tensors = reader.read_layer(layer_id, deferred=deferred_weights(reader.config, layer_id, recipe, keep))
    return smooth_layer(tensors, layer_id, dict(smooth_stats), smooth_alpha) if smooth_stats else tensors


def write_unit(dst: str, shards: Sequence[Shard], tensors: Mapping[str, torch.Tensor], types: Mapping[str, str],
               dialect: str, md) -> tuple[list[ShardRecord], dict[str, str]]:
    """Write one unit's ``shards`` (all of them, in order) from its canonical tensors; returns the shard
    records and the stored types. A shard is committed only once complete; on error, the shard being
    written is discarded (the ones committed before it stay, and their records are lost with the error:
    a rerun redoes the whole unit)."""
    conv, conv_types, specs = prepare_unit(tensors, types, dialect, md)
    planned = [s for sh in shards for s in sh.specs]
    check_next(list(specs.values()), planned, 0)
    if len(specs) != len(planned):
        raise ValueError(f"unit {shards[0].unit}: {len(planned) - len(specs)} planned tensors missing: "
                         f"{[s.name for s in planned[len(specs):]][:5]}")
    records = []
    for sh in shards:
        f = ShardFile(storage.join(dst, sh.name), sh.specs)
        try:
            for spec in sh.specs:
                f.write(spec.name, conv[spec.name])
        except BaseException:
            f.discard()
            raise
        records.append(f.close())
    return records, conv_types


def process_unit(reader: CheckpointReader, dst: str, shards: Sequence[Shard], stats: Stats, recipe: Recipe,
                 smooth_stats: Optional[Mapping[str, ChannelAbsMax]] = None, smooth_alpha: float = 0.5
                 ) -> tuple[list[ShardRecord], dict[str, str]]:
    """:func:`quantize_unit` then :func:`write_unit` for the unit of ``shards``."""
    units = {s.unit for s in shards}
    if len(units) != 1:
        raise ValueError(f"shards of one unit expected, got units {sorted(units)}")
    tensors, types = quantize_unit(reader, shards[0].unit, stats, recipe, smooth_stats, smooth_alpha)
    return write_unit(dst, shards, tensors, types, recipe.dialect, model_dtype(reader.config))
