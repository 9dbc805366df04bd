"""The distributed job with a data-free recipe (W8A8_DYNAMIC everywhere, no FA3, no smoothing) on the
simulated Ray cluster (conftest's ``ray_cluster``): no calibration forward at all (no sample event, no
stage loads its layers, no forward time on any actor), no calibration data and no tokenizer read (a
source without tokenizer files is quantized, with a warning), one log line saying so, and the output
byte for byte the single-process data-free output; the CLI form too."""

from __future__ import annotations

import json
import shutil

import pytest

from actors.quantize.quantize_job import quantize_distributed
from actors.quantize.ray_session import DistOptions
from distributed import OPTS, assert_same_output, quiet, reference
from pipeline.quant.job.job_state import CALIBRATION_NAME, STATE_DIR, SUMMARY_NAME
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions
from tiny import TINY_FIXTURE

pytestmark = pytest.mark.slow
DATA_FREE = Recipe(dynamic=True, fa_quant=False)
NO_DATA = "no-such-calibration.json"  # a calibration path that does not exist: reading it would fail


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="module")
def bare_source(tmp_path_factory):
    """The tiny fixture without its tokenizer files."""
    src = tmp_path_factory.mktemp("bare") / "src"
    src.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(TINY_FIXTURE / f, src / f)
    return src


@pytest.fixture(scope="module")
def single(bare_source, tmp_path_factory):
    """The single-process data-free output of the bare source."""
    opts = QuantizeOptions(calib_path=str(bare_source / NO_DATA), shard_bytes=OPTS.shard_bytes, progress=False)
    return reference(str(bare_source), tmp_path_factory.mktemp("single") / "q", DATA_FREE, opts)


@pytest.mark.parametrize("stages", [1, 3])
def test_no_calibration_forward_and_the_single_process_bytes(bare_source, single, tmp_path, stages):
    dst = tmp_path / "q"
    lines: list[str] = []
    events: list[tuple[str, dict]] = []
    opts = QuantizeOptions(calib_path=str(tmp_path / NO_DATA), shard_bytes=OPTS.shard_bytes, progress=False)
    s = quantize_distributed(str(bare_source), str(dst), DATA_FREE, opts, DistOptions(stages=stages, progress_s=60),
                             log=lines.append, on_event=lambda kind, info: events.append((kind, info)))
    assert_same_output(str(dst), str(single))
    assert not (dst / "tokenizer.json").exists()

    free = [m for m in lines if m.startswith("data-free: ")]
    assert len(free) == 1 and "no calibration" in free[0], lines
    assert any(m.startswith("warning:") and "no tokenizer.json" in m for m in lines), lines
    assert not any(m.startswith("calibration") for m in lines), lines
    assert not [e for e in events if e[0] == "sample"]              # no (sample, stage) forward ran
    assert len([e for e in events if e[0] == "unit"]) == 5          # globals, 3 layers, MTP

    assert s["samples"] == 0 and s["calibration"] == "none (data-free recipe)"
    assert not {"load_s", "calibration_stats_s", "calibration_smooth_s"} & set(s["phases"])
    assert len(s["actors"]) == stages
    for a in s["actors"]:  # no stage loaded its layers, none ran a forward; every unit read from the source
        assert a["busy_s"]["load"] == 0 and a["busy_s"]["forward"] == 0, a
        assert a["units_from_memory"] == 0, a
    assert not (dst / STATE_DIR / CALIBRATION_NAME).exists()        # nothing to save, nothing to reuse
    assert json.loads((dst / SUMMARY_NAME).read_text())["samples"] == 0

    again = quantize_distributed(str(bare_source), str(dst), DATA_FREE, opts, DistOptions(stages=stages), log=quiet)
    assert again["status"] == "up-to-date"


def test_cli_data_free_distributed(bare_source, single, tmp_path, capsys):
    from jobs import quantize

    dst = tmp_path / "q"
    argv = ["--model-path", str(bare_source), "--save-path", str(dst), "--calib-data", str(tmp_path / NO_DATA),
            "--dynamic", "--no-fa-quant", "--disable-anti", "--no-progress", "--shard-size-gb", str(OPTS.shard_bytes / 2**30),
            "--stages", "2"]
    assert quantize.main(argv) == 0
    out = capsys.readouterr().out
    assert "data-free: " in out and "done: " in out, out
    assert_same_output(str(dst), str(single), written_recipe=True)


def test_a_recipe_with_statistics_still_needs_its_data(bare_source, tmp_path):
    """Only the data-free recipe skips the data: FA3 alone (dynamic linears) still reads the calibration
    texts and the tokenizer, and names the missing file before Ray starts."""
    opts = QuantizeOptions(calib_path=str(tmp_path / NO_DATA), shard_bytes=OPTS.shard_bytes)
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        quantize_distributed(str(bare_source), str(tmp_path / "q"), Recipe(dynamic=True), opts,
                             DistOptions(stages=1), log=quiet)
    assert not (tmp_path / "q").exists() or not any((tmp_path / "q").iterdir())
