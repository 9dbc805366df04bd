"""The stage actor: a :class:`pipeline.quant.stage.Stage` (the float layers of one pipeline stage) and
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

from pipeline import storage
from pipeline.checkpoint import CheckpointReader
from pipeline.quant.observers import Stats
from pipeline.quant.recipe import Recipe
from pipeline.quant.shard_layout import Shard
from pipeline.quant.smooth import ChannelAbsMax
from pipeline.quant.stage import STATS, Stage, StageSpec
from pipeline.quant.unit_writer import process_unit


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

    def _reader(self) -> CheckpointReader:
        if self.reader is None:
            self.reader = CheckpointReader(self.src)
        return self.reader

    def _stage(self) -> Stage:
        if self.stage is None:
            t = time.perf_counter()
            self.stage = Stage(self._reader(), self.spec, self.recipe, self.device)
            self.smoothed = None
            self.busy_s["load"] += time.perf_counter() - t
        return self.stage

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

    def write_unit(self, dst: str, shards: Sequence[Shard], stats: Stats,
                   smooth: Optional[Mapping[str, ChannelAbsMax]], alpha: float):
        """Quantize one unit from the source and write its shards; returns (records, types)."""
        t = time.perf_counter()
        out = process_unit(self._reader(), dst, shards, stats, self.recipe, smooth, alpha)
        self.busy_s["weights"] += time.perf_counter() - t
        self.bytes_written += sum(r.size for r in out[0])
        return out

    def info(self) -> dict:
        """Where the actor runs and what it used (peak RSS of this process life)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "busy_s": {k: round(v, 3) for k, v in self.busy_s.items()}, "bytes_written": self.bytes_written}
