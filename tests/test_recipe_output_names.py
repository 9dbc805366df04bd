"""What a recipe may make the job write, and what jobs.check reads: the recipe file written beside the weights
is named by a model name, never a path; a manifest entry that leaves the directory (or is no regular file)
is a violation, never read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from jobs import check as check_job
from jobs import quantize as quantize_job
from pipeline.io import storage
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe_source import RecipeRequest, resolve
from pipeline.config import DeepseekV3Config
from tiny import FIXTURES, TINY_FIXTURE, tiny_config

DATA_FREE = ["--dynamic", "--no-fa-quant", "--disable-anti"]


def recipe_file(tmp_path: Path, model_types) -> str:
    doc = yaml.safe_load((FIXTURES / "recipe-w8a8-fa3.yaml").read_text())
    doc["metadata"] = {"verified_model_types": model_types}
    doc["spec"].pop("dataset", None)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def resolved(path: str, **req):
    lines: list[str] = []
    r = resolve(RecipeRequest(config_path=path, **req), "/models/x", DeepseekV3Config.from_dict(tiny_config()),
                lines.append)
    return r, lines


@pytest.mark.parametrize("bad", ["../../outside", "/tmp/abs", "sub/dir", ".hidden", "", 3, None, ["x"]])
def test_a_model_type_that_is_not_a_name_is_refused_naming_the_field(tmp_path, bad):
    with pytest.raises(QuantError, match=r"metadata\.verified_model_types\[0\]") as e:
        resolved(recipe_file(tmp_path, [bad]))
    assert "r.yaml" in str(e.value)


def test_a_model_type_list_that_is_not_a_list_is_refused(tmp_path):
    with pytest.raises(QuantError, match="verified_model_types: expected a list of model names, got str"):
        resolved(recipe_file(tmp_path, "DeepSeek-V3"))


@pytest.mark.parametrize("name", ["DeepSeek-R1", "MyModel-2.5_b"])
def test_known_and_plain_names_name_the_written_recipe(tmp_path, name):
    r, lines = resolved(recipe_file(tmp_path, [name]))
    assert r.file_name == f"{name}_best_practice.yaml" and not [ln for ln in lines if "warning" in ln]


def test_a_model_type_the_recipe_was_not_verified_for_is_warned_about(tmp_path):
    r, lines = resolved(recipe_file(tmp_path, ["DeepSeek-R1"]), model_type="DeepSeek-V3")
    assert r.model_type == "DeepSeek-V3"
    assert [ln for ln in lines if ln.startswith("warning") and "verified_model_types ['DeepSeek-R1']" in ln
            and "--model-type DeepSeek-V3" in ln], lines


def test_quantize_with_a_path_as_model_type_writes_nothing_anywhere(capsys, tmp_path):
    bad = recipe_file(tmp_path, [str(tmp_path / "elsewhere" / "x")])
    rc = quantize_job.main(["--no-progress", "--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "q"),
                            "--config-path", bad])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "verified_model_types[0]" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


# ----- jobs.check: manifest entries are files of the directory --------------------------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("out") / "q"
    assert quantize_job.main(["--no-progress", "--no-estimate", "--model-path", str(TINY_FIXTURE),
                              "--save-path", str(dst), *DATA_FREE]) == 0
    return dst


@pytest.mark.parametrize("entry", ["/dev/zero", "../outside.yaml", "link.yaml", "optional/../../outside.yaml",
                                   "fifo"])
def test_check_refuses_manifest_entries_outside_the_directory_and_reads_none(capsys, finished, tmp_path,
                                                                             monkeypatch, entry):
    out = tmp_path / "q"
    shutil.copytree(finished, out)
    (tmp_path / "outside.yaml").write_text("secret")
    (out / "link.yaml").symlink_to(tmp_path / "outside.yaml")
    os.mkfifo(out / "fifo")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][entry] = {"size": 0, "sha256": "0" * 64}
    (out / "manifest.json").write_text(json.dumps(manifest))
    read: list[str] = []
    real = storage.file_sha256
    monkeypatch.setattr(storage, "file_sha256", lambda p, *a: read.append(p) or real(p, *a))
    capsys.readouterr()
    assert check_job.main([str(out)]) == 1
    text = capsys.readouterr().out
    assert f"{entry}: " in text and "not read" in text, text
    inside = os.path.realpath(out) + os.sep
    assert read and all(os.path.realpath(p).startswith(inside) and os.path.isfile(p) for p in read), read


# ----- the written recipe pins the data it ran on ------------------------------------------------------------
def test_the_written_recipe_pins_the_calibration_data(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, texts in ((a, ["first run's text"]), (b, ["another directory's text"])):
        d.mkdir()
        (d / "calib.json").write_text(json.dumps(texts))
    monkeypatch.chdir(a)
    first = resolve(RecipeRequest(calib_data="calib.json"), "/models/x", DeepseekV3Config.from_dict(tiny_config()),
                    lambda m: None)
    written = tmp_path / "out" / first.file_name
    written.parent.mkdir()
    written.write_text(first.yaml_text())
    doc = yaml.safe_load(written.read_text())
    assert doc["spec"]["dataset"] == str(a / "calib.json")
    assert doc["dsquant"]["dataset_sha256"] == storage.file_sha256(str(a / "calib.json"))[1]
    monkeypatch.chdir(b)                              # a rerun from elsewhere reads the same file
    again, _ = resolved(str(written))
    assert again.recipe == first.recipe and again.calib_path == str(a / "calib.json")
    (a / "calib.json").write_text(json.dumps(["edited"]))
    with pytest.raises(QuantError, match=r"spec\.dataset .*calib\.json is not the data the recipe was run with"):
        resolved(str(written))
    again, _ = resolved(str(written), calib_data=str(b / "calib.json"))     # said on the command line: used
    assert again.calib_path == str(b / "calib.json")


def test_a_dataset_pin_must_be_a_sha256_of_a_given_dataset(tmp_path):
    doc = yaml.safe_load((FIXTURES / "recipe-w8a8-fa3.yaml").read_text())
    doc["dsquant"] = {"dataset_sha256": "xyz"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(QuantError, match="dsquant.dataset_sha256: expected 64 lowercase hex digits"):
        resolved(str(tmp_path / "r.yaml"))
