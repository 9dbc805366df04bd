"""Helpers for the distributed-job tests: reference outputs from the single-process path, and output
comparison that ignores only what must differ (the manifest's job section, the job summary, job state)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pipeline.io import storage
from pipeline.format.checker import check_dir
from pipeline.format.description import DESCRIPTION_NAME, MANIFEST_NAME
from pipeline.quant.job.job_state import STATE_DIR, SUMMARY_NAME
from pipeline.quant.writing.output_files import RECIPE_SUFFIX
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from tiny import FIXTURES

# the first 8 of fixtures/calib.json's 16 texts: every distributed run is compared with a single-process run
# on the same texts, which any texts show; 8 leave the fault tests' kills (at sample 2) well inside the
# calibration
CALIB_TEXTS = 8
OPTS = QuantizeOptions(calib_path=str(FIXTURES / "calib8.json"), shard_bytes=150_000, progress=False)
# the float calibration's pipelined stages (actors.quantize.calibration); msModelSlim's layer-by-layer passes
# (actors.quantize.pass_stages) are tests/test_distributed_passes.py's
PLAIN = Recipe(calibration="float")
SMOOTH_MTP = Recipe(smooth=True, quantize_mtp=True, calibration="float")
NOT_COMPARED = {MANIFEST_NAME, SUMMARY_NAME, STATE_DIR}

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test clusters: no token between processes

# the simulated cluster (conftest.ray_cluster): worker nodes, and node death declared in ~1.5 s. Each node
# declares its memory: left to Ray, every simulated node reports a share of the machine's free memory when it
# starts, so the quantize job's resource check (plans of 6-9 GiB over 3-4 actors) would pass or refuse with
# what other users' processes hold
RAY_WORKER = {"num_cpus": 2, "object_store_memory": 96 * 2**20, "memory": 8 * 2**30}
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_timeout_ms": 500,
               "health_check_initial_delay_ms": 0}


def quiet(_msg: str) -> None:
    pass


def reference(src: str, dst: Path, recipe: Recipe, opts: QuantizeOptions = OPTS) -> Path:
    """The single-process output (written once per path)."""
    if not (dst / DESCRIPTION_NAME).exists():
        quantize_checkpoint(src, str(dst), recipe, dataclasses.replace(opts, overwrite=True), log=quiet)
    return dst


def tree(root: str, prefix: str = "") -> dict[str, bytes]:
    """Every file under ``root`` (sub-directories such as ``optional/`` included) but the job's own."""
    out: dict[str, bytes] = {}
    for e in storage.listdir(root):
        if not prefix and e in NOT_COMPARED:
            continue
        path = storage.join(root, e)
        if storage.isdir(path):
            out.update(tree(path, f"{prefix}{e}/"))
        else:
            out[prefix + e] = storage.read_bytes(path)
    return out


def assert_same_output(got: str, want: str, written_recipe: bool = False) -> None:
    """Every file byte for byte, and the manifests' file lists (sizes and sha256) equal. ``written_recipe``:
    ``got`` (a command line's output) also holds the recipe it ran, which a library call does not write."""
    a, b = tree(got), tree(want)
    if written_recipe:
        recipes = [n for n in a if n.endswith(RECIPE_SUFFIX)]
        assert len(recipes) == 1, sorted(a)
        del a[recipes[0]]
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    for name in b:
        assert a[name] == b[name], name
    ma = json.loads(storage.read_bytes(storage.join(got, MANIFEST_NAME)))
    mb = json.loads(storage.read_bytes(storage.join(want, MANIFEST_NAME)))
    if written_recipe:
        ma["files"] = {k: v for k, v in ma["files"].items() if not k.endswith(RECIPE_SUFFIX)}
    assert ma["files"] == mb["files"] and ma["tensors"] == mb["tensors"]
    report = check_dir(got)
    assert report.ok, report.to_text()
