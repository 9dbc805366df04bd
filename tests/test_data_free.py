"""A recipe that reads no activation statistic (W8A8_DYNAMIC everywhere, no FA3, no smoothing) quantizes
without calibration: no forward, no calibration data, no tokenizer; the weights are the calibrated run's
byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.config import DeepseekV3Config
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from tiny import FIXTURES, TINY_FIXTURE
from pipeline.io.checkpoint import read_model_config

DATA_FREE = Recipe(dynamic=True, fa_quant=False)


@pytest.fixture(scope="module")
def cfg() -> DeepseekV3Config:
    return read_model_config(str(TINY_FIXTURE / "config.json"))


def test_which_recipes_need_calibration(cfg):
    assert Recipe().needs_calibration(cfg)                                  # static attention, FA3
    assert Recipe(dynamic=True).needs_calibration(cfg)                      # FA3 alone needs its scales
    assert Recipe(fa_quant=False).needs_calibration(cfg)                    # static linears need theirs
    assert not DATA_FREE.needs_calibration(cfg)
    assert Recipe(dynamic=True, fa_quant=True, fa_exclude_layers=(0, 1, 2, 3)).needs_calibration(cfg) is False
    assert Recipe(dynamic=True, fa_quant=False, smooth=True).needs_calibration(cfg)


def test_data_free_job_needs_no_data_and_writes_the_calibrated_weights(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    for f in ("config.json", "model.safetensors"):                          # no tokenizer files at all
        shutil.copy(TINY_FIXTURE / f, src / f)
    lines: list[str] = []
    opts = QuantizeOptions(calib_path=str(tmp_path / "no-such-calibration.json"), progress=False)
    summary = quantize_checkpoint(str(src), str(tmp_path / "free"), DATA_FREE, opts, log=lines.append)
    assert any(m.startswith("data-free: ") for m in lines) and not any("calibrating" in m for m in lines)
    assert any("warning:" in m and "no tokenizer.json" in m for m in lines)
    assert summary["calibration_s"] < 5

    # the same recipe forced through calibration (with real data and a tokenizer): the same weight bytes
    monkeypatch.setattr(Recipe, "needs_calibration", lambda self, cfg: True)
    quantize_checkpoint(str(TINY_FIXTURE), str(tmp_path / "calibrated"), DATA_FREE,
                        QuantizeOptions(calib_path=str(FIXTURES / "calib.json"), progress=False), log=lines.append)
    shards = sorted(p.name for p in (tmp_path / "free").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "calibrated").glob("*.safetensors"))
    for name in shards + ["quant_model_description.json"]:
        assert (tmp_path / "free" / name).read_bytes() == (tmp_path / "calibrated" / name).read_bytes(), name
    assert not (tmp_path / "free" / "tokenizer.json").exists()
    assert Path(tmp_path / "calibrated" / "tokenizer.json").exists()
