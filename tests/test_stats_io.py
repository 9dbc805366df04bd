"""Calibration statistics persisted to Parquet come back bit-identical (also over memory://)."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.loading import load_model
from pipeline.quant.calibration.calib_data import load_texts, tokenize
from pipeline.quant.calibration.calibrate import collect_stats
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.transforms.smooth import collect_smoothing_stats
from pipeline.quant.job.stats_io import load_calibration, save_calibration
from pipeline.text.tokenizer import Tokenizer
from tiny import FIXTURES, TINY_FIXTURE


@pytest.mark.parametrize("where", ["file", "memory"])
def test_real_statistics_round_trip(tmp_path, where):
    tok = Tokenizer.from_dir(str(TINY_FIXTURE))
    samples = tokenize(load_texts(str(FIXTURES / "calib.json"))[:3], tok, max_tokens=512, add_bos=False)
    model = load_model(str(TINY_FIXTURE), dtype="bfloat16", device="cpu")
    with torch.inference_mode():
        stats = collect_stats(model, samples, Recipe(quantize_mtp=True))
        smooth = collect_smoothing_stats(model, samples)
    path = str(tmp_path / "calib.parquet") if where == "file" else "memory://stats-io/calib.parquet"
    save_calibration(path, stats, smooth, meta={"source": "tiny", "recipe": Recipe().to_dict()})
    got, got_smooth, meta = load_calibration(path)
    assert got == stats
    assert set(got_smooth) == set(smooth)
    for k in smooth:
        assert torch.equal(got_smooth[k].value, smooth[k].value.float()), k
    assert meta["source"] == "tiny" and meta["recipe"]["fa_quant"] is True


def test_bad_file_is_named(tmp_path):
    p = tmp_path / "x.parquet"
    p.write_bytes(b"not parquet")
    with pytest.raises(QuantError, match=f"{p}: not a readable calibration statistics file"):
        load_calibration(str(p))
