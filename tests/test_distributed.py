"""The distributed job on a simulated 3-node Ray cluster (conftest's ``ray_cluster``): output bit-identical to the
single-process path for 1, 2 and 3 stages and for 2 data-parallel replicas, with and without smoothing
and MTP calibration; to and from a real S3 server; a finished job rerun does nothing; requantize after a
source shard changed rewrites only the affected layers; an unrecoverable failure names every failed
shard and leaves nothing that looks complete."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from actors.quantize.quantize_job import quantize_distributed
from actors.quantize.ray_session import DistOptions, JobFailed
from distributed import CALIB_TEXTS, OPTS, PLAIN, SMOOTH_MTP, assert_same_output, quiet, reference
from jobs import requantize
from pipeline.io import storage
from pipeline.format.description import DESCRIPTION_NAME, MANIFEST_NAME, NAMING
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.job_state import STATE_DIR, SUMMARY_NAME
from tiny import TINY_FIXTURE, split_by_layer

pytestmark = pytest.mark.slow
SRC = str(TINY_FIXTURE)


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="module")
def refs(tiny_references):
    return tiny_references


@pytest.mark.parametrize("stages,replicas,recipe", [(1, 1, "plain"), (2, 1, "smooth-mtp"), (3, 1, "plain"),
                                                    (2, 2, "smooth-mtp")])
def test_output_is_the_single_process_output(tmp_path, refs, stages, replicas, recipe):
    r = {"plain": PLAIN, "smooth-mtp": SMOOTH_MTP}[recipe]
    dst = str(tmp_path / "q")
    events = []
    s = quantize_distributed(SRC, dst, r, OPTS, DistOptions(stages=stages, replicas=replicas, progress_s=60),
                             log=quiet, on_event=lambda kind, info: events.append((kind, info)))
    assert_same_output(dst, str(refs[recipe]))
    assert len(s["stages"]) == stages and s["units_written"] == 5 and s["units_kept"] == 0
    passes = 2 if r.smooth else 1
    assert len([e for e in events if e[0] == "sample"]) == passes * CALIB_TEXTS * stages  # each (sample, stage) once
    summary = json.loads((tmp_path / "q" / SUMMARY_NAME).read_text())
    assert len(summary["actors"]) == stages * replicas
    assert all(a["peak_rss"] > 0 and "node_id" in a for a in summary["actors"])
    # each stage quantized at least its first own layer from its calibration weights (the first round of
    # the weight phase gives every actor one of its own; later an idle actor may take a busy stage's unit
    # and read it from the source): both paths are in the identical output above
    assert sum(a["units_from_memory"] for a in summary["actors"]) >= stages, summary["actors"]
    assert {"plan_s", "calibration_stats_s", "weights_s", "finish_s"} <= set(summary["phases"])

    again = quantize_distributed(SRC, dst, r, OPTS, DistOptions(stages=stages, replicas=replicas), log=quiet)
    assert again["status"] == "up-to-date"  # same source, recipe and data: nothing done


def test_object_storage_source_and_destination(s3, refs):
    bucket = s3.bucket("dist")
    src = storage.join(bucket, "tiny")
    for f in sorted(TINY_FIXTURE.iterdir()):
        storage.copy_file(str(f), storage.join(src, f.name))
    dst = storage.join(bucket, "out")
    quantize_distributed(src, dst, PLAIN, OPTS, DistOptions(stages=2, progress_s=60), log=quiet)
    assert_same_output(dst, str(refs["plain"]))
    assert storage.exists(storage.join(dst, STATE_DIR, "calibration.parquet"))


def _scale_layer_file(path, factor: float) -> None:
    t = load_file(str(path))
    name = next(n for n in t if n.endswith("mlp.experts.0.up_proj.weight") or n.endswith("mlp.up_proj.weight"))
    t[name] = (t[name].float() * factor).to(t[name].dtype)
    save_file(t, str(path), metadata={"format": "pt"})


def _job_lines(capsys, dst) -> list[str]:
    """What the job printed, less its word on the recipe it reran (the output's own written recipe, said
    whenever no recipe flag is given: jobs.requantize)."""
    lines = capsys.readouterr().out.strip().splitlines()
    said = [ln for ln in lines if ln.startswith(f"requantize {dst}: recipe ")]
    assert len(said) == 1, lines
    return [ln for ln in lines if ln not in said]


def test_requantize_does_nothing_then_only_the_changed_layers(tmp_path, capsys):
    src = split_by_layer(TINY_FIXTURE, tmp_path / "src")
    dst = tmp_path / "q"
    argv = ["--model-path", str(src), "--save-path", str(dst), "--calib-data", OPTS.calib_path,
            "--shard-size-gb", str(OPTS.shard_bytes / 2**30), "--stages", "2"]
    assert requantize.main(argv) == 0
    first = capsys.readouterr().out.strip().splitlines()
    assert len(first) == 1 and "5 units rewritten, 0 kept" in first[0], first
    assert requantize.main(argv) == 0
    out = _job_lines(capsys, dst)
    assert len(out) == 1 and "up to date" in out[0] and "nothing done" in out[0], out

    _scale_layer_file(src / "model-layer2.safetensors", 1.5)  # the last main layer: stats of 0, 1 unchanged
    weights_before = {p.name: p.stat().st_mtime_ns for p in dst.glob("*.safetensors")}
    assert requantize.main(argv) == 0
    out = _job_lines(capsys, dst)
    assert len(out) == 1 and "source files changed: model-layer2.safetensors" in out[0], out
    summary = json.loads((dst / SUMMARY_NAME).read_text())
    # globals, 0, 1 and the MTP layer kept (FLOAT here: no statistics; its own file unchanged), layer 2 rewritten
    assert summary["units_kept"] == 4 and summary["units_written"] == 1
    index = json.loads((dst / NAMING["seed"].index_name).read_text())["weight_map"]
    unchanged = {index[n] for n in index if n.startswith(("model.layers.0.", "model.layers.1.", "model.embed"))}
    assert all(dst.joinpath(f).stat().st_mtime_ns == weights_before[f] for f in unchanged)  # not rewritten
    ran = Recipe.from_dict(json.loads((dst / MANIFEST_NAME).read_text())["job"]["recipe"])  # the CLI's defaults
    assert_same_output(str(dst), str(reference(str(src), tmp_path / "fresh", ran)), written_recipe=True)


def test_unrecoverable_failure_names_every_failed_shard_and_resume_finishes(tmp_path, refs):
    """After calibration, the source files of the globals and of the (FLOAT) MTP layer vanish: no stage
    holds those units' weights, so the weight phase must read them and fails for both; every other unit
    is written. The job fails naming both units' shards and leaves no index or description; with the
    files back, a rerun writes only those two units."""
    src = split_by_layer(TINY_FIXTURE, tmp_path / "src")
    gone = ["model-globals.safetensors", "model-layer3.safetensors"]
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    dst = tmp_path / "q"
    index = _planned_index(src)
    failing = sorted({f for n, f in index.items() if n.startswith(("model.layers.3.", "model.embed", "model.norm", "lm_head"))})

    def remove_after_calibration(kind, info):
        if kind == "sample" and info["pass"] == "stats" and info["sample"] == CALIB_TEXTS - 1 \
                and info["stage"] == 1:
            for f in gone:
                shutil.move(src / f, hidden / f)

    with pytest.raises(JobFailed) as err:
        quantize_distributed(str(src), str(dst), PLAIN, OPTS, DistOptions(stages=2, progress_s=60), log=quiet,
                             on_event=remove_after_calibration)
    assert len(failing) >= 2 and sorted(err.value.shards) == failing
    assert all(f in str(err.value) for f in failing) and "unit globals" in str(err.value)
    assert not (dst / DESCRIPTION_NAME).exists() and not (dst / NAMING["seed"].index_name).exists()

    for f in gone:
        shutil.move(hidden / f, src / f)
    s = quantize_distributed(str(src), str(dst), PLAIN, OPTS, DistOptions(stages=2), log=quiet)
    assert s["units_written"] == 2 and s["units_kept"] == 3 and s["resumed"]
    assert_same_output(str(dst), str(refs["plain"]))


def _planned_index(src) -> dict[str, str]:
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.quant.writing.shard_layout import checkpoint_shards

    return {s.name: sh.name for sh in checkpoint_shards(CheckpointReader(str(src)), PLAIN, OPTS.shard_bytes)
            for s in sh.specs}


def test_bad_requests_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="stages must be 1..3"):
        quantize_distributed(SRC, str(tmp_path / "q"), PLAIN, OPTS, DistOptions(stages=4), log=quiet)
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        DistOptions(replicas=0)
    (tmp_path / "single").mkdir()
    reference(SRC, tmp_path / "single", PLAIN)
    with pytest.raises(FileExistsError, match="without job state.*overwrite"):
        quantize_distributed(SRC, str(tmp_path / "single"), PLAIN, OPTS, DistOptions(stages=1), log=quiet)


def test_quantize_cli_runs_the_distributed_job(tmp_path, refs, capsys):
    from jobs import quantize

    dst = str(tmp_path / "q")
    argv = ["--model-path", SRC, "--save-path", dst, "--calib-data", OPTS.calib_path, "--no-progress",
            "--shard-size-gb", str(OPTS.shard_bytes / 2**30), "--stages", "2", "--actor-resource", "CPU=0"]
    assert quantize.main(argv[:-2]) == 0
    assert "done: " in capsys.readouterr().out
    # the legacy defaults (anti-outlier m4, V3's FA3 list: "v3" is in the path) ran in the passes on the stages
    ran = Recipe.from_dict(json.loads((tmp_path / "q" / MANIFEST_NAME).read_text())["job"]["recipe"])
    assert ran.steps and ran.fa_exclude_layers == (0, 1, 2) and ran.calibration == "msmodelslim"
    assert_same_output(dst, str(reference(SRC, tmp_path / "ref", ran)), written_recipe=True)
    assert quantize.main(argv[:-1] + ["stage_slot"]) == 2
    assert "--actor-resource wants NAME=N" in capsys.readouterr().err
