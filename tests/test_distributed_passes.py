"""msModelSlim's layer-by-layer passes on the stage actors (actors.quantize.pass_stages): the output is the single
process's byte for byte, for 1, 2 and 3 stages, with replicas, for the plain recipe and for recipes with
iter_smooth and with QuaRot + flex_smooth_quant (their norm biases and optional/quarot.safetensors
included); a job that fails in a later stage keeps the earlier stages' shards, and its rerun writes only
the rest; requantize after a change in the last main layer rewrites only that layer."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from actors.quantize.quantize_job import quantize_distributed
from actors.quantize.ray_session import DistOptions, JobFailed
from distributed import OPTS as DIST_OPTS
from distributed import assert_same_output, quiet, reference
from jobs import requantize
from pipeline.format.description import DESCRIPTION_NAME
from pipeline.quant.recipe import modelslim_yaml
from pipeline.quant.job.job_state import SUMMARY_NAME
from pipeline.quant.recipe.recipe import Recipe
from tiny import FIXTURES, TINY_FIXTURE, split_by_layer

pytestmark = pytest.mark.slow
SRC = str(TINY_FIXTURE)
RECIPES = {
    "plain": Recipe(),
    "iter_smooth": modelslim_yaml.load(str(FIXTURES / "recipe-itersmooth.yaml")).recipe,
    "quarot-flex": modelslim_yaml.load(str(FIXTURES / "recipe-quarot-c8.yaml")).recipe,
}


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="module")
def opts(calib4):
    """tests/distributed.py's options on four texts: every test compares runs on the same texts."""
    return dataclasses.replace(DIST_OPTS, calib_path=calib4)


@pytest.fixture(scope="module")
def refs(tmp_path_factory, opts):
    root = tmp_path_factory.mktemp("pass-references")
    return {k: reference(SRC, root / k, r, opts) for k, r in RECIPES.items()}


@pytest.mark.parametrize("stages,replicas,recipe", [(1, 1, "plain"), (3, 1, "plain"), (2, 2, "iter_smooth"),
                                                    (2, 1, "quarot-flex")])
def test_output_is_the_single_process_output(tmp_path, refs, stages, replicas, recipe, opts):
    dst = str(tmp_path / "q")
    events = []
    s = quantize_distributed(SRC, dst, RECIPES[recipe], opts, DistOptions(stages=stages, replicas=replicas,
                                                                          progress_s=60),
                             log=quiet, on_event=lambda kind, info: events.append((kind, info)))
    assert_same_output(dst, str(refs[recipe]))
    assert s["units_written"] == 5 and s["units_kept"] == 0 and len(s["stages"]) == stages
    assert sorted(i["unit"] for k, i in events if k == "unit") == sorted(["globals", "0", "1", "2", "3"])
    again = quantize_distributed(SRC, dst, RECIPES[recipe], opts, DistOptions(stages=stages), log=quiet)
    assert again["status"] == "up-to-date"


def test_a_failed_stage_keeps_the_earlier_shards_and_the_rerun_writes_the_rest(tmp_path, refs, opts):
    src = split_by_layer(TINY_FIXTURE, tmp_path / "src")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    dst = tmp_path / "q"

    def after_stage_0(kind: str, info: dict) -> None:  # stage 1's first layer vanishes once stage 0 is done
        if kind == "unit" and info["unit"] == "1":
            shutil.move(src / "model-layer2.safetensors", hidden / "model-layer2.safetensors")

    with pytest.raises(JobFailed, match=r"stage 1 \(2-2\+norm\+mtp3\).*model-layer2"):
        quantize_distributed(str(src), str(dst), RECIPES["iter_smooth"], opts, DistOptions(stages=2), log=quiet,
                             on_event=after_stage_0)
    assert not (dst / DESCRIPTION_NAME).exists()
    shutil.move(hidden / "model-layer2.safetensors", src / "model-layer2.safetensors")
    s = quantize_distributed(str(src), str(dst), RECIPES["iter_smooth"], opts, DistOptions(stages=2), log=quiet)
    assert s["resumed"] and s["units_written"] == 2 and s["units_kept"] == 3
    assert_same_output(str(dst), str(refs["iter_smooth"]))


def test_requantize_rewrites_only_the_layers_whose_statistics_changed(tmp_path, capsys, opts):
    src = split_by_layer(TINY_FIXTURE, tmp_path / "src")
    dst = tmp_path / "q"
    argv = ["--model-path", str(src), "--save-path", str(dst), "--calib-data", opts.calib_path, "--stages", "2",
            "--shard-size-gb", str(opts.shard_bytes / 2**30), "--disable-anti", "--no-fa-quant"]
    assert requantize.main(argv) == 0
    capsys.readouterr()
    from safetensors.torch import load_file, save_file

    path = src / "model-layer2.safetensors"
    t = load_file(str(path))
    name = next(n for n in t if n.endswith("self_attn.o_proj.weight"))
    t[name] = (t[name].float() * 1.5).to(t[name].dtype)
    save_file(t, str(path), metadata={"format": "pt"})
    assert requantize.main(argv) == 0
    summary = json.loads((dst / SUMMARY_NAME).read_text())
    # layer 2 changed (its o_proj); the MTP layer is FLOAT (no statistics): globals, 0, 1, 3 kept
    assert summary["units_written"] == 1 and summary["units_kept"] == 4, summary
    ran = Recipe.from_dict(json.loads((dst / "manifest.json").read_text())["job"]["recipe"])
    assert_same_output(str(dst), str(reference(str(src), tmp_path / "fresh", ran, opts)), written_recipe=True)
