"""Layer-wise calibration: the single-process job reads the checkpoint once.

Today's reference (``QuantizeOptions(layerwise=False)``, ``--two-pass``) builds the whole float model,
calibrates it, then reads every layer again for the weight phase. Here each unit is read once and feeds
both::

    globals  = read_globals();  writer.add(globals);  h_j = embed(ids_j)            for every sample j
    for i in all_layer_ids (layer i+1 read on a thread meanwhile):
        T     = read_layer(i, deferred=the per-channel FP8 weights)    # the ONE read of layer i's bytes
        F     = T in the model dtype (FP8 BlockRows dequantized: what load_model would hold)
        [smooth]  u_j = layer_i(F)(u_j) observed -> smoothing stats of i;  F = smooth_layer(F, stats)
        h_j   = layer_i(F)(h_j) observed -> the W8A8 / FA3 statistics of layer i
        writer.add(pieces of quantize(smooth_layer(T) or T, statistics of i));  free layer i
    (after the last main layer: h = norm(h); the MTP layer(s) read it and the ids, as calibrate.run_mtp)

Why it is the two-pass output byte for byte: every sample's activations at every layer are computed by
the same ops on the same tensors (a layer's forward reads only its input and its own weights; the rotary
tables are recomputed per call from the positions, the same values); the statistics are min/max merges,
exact in any order; ``F`` holds what ``load_model`` gives (``read_layer(i, dtype=md)`` dequantizes FP8
weights with the same BlockRows, stored model-dtype tensors are the same objects); the weight phase gets
``T`` exactly as ``unit_writer.read_layer`` reads it (same ``deferred`` set, same ``smooth_layer``). With
``recipe.smooth`` the reference collects the smoothing statistics on the UNSMOOTHED model and the others
on the smoothed one, so two hidden-state streams run: ``u`` (unsmoothed) and ``h`` (smoothed).

Memory: one layer as stored (+ the prefetched next; + its dequantized copy for an FP8 source) plus one
layer boundary of activations for all samples, x2 with smoothing: at DeepSeek-V3 671B (hidden 7168, bf16)
with 128 samples x 2048 tokens that is 128 * 2048 * 7168 * 2 B = 3.76 GB per boundary (7.5 GB smoothed),
against the reference's whole float model (1.3 TB in bf16).
"""

from __future__ import annotations

import time
from contextlib import closing
from typing import Callable, Optional, Sequence

import torch

from pipeline import layout
from pipeline.config import model_dtype
from pipeline.io.checkpoint import CheckpointReader
from pipeline.model import DeepseekV3ForCausalLM
from pipeline.model.causal_lm import DecoderLayer, MTPLayer
from pipeline.model.rope import Rotary
from pipeline.quant.calibration.calibrate import check_samples, observing, run_layer_batched, stats_layers
from pipeline.quant.calibration.layer_reads import forward_tensors, prefetched, unit_bytes
from pipeline.quant.numerics.products import calibration_products
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.calibration.pass_run import run_passes
from pipeline.quant.writing.quantize_layer import deferred_weights
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.transforms.recipe_plan import resolve
from pipeline.quant.transforms.smooth import observing_smoothing, smooth_layer

ROUTER_BIAS = "e_score_correction_bias"


