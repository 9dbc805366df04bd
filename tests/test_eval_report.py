"""The accuracy report: names the model without this machine's paths, and writes a real PNG and a
self-contained HTML page beside the markdown."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import pytest

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.quant import eval_report

REPO = Path(__file__).resolve().parents[1]

PPL = [{"variant": "float", "smooth": False, "perplexity": 44.265, "delta_pct": 0.0, "tokens": 17920}] + [
    {"variant": v, "smooth": s, "perplexity": p, "delta_pct": round(100 * (p / 44.265 - 1), 3), "tokens": 17920}
    for (v, s, p) in [("W8A8 + FA3", False, 44.198), ("W8A8 only", False, 44.232), ("FA3 only", False, 44.26),
                      ("W8A8 + FA3", True, 44.217), ("W8A8 only", True, 44.235), ("FA3 only", True, 44.26)]]
SQNR = [{"smooth": s, "layer": layer, "module": f"model.layers.{layer}.{m}", "type": t, "sqnr_db": 30.0 + layer + s}
        for s in (False, True) for layer in range(4)
        for m, t in (("self_attn.q_a_proj", "W8A8"), ("mlp.down_proj", "W8A8_DYNAMIC"))]


@pytest.mark.parametrize("src, cwd, expected", [
    (EMBEDDED_MODEL_DIR, str(REPO), "pipeline/assets/dsv3-tiny-pydoc"),      # inside the repository
    ("/data/models/DeepSeek-V3/", "/home/me/dsquant", "DeepSeek-V3"),         # elsewhere: its name only
    ("s3://bucket/DeepSeek-V3", str(REPO), "s3://bucket/DeepSeek-V3"),        # a URL is not a machine path
])
def test_model_label(src, cwd, expected):
    assert eval_report.model_label(src, cwd) == expected


def test_report_names_no_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    md = eval_report.write_report(str(tmp_path), EMBEDDED_MODEL_DIR, PPL, SQNR, 256)
    assert md.splitlines()[0] == "# Accuracy of W8A8 + FA3 on pipeline/assets/dsv3-tiny-pydoc"
    for name in (eval_report.MD_NAME, eval_report.HTML_NAME):
        text = (tmp_path / name).read_text()
        assert str(REPO) not in text and os.path.expanduser("~") + os.sep not in text
    assert "| W8A8 + FA3 | on | 44.217 | -0.11% |" in md


def test_png_and_html_hold_the_figure(tmp_path):
    from PIL import Image   # matplotlib's own dependency

    eval_report.write_report(str(tmp_path), "s3://b/m", PPL, SQNR, 256)
    png = (tmp_path / eval_report.PNG_NAME).read_bytes()
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.size == (1210, 462)              # 11 x 4.2 in at 110 dpi
    assert len(set(img.convert("L").getdata())) > 10                    # drawn, not blank
    page = (tmp_path / eval_report.HTML_NAME).read_text()
    assert base64.b64encode(png).decode() in page and "<pre>" in page
    assert "src='http" not in page and "href=" not in page              # self-contained
