"""``--quant_mtp none`` (``Recipe.drop_mtp``) in the distributed job: the stage actors neither load nor
calibrate the MTP layer, the last stage owns no MTP unit, and the output is the single process's byte for
byte (msModelSlim's layer-by-layer passes with QuaRot + flex_smooth_quant, and the float calibration's
pipelined stages); a rerun is up to date, and a run resumed after a lost shard rewrites that unit only."""

from __future__ import annotations

import dataclasses
import json

import pytest

from actors.quantize.quantize_job import quantize_distributed
from actors.quantize.ray_session import DistOptions
from distributed import OPTS, assert_same_output, quiet, reference
from pipeline.format.description import DESCRIPTION_NAME
from pipeline.quant.recipe import modelslim_yaml
from pipeline.quant.recipe.recipe import Recipe
from tiny import FIXTURES, TINY_FIXTURE

pytestmark = pytest.mark.slow
SRC = str(TINY_FIXTURE)
RECIPES = {
    "quarot-flex": dataclasses.replace(modelslim_yaml.load(str(FIXTURES / "recipe-quarot-c8.yaml")).recipe,
                                       quantize_mtp=False, drop_mtp=True),
    "float-calibration": Recipe(calibration="float", drop_mtp=True),
}


@pytest.fixture(scope="module")
def opts(tmp_path_factory):
    calib = tmp_path_factory.mktemp("calib") / "calib.json"
    calib.write_text(json.dumps(json.loads((FIXTURES / "calib.json").read_text())[:4]))
    return dataclasses.replace(OPTS, calib_path=str(calib))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_two_stages_give_the_single_process_output_and_resume(ray_cluster, tmp_path, opts, recipe):
    want = reference(SRC, tmp_path / "ref", RECIPES[recipe], opts)
    assert not [k for k in json.loads((want / DESCRIPTION_NAME).read_text()) if k.startswith("model.layers.3.")]
    dst = tmp_path / "q"
    s = quantize_distributed(SRC, str(dst), RECIPES[recipe], opts, DistOptions(stages=2), log=quiet)
    assert_same_output(str(dst), str(want))
    assert s["units_written"] == 4 and s["stages"] == ["embed+0-1", "2-2+norm"], s["stages"]
    again = quantize_distributed(SRC, str(dst), RECIPES[recipe], opts, DistOptions(stages=2), log=quiet)
    assert again["status"] == "up-to-date"
    last = sorted(dst.glob("*.safetensors"))[-1]
    last.unlink()
    s = quantize_distributed(SRC, str(dst), RECIPES[recipe], opts, DistOptions(stages=2), log=quiet)
    assert s["units_written"] == 1 and s["units_kept"] == 3, s
    assert_same_output(str(dst), str(want))
