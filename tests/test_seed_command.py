"""The seed's command on a 61-layer checkpoint whose path names the model, as msModelSlim's legacy DeepSeek
script runs it: `--model_path F --save_path Q --batch_size 4 --fa_quant --mindie_format` keeps FA3 off the
model's list of layers (R1's or V3's, chosen from the path) and applies the anti-outlier step m4 (iter_smooth:
norm biases in the output) unless `--disable_anti`; the recipe it ran is written next to the weights.

The checkpoint is the tiny fixture's layers repeated to 61 main layers plus the MTP layer (layer 61)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from pipeline.format.checker import check_dir
from pipeline.quant.recipe.presets import FA3_OFF
from tiny import TINY_FIXTURE

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
LAYERS = 61
TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog."]


def repeated(dst: Path) -> Path:
    """The tiny fixture with its dense layer 0 and MoE layers 1, 2 repeated as layers 0..60 (0 dense, the
    rest MoE alternating 1 and 2), and its MTP layer moved to 61."""
    src = load_file(str(TINY_FIXTURE / "model.safetensors"))
    cfg = json.loads((TINY_FIXTURE / "config.json").read_text())
    old_mtp = cfg["num_hidden_layers"]
    out = {k: v for k, v in src.items() if not k.startswith("model.layers.")}
    for i in range(LAYERS + 1):
        j = old_mtp if i == LAYERS else (0 if i == 0 else 1 + (i - 1) % 2)
        p = f"model.layers.{j}."
        out.update({f"model.layers.{i}.{k[len(p):]}": v.clone() for k, v in src.items() if k.startswith(p)})
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_hidden_layers"] = LAYERS
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((TINY_FIXTURE / f).read_bytes())
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    calib = root / "calib.json"
    calib.write_text(json.dumps(TEXTS))
    r1 = repeated(root / "DeepSeek-R1-tiny61")
    v3 = root / "deepseek-v3-tiny61"
    v3.symlink_to(r1, target_is_directory=True)
    return {"R1": r1, "V3": v3, "calib": calib, "root": root}


def seed_command(model: Path, save: Path, calib: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs.quantize", "--model_path", str(model), "--save_path", str(save),
           "--batch_size", "4", "--fa_quant", "--mindie_format", "--calib_file", str(calib), "--no-progress",
           "--no-estimate", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)


@pytest.mark.parametrize("family", ["R1", "V3"])
def test_fa3_stays_off_the_models_list_and_m4_runs(models, family):
    save = models["root"] / f"out-{family}"
    r = seed_command(models[family], save, models["calib"])
    assert r.returncode == 0, r.stderr
    name = {"R1": "DeepSeek-R1", "V3": "DeepSeek-V3"}[family]
    assert f"FA3 off layers {list(FA3_OFF[family])}: {name}'s list" in r.stdout
    report = check_dir(str(save))
    assert report.ok, report.to_text()
    assert report.fa_layers == [i for i in range(LAYERS) if i not in FA3_OFF[family]]  # the MTP layer is float
    desc = json.loads((save / "quant_model_description.json").read_text())
    biased = sorted({int(n.split(".")[2]) for n in desc if n.endswith("input_layernorm.bias")})
    assert biased == list(range(LAYERS))  # m4's shift on every main layer, none on the MTP layer
    written = yaml.safe_load((save / f"{name}_best_practice.yaml").read_text())
    assert written["spec"]["process"][0]["type"] == "iter_smooth"
    assert written["dsquant"]["fa_exclude_layers"] == list(FA3_OFF[family])
    assert json.loads((save / "config.json").read_text())["model_type"] == "deepseekv2"


def test_disable_anti_turns_m4_off(models):
    save = models["root"] / "out-R1-noanti"
    r = seed_command(models["R1"], save, models["calib"], "--disable_anti")
    assert r.returncode == 0, r.stderr
    desc = json.loads((save / "quant_model_description.json").read_text())
    assert not [n for n in desc if n.endswith(".bias")]
    assert check_dir(str(save)).fa_layers == [i for i in range(LAYERS) if i not in FA3_OFF["R1"]]
