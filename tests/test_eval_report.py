"""The accuracy report: names the model without this machine's paths, and writes a real PNG and a
self-contained HTML page beside the markdown."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import pytest

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.quant.evaluation import eval_report

from pipeline.quant.evaluation.evaluate import EvalResult

REPO = Path(__file__).resolve().parents[1]

FLOAT_ROW = {"output": "float", "variant": "float", "tokens": 17920, "perplexity": 44.265,
             "perplexity_delta_pct": 0.0, "agreement": 1.0, "kl_mean": 0.0, "kl_p99": 0.0}
SUMMARY = [FLOAT_ROW] + [
    {"output": o, "variant": "W8A8 + FA3", "tokens": 17920, "perplexity": p,
     "perplexity_delta_pct": round(100 * (p / 44.265 - 1), 3),
     "agreement": a, "kl_mean": kl, "kl_p99": 10 * kl, "min_attn_sqnr_db": 31.5, "min_attn_layer": 2,
     "min_latent_sqnr_db": 40.1}
    for o, p, a, kl in (("plain", 44.198, 0.97, 0.004), ("variant-s1", 52.1, 0.79, 0.21))]
LAYERS = [{"output": o, "variant": "W8A8 + FA3", "layer": i, "attn_sqnr_db": 30.0 + i, "attn_sqnr_cum_db": 29.0 + i,
           "latent_sqnr_db": None if i == 3 else 40.0} for o in ("plain", "variant-s1") for i in range(4)]
LINEARS = [{"output": o, "variant": "W8A8 + FA3", "layer": i, "module": f"model.layers.{i}.{m}", "type": t,
            "sqnr_db": 30.0 + i, "reference": "float", "weight_sqnr_db": 42.0, "tokens": 100}
           for o in ("plain", "variant-s1") for i in range(4)
           for m, t in (("self_attn.q_a_proj", "W8A8"), ("mlp.down_proj", "W8A8_DYNAMIC"))]
RESULT = EvalResult(SUMMARY, LAYERS, LINEARS, 17920, 256)


@pytest.mark.parametrize("src, cwd, expected", [
    (EMBEDDED_MODEL_DIR, str(REPO), "pipeline/assets/dsv3-tiny-pydoc"),      # inside the repository
    ("/data/models/DeepSeek-V3/", "/home/me/dsquant", "DeepSeek-V3"),         # elsewhere: its name only
    ("s3://bucket/DeepSeek-V3", str(REPO), "s3://bucket/DeepSeek-V3"),        # a URL is not a machine path
])
def test_model_label(src, cwd, expected):
    assert eval_report.model_label(src, cwd) == expected


def test_report_names_no_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    md = eval_report.write_report(str(tmp_path), EMBEDDED_MODEL_DIR, RESULT, "heldout.json")
    assert md.splitlines()[0] == "# Accuracy against the float model pipeline/assets/dsv3-tiny-pydoc"
    for name in (eval_report.MD_NAME, eval_report.HTML_NAME):
        text = (tmp_path / name).read_text()
        assert str(REPO) not in text and os.path.expanduser("~") + os.sep not in text
    assert "| variant-s1 | W8A8 + FA3 | 52.100 | +17.70% | 79.00% | 0.21000 | 2.1000 | 31.5 (2) | 40.1 |" in md
    assert "| plain | W8A8 + FA3 | 3 | 33.0 | 32.0 | n/a |" in md
    assert "| plain | W8A8 + FA3 | W8A8_DYNAMIC | 4 | 30.0 | 32.0 | 4/4 |" in md


def test_png_and_html_hold_the_figure(tmp_path):
    from PIL import Image   # matplotlib's own dependency

    eval_report.write_report(str(tmp_path), "s3://b/m", RESULT, "d.jsonl")
    png = (tmp_path / eval_report.PNG_NAME).read_bytes()
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.size == (1200, 800)              # 12 x 8 in at 100 dpi
    assert len(set(img.convert("L").getdata())) > 10                    # drawn, not blank
    page = (tmp_path / eval_report.HTML_NAME).read_text()
    assert base64.b64encode(png).decode() in page and "<pre>" in page
    assert "src='http" not in page and "href=" not in page              # self-contained
