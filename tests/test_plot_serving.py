"""scripts/plot_serving.py reads every input form it documents and draws a real PNG."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plot_serving", REPO / "scripts" / "plot_serving.py")
plot_serving = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_serving)


def _level(c: int, tok_s: float, tpot_median: float) -> dict:
    """One concurrency level as scripts/bench_serve.py writes it (the fields plot_serving reads, and others)."""
    return {"concurrency": c, "requests": 32, "wall_s": 1.0, "ttft_ms": {"mean": 2.0, "median": 2.0, "p99": 3.0},
            "tpot_ms": {"mean": tpot_median + 1, "median": tpot_median, "p99": tpot_median * 3},
            "output_token_throughput": tok_s, "request_throughput": 1.0, "goodput": 1.0}


def test_reads_bench_serve_output(tmp_path):
    out = tmp_path / "serve.json"
    out.write_text(json.dumps({"requests": 32, "modes": {"colocated": [_level(1, 108.7, 8.3), _level(4, 201.7, 18.2)],
                                                         "disaggregated": [_level(1, 90.5, 9.9)]}}))
    assert plot_serving.series_of(out) == [
        {"label": "colocated", "points": [{"concurrency": 1, "output_tok_s": 108.7, "median_tpot_ms": 8.3},
                                          {"concurrency": 4, "output_tok_s": 201.7, "median_tpot_ms": 18.2}]},
        {"label": "disaggregated", "points": [{"concurrency": 1, "output_tok_s": 90.5, "median_tpot_ms": 9.9}]}]


def test_reads_the_checked_in_bench_serve_output():
    """benchmarks/serve.json (whatever its figures): one line per mode, one point per level it holds."""
    path = REPO / "benchmarks" / "serve.json"
    modes = json.loads(path.read_text())["modes"]
    series = plot_serving.series_of(path)
    assert [s["label"] for s in series] == list(modes)
    for s in series:
        assert [p["concurrency"] for p in s["points"]] == [lv["concurrency"] for lv in modes[s["label"]]]
        assert all(p["output_tok_s"] > 0 and p["median_tpot_ms"] > 0 for p in s["points"])


def test_reads_vllm_result_folder_as_medians(tmp_path):
    runs = tmp_path / "vllm-cpu"
    runs.mkdir()
    for i, (c, tok, tpot) in enumerate([(1, 500, 1.7), (1, 530, 1.6), (1, 560, 1.5), (4, 1200, 2.7)]):
        (runs / f"r{i}.json").write_text(json.dumps({"max_concurrency": c, "output_throughput": tok,
                                                     "median_tpot_ms": tpot}))
    (s,) = plot_serving.series_of(runs)
    assert s == {"label": "vllm-cpu", "points": [{"concurrency": 1, "output_tok_s": 530, "median_tpot_ms": 1.6},
                                                 {"concurrency": 4, "output_tok_s": 1200, "median_tpot_ms": 2.7}]}


def test_refuses_what_it_cannot_read(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="x.json: neither a series file nor bench_serve output"):
        plot_serving.series_of(bad)
    assert plot_serving.main([str(tmp_path / "o.png"), str(bad)]) == 2
    with pytest.raises(ValueError, match="x.json: not a vllm bench serve result .no max_concurrency"):
        plot_serving.series_of(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty: no vllm bench serve result"):
        plot_serving.series_of(empty)


def test_plots_a_series_file(tmp_path):
    from PIL import Image

    series = tmp_path / "series.json"
    series.write_text(json.dumps({"series": [
        {"label": label, "points": [{"concurrency": c, "output_tok_s": tok * c, "median_tpot_ms": 1.0 + c / 4}
                                    for c in (1, 4, 8, 16)]} for label, tok in (("a", 500.0), ("b", 600.0))]}))
    out = tmp_path / "vs.png"
    assert plot_serving.main([str(out), str(series)]) == 0
    img = Image.open(io.BytesIO(out.read_bytes()))
    assert img.format == "PNG" and img.size == (1100, 440)