class LayerHost:
    """The float model on the meta device, given real weights one layer at a time (so that the
    observers of :mod:`pipeline.quant.calibration.calibrate` and :mod:`pipeline.quant.transforms.smooth`, which find modules by
    their HF names, work unchanged)."""

    def __init__(self, cfg, md: torch.dtype, device: str, with_mtp: bool):
        with torch.device("meta"):
            self.model = DeepseekV3ForCausalLM(cfg, dtype=md, with_mtp=with_mtp)
        self.model.rotary = Rotary(cfg, device=device)
        self.model.eval()
        self.cfg, self.md, self.device = cfg, md, device

    def _cast(self, name: str, t: torch.Tensor) -> torch.Tensor:
        # as build_model: the model dtype, the router bias float32
        return t.to(device=self.device, dtype=torch.float32 if name.endswith(ROUTER_BIAS) else self.md)

    def set_globals(self, tensors: dict[str, torch.Tensor]) -> None:
        state = {n: self._cast(n, tensors[n]) for n in ("model.embed_tokens.weight", "model.norm.weight")}
        self.model.load_state_dict(state, strict=False, assign=True)

    def set_layer(self, layer_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """Layer ``layer_id``'s weights (HF names, every one of the layer's) into the model."""
        p = layout.layer_prefix(layer_id)
        layer = self.model.model.layers[layer_id]
        layer.load_state_dict({n[len(p):]: self._cast(n, t) for n, t in tensors.items()}, strict=True, assign=True)

    def free_layer(self, layer_id: int) -> None:
        cls = MTPLayer if layer_id >= self.cfg.num_hidden_layers else DecoderLayer
        self.model.model.layers[layer_id] = cls(self.cfg, layer_id, device="meta", dtype=self.md).eval()


def calibrate_layerwise(reader: CheckpointReader, recipe: Recipe, samples: Sequence[Sequence[int]], *,
                        write_globals: Callable[[dict], None], quantize: Callable[[int, dict, Stats], None],
                        smooth_alpha: float = 0.5, device: str = "cpu", prefetch: bool = True, batch: int = 1) -> dict:
    """The one-read job: msModelSlim's layer-by-layer passes (:func:`pipeline.quant.calibration.pass_run.run_passes`) or, with
    ``recipe.calibration`` "float", the float model's activations (:func:`calibrate_float`), as the recipe's plan
    says (pipeline.quant.transforms.recipe_plan)."""
    plan = resolve(recipe, reader.config)
    plan.check_batch(batch)
    if plan.layer_passes:
        _, info = run_passes(reader, recipe, samples, layout.all_layer_ids(reader.config), embed=True,
                             write_globals=write_globals, quantize=quantize, smooth_alpha=smooth_alpha,
                             device=device, prefetch=prefetch)
        return info
    return calibrate_float(reader, recipe, samples, write_globals=write_globals, quantize=quantize,
                           smooth_alpha=smooth_alpha, device=device, prefetch=prefetch, batch=batch)


def calibrate_float(reader: CheckpointReader, recipe: Recipe, samples: Sequence[Sequence[int]], *,
                    write_globals: Callable[[dict], None], quantize: Callable[[int, dict, Stats], None],
                    smooth_alpha: float = 0.5, device: str = "cpu", prefetch: bool = True, batch: int = 1) -> dict:
    """Run the module's loop: the globals, read once, go to ``write_globals`` and embed the samples (then
    only the final norm is kept); each layer is read once, calibrated, and handed to
    ``quantize(layer_id, tensors, stats)`` (the weight phase's tensors:
    smoothed when the recipe smooths). ``batch``: samples per forward of the statistics stream
    (:func:`pipeline.quant.calibration.calibrate.run_layer_batched`; the smoothing stream and the MTP layers run one
    sample at a time).
    Returns {"calibration_s": seconds in the forwards, "bytes_read": source bytes read (globals included)}."""
    cfg = reader.config
    md = model_dtype(cfg)
    recipe.check_config(cfg)
    check_samples(samples, cfg.vocab_size)
    stat_ids = set(stats_layers(cfg, recipe, have_mtp=bool(cfg.mtp_layer_ids)))
    run_mtp = any(recipe.quantized_layer(cfg, i) for i in cfg.mtp_layer_ids)
    smoothing = resolve(recipe, cfg).smoothing
    host = LayerHost(cfg, md, device, with_mtp=bool(cfg.mtp_layer_ids))
    sizes = unit_bytes(reader)
    nbytes = sizes.get(None, 0)
    ids = [torch.tensor([list(s)], dtype=torch.long, device=device) for s in samples]
    t_calib = 0.0
    with torch.inference_mode():
        globals_ = reader.read_globals()
        write_globals(globals_)
        t = time.perf_counter()
        host.set_globals(globals_)
        del globals_
        h = [host.model.embed(x) for x in ids]               # the smoothed stream (the statistics)
        u = smoothing.stream(h)                             # the unsmoothed stream (smoothing statistics)
        host.model.model.embed_tokens.to("meta")             # (the MTP layer has an embedding of its own)
        t_calib += time.perf_counter() - t

        def load(i: int) -> dict:
            return reader.read_layer(i, deferred=deferred_weights(cfg, i, recipe, smoothing.kept_weights(i)))

        with closing(prefetched(layout.all_layer_ids(cfg), load, prefetch, reader.read_ahead)) as layers:
            for i, tensors in layers:
                nbytes += sizes.get(i, 0)
                is_mtp = i >= cfg.num_hidden_layers
                stats, weights = Stats(), tensors
                if not is_mtp or run_mtp:
                    t = time.perf_counter()
                    fwd = forward_tensors(tensors)
                    depth = i - cfg.num_hidden_layers
                    if u is not None:  # the smoothing pass runs a sample at a time (its observers see padding)
                        host.set_layer(i, fwd)
                        with observing_smoothing(host.model, [i], recipe.calib_products) as sm:
                            u = _run(host.model, i, u, ids, 1, mtp_depth=depth if is_mtp else None, smoothing=True)
                        smoothed = smooth_layer(fwd, i, sm, smooth_alpha)
                        # smooth_layer changes only weights it never defers, which are the same objects in
                        # ``tensors`` and ``fwd``: the weight phase's smooth_layer(tensors) gives these tensors
                        weights = {**tensors, **{n: v for n, v in smoothed.items() if v is not fwd[n]}}
                        fwd = smoothed
                        del smoothed
                    host.set_layer(i, fwd)
                    del fwd  # the host holds the forward's weights until free_layer
                    # observing multiplies as the recipe says; a layer it does not observe does the same
                    with (observing(host.model, recipe, [i]) if i in stat_ids
                          else calibration_products(recipe.calib_products)) as col:
                        h = _run(host.model, i, h, ids, batch, mtp_depth=depth if is_mtp else None, col=col)
                    stats = col.stats() if col is not None else Stats()
                    host.free_layer(i)
                    if i == cfg.num_hidden_layers - 1:                 # what the MTP layer(s) read
                        h = [host.model.model.norm(x) for x in h] if run_mtp else None
                        u = [host.model.model.norm(x) for x in u] if run_mtp and u is not None else None
                    t_calib += time.perf_counter() - t
                quantize(i, weights, stats)
                del tensors, weights
    return {"calibration_s": t_calib, "bytes_read": nbytes}


def _run(model, layer_id: int, hs, ids, batch: int, mtp_depth: Optional[int] = None, smoothing: bool = False,
         col=None):
    """Every sample's hidden state through one layer (None: a stream no longer needed). A main layer:
    ``run_layers``. MTP depth d (as calibrate.run_mtp): ``hs`` the previous depth's hidden, a sample of
    n <= d + 1 tokens has stopped; the smoothing pass runs depth 0 only (smooth.collect_smoothing_stats)."""
    if hs is None:
        return None
    if mtp_depth is None:
        return run_layer_batched(model, layer_id, hs, batch, col)
    out = []
    for x, t in zip(hs, ids):
        n = t.shape[1]
        if x is None or n <= mtp_depth + 1 or (smoothing and mtp_depth > 0):
            out.append(None)  # today's run_mtp breaks here; the smoothing pass never runs depth > 0
            continue
        _, y = model.mtp(x[:, :-1], t[:, mtp_depth + 1:], depth=mtp_depth)
        out.append(y)
    return out
