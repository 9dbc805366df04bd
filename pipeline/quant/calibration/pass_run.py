"""msModelSlim's layer-by-layer passes over a run of layers, each read once (docs/recipes.md, "Calibration").

The single-process job runs every layer (:func:`pipeline.quant.calibration.layerwise.calibrate_layerwise`); a distributed
job's stage runs its own layers on the previous stage's outputs (actors.quantize.stage): the same function, so the
same files. Per layer: read it (the next one on a thread meanwhile), calibrate it
(:class:`pipeline.quant.calibration.layer_passes.LayerCalibrator`: the recipe's steps, the linears' pass, the FA3 pass),
hand ``quantize(layer_id, tensors, stats)`` the layer with every step folded in, and carry its outputs to the
next layer.
"""

from __future__ import annotations

import time
from contextlib import closing
from typing import Callable, Optional, Sequence

import torch

from pipeline.config import model_dtype
from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.calibration.calibrate import check_samples, stats_layers
from pipeline.quant.calibration.layer_passes import LayerCalibrator, Sample, first_samples, heads_for_mtp
from pipeline.quant.calibration.layer_reads import forward_tensors, prefetched, unit_bytes
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.writing.quantize_layer import deferred_weights
from pipeline.quant.recipe.recipe import Recipe

HEADS = ("model.norm.weight", "lm_head.weight")


def run_passes(reader: CheckpointReader, recipe: Recipe, samples: Sequence[Sequence[int]], layer_ids: Sequence[int], *,
               state: Optional[list[Sample]] = None, embed: bool = False,
               write_globals: Optional[Callable[[dict], None]] = None,
               quantize: Callable[[int, dict, Stats], None], smooth_alpha: float = 0.5, device: str = "cpu",
               prefetch: bool = True) -> tuple[Optional[list[Sample]], dict]:
    """Layers ``layer_ids`` (ascending, contiguous) on ``state`` (the previous layers' outputs), or with
    ``embed`` from the globals (read, steps folded in, handed to ``write_globals``, the samples embedded).
    Returns (the outputs of the last layer, {"calibration_s", "bytes_read"})."""
    cfg = reader.config
    md = model_dtype(cfg)
    recipe.check_config(cfg)
    check_samples(samples, cfg.vocab_size)
    calibrated = set(stats_layers(cfg, recipe, have_mtp=bool(cfg.mtp_layer_ids)))
    calib = LayerCalibrator(cfg, recipe, max(len(s) for s in samples), smooth_alpha)
    transforms = calib.plan.changes_weights
    sizes = unit_bytes(reader)
    nbytes, t_calib = 0, 0.0
    # the MTP feed takes the last token from the head as read: msModelSlim folds its steps into the final
    # norm and the head only at the end, after the MTP layer was calibrated
    wants_heads = any(i >= cfg.num_hidden_layers and i in calibrated for i in layer_ids)
    heads = None
    with torch.inference_mode():
        if embed:
            t = time.perf_counter()
            source = reader.read_globals()
            nbytes += sizes.get(None, 0)
            heads = heads_for_mtp(source, cfg) if wants_heads else None
            g = calib.transform_globals(source)
            del source
            t_calib += time.perf_counter() - t
            if write_globals is not None:
                write_globals(g)
            ids = [torch.tensor([list(s)], dtype=torch.long, device=device) for s in samples]
            state = first_samples(ids, g["model.embed_tokens.weight"].to(device=device, dtype=md))
            del g
        elif wants_heads:
            heads = heads_for_mtp({n: reader.read_tensor(n, md) for n in HEADS if n in reader.tensor_names()}
                                  | ({"model.embed_tokens.weight": reader.read_tensor("model.embed_tokens.weight", md)}
                                     if cfg.tie_word_embeddings else {}), cfg)

        def load(i: int) -> dict:
            deferred = frozenset() if transforms else deferred_weights(cfg, i, recipe)
            return reader.read_layer(i, deferred=deferred)

        with closing(prefetched(list(layer_ids), load, prefetch, reader.read_ahead)) as layers:
            for i, tensors in layers:
                nbytes += sizes.get(i, 0)
                if i in calibrated or (transforms and i < cfg.num_hidden_layers):
                    t = time.perf_counter()
                    fwd = {n: v.to(device) for n, v in forward_tensors(tensors).items()}
                    res = calib.run(i, fwd, state, heads)
                    t_calib += time.perf_counter() - t
                    weights, stats = (res.tensors if transforms else tensors), res.stats
                    if res.samples is not None:
                        state = res.samples
                    elif i < cfg.num_hidden_layers - 1:  # (the MTP layer's output feeds nothing)
                        state = calib.float_pass(i, fwd, state)
                    del fwd, res
                else:
                    weights = calib.transform_layer(i, forward_tensors(tensors)) if transforms else tensors
                    stats = Stats()
                quantize(i, weights, stats)
                del tensors, weights
    return state, {"calibration_s": t_calib, "bytes_read": nbytes}
