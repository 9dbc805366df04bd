"""The stage actor: a :class:`pipeline.quant.job.stage.Stage` (the float layers of one pipeline stage) and
the weight phase of any unit, in a Ray actor. Thin: all the work is pipeline code.

Stateless where it matters for faults: the model is (re)loaded on first use, so an actor that Ray
restarts after a crash comes back empty and rebuilds it; the smoothing a stage's statistics pass needs
comes with every call (an object-store reference, applied once per actor life), so a restarted actor
cannot silently compute the statistics of an unsmoothed model; each call returns that sample's
statistics instead of accumulating them, so a redone call cannot count a sample twice.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Mapping, Optional, Sequence

import ray
import torch

from pipeline.io import storage
from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.numerics.observers import Stats
from pipeline.quant.recipe.recipe import Recipe
from pipeline.config import model_dtype
from pipeline.quant.writing.quantize_layer import quantize_layer
from pipeline.quant.writing.shard_layout import Shard, unit_layer
from pipeline.quant.transforms.smooth import ChannelAbsMax
from pipeline.quant.job.stage import STATS, Stage, StageSpec
from pipeline.quant.writing.unit_writer import process_unit, write_unit


class StageWorker:
    def __init__(self, src: str, spec: StageSpec, recipe: Mapping[str, Any], storage_options: Mapping[str, dict],
                 threads: int = 1, device: str = "cpu"):
        for protocol, opts in storage_options.items():
            storage.set_options(protocol, **opts)
        torch.set_num_threads(max(1, threads))
        self.src, self.spec, self.recipe, self.device = src, spec, Recipe.from_dict(recipe), device
        self.reader: Optional[CheckpointReader] = None  # headers read once per actor life
        self.stage: Optional[Stage] = None
        self.smoothed: Optional[str] = None   # the key of the smoothing applied to self.stage
        self.busy_s = {"load": 0.0, "forward": 0.0, "weights": 0.0}
        self.bytes_written = 0
        self.from_memory = 0  # units quantized from the calibration model's weights

    def _reader(self) -> CheckpointReader:
        if self.reader is None:
            self.reader = CheckpointReader(self.src, with_mtp=not self.recipe.drop_mtp)
        return self.reader

    def _stage(self) -> Stage:
        if self.stage is None:
            t = time.perf_counter()
            self.stage = Stage(self._reader(), self.spec, self.recipe, self.device)
            self.smoothed = None
            self.busy_s["load"] += time.perf_counter() - t
        return self.stage

    def load(self) -> float:
        """Load the stage's weights now (all stages at once, before the first sample); returns seconds."""
        t = time.perf_counter()
        self._stage()
        return time.perf_counter() - t

    def forward(self, kind: str, ids: Sequence[int], h: Optional[torch.Tensor],
                smoothing: Optional[tuple[str, Mapping[str, ChannelAbsMax], float]] = None):
        """One sample through the stage (see Stage.forward). ``smoothing``: (key, statistics, alpha) to
        fold in first when the stage does not hold that smoothing yet (statistics pass only)."""
        stage = self._stage()
        t = time.perf_counter()
        if kind == STATS and smoothing is not None and self.smoothed != smoothing[0]:
            if self.smoothed is not None:  # a different smoothing: start again from the source
                self.stage = None
                stage = self._stage()
            stage.apply_smoothing(smoothing[1], smoothing[2])
            self.smoothed = smoothing[0]
        out = stage.forward(kind, ids, h)
        self.busy_s["forward"] += time.perf_counter() - t
        return out

    def release(self) -> None:
        """Drop the calibration model (before the weight phase)."""
        self.stage, self.smoothed = None, None

    def _held(self, unit: str, smoothing_key: Optional[str]) -> Optional[dict[str, torch.Tensor]]:
        """The unit's weights as the calibration model holds them, when they are exactly what the weight
        phase would read (the stage's own layer, the same smoothing folded in, every tensor with the
        reader's name, dtype and shape); else None (read from the source)."""
        lid = unit_layer(unit)
        if self.stage is None or lid is None or lid in self.stage.dropped or \
                lid not in (*self.spec.layers, *self.spec.mtp):
            return None
        if self.smoothed != smoothing_key:  # (both None when the recipe does not smooth)
            return None
        prefix = f"model.layers.{lid}."
        held = {k: v for k, v in self.stage.model.state_dict().items() if k.startswith(prefix)}
        want = self._reader().read_specs(lid)
        if set(held) != set(want) or any(held[k].is_meta or held[k].dtype != d or tuple(held[k].shape) != tuple(sh)
                                         for k, (d, sh) in want.items()):
            return None
        return {k: held[k] for k in want}  # in the reader's order

    def write_unit(self, dst: str, shards: Sequence[Shard], stats: Stats,
                   smooth: Optional[Mapping[str, ChannelAbsMax]], alpha: float, smoothing_key: Optional[str] = None):
        """Quantize one unit and write its shards; returns (records, types). A layer this stage holds from
        calibration is quantized from memory (and then dropped), anything else is read from the source;
        the tensors are the same either way (``_held``)."""
        t = time.perf_counter()
        held = self._held(shards[0].unit, smoothing_key)
        if held is None:
            out = process_unit(self._reader(), dst, shards, stats, self.recipe, smooth, alpha)
        else:
            lid = unit_layer(shards[0].unit)
            tensors, types = quantize_layer(self.stage.model.config, lid, held, stats, self.recipe)
            del held
            out = write_unit(dst, shards, tensors, types, self.recipe.dialect, model_dtype(self.stage.model.config))
            self.stage.drop_layer(lid)
            self.from_memory += 1
        self.busy_s["weights"] += time.perf_counter() - t
        self.bytes_written += sum(r.size for r in out[0])
        return out

    def run_passes(self, state, samples: Sequence[Sequence[int]], layer_ids: Sequence[int], embed: bool, dst: str,
                   shards: Mapping[str, Sequence[Shard]], key, commits: Mapping[str, Any], verify: str):
        """msModelSlim's layer-by-layer passes over this stage's layers (pipeline.quant.calibration.pass_run) on the
        previous stage's outputs ``state`` (None with ``embed``), each layer quantized and its shards written
        as soon as it is calibrated, unless already committed and verified for the same unit fingerprint.
        Returns (the last layer's outputs, the layers' statistics, [(unit, fingerprint, records or None,
        types)])."""
        from pipeline.quant.job import job_state as js
        from pipeline.quant.calibration.pass_run import run_passes
        from pipeline.quant.writing.quantize_layer import quantize_globals
        from pipeline.quant.writing.shard_layout import GLOBALS, unit_key

        reader = self._reader()
        cfg, md = reader.config, model_dtype(reader.config)
        out: list = []
        stats_all = Stats()
        t = time.perf_counter()

        def write(unit: str, stats: Stats, make) -> None:
            fp = key.unit(reader, unit, stats, None)
            if all(js.verify_shard(dst, sh, commits.get(sh.name), fp, verify) for sh in shards[unit]):
                out.append((unit, fp, None, None))
                return
            tensors, types = make()
            records, stored = write_unit(dst, shards[unit], tensors, types, self.recipe.dialect, md)
            self.bytes_written += sum(r.size for r in records)
            out.append((unit, fp, records, stored))

        def write_globals(g: dict) -> None:
            write(GLOBALS, Stats(), lambda: quantize_globals(cfg, g, self.recipe))

        def quantize(i: int, weights: dict, stats: Stats) -> None:
            nonlocal stats_all
            stats_all = stats_all.merge(stats)
            write(unit_key(i), stats, lambda: quantize_layer(cfg, i, weights, stats, self.recipe))

        state, _ = run_passes(reader, self.recipe, samples, layer_ids, state=state, embed=embed,
                              write_globals=write_globals, quantize=quantize, device=self.device)
        self.busy_s["forward"] += time.perf_counter() - t
        return state, stats_all, out

    def info(self) -> dict:
        """Where the actor runs and what it used (peak RSS of this process life)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "busy_s": {k: round(v, 3) for k, v in self.busy_s.items()}, "bytes_written": self.bytes_written,
                "units_from_memory": self.from_memory}
