"""msModelSlim's ``--quant_mtp none``: the MTP layer is not read, calibrated or written, config.json is the
source's. The output's main layers are the ``float`` output's byte for byte; the checker accepts it ("MTP
layer: not carried"); the engine, fake-quant and jobs.generate run it without MTP, giving the float-MTP
output's greedy tokens; MTP drafting asked of it is a one-line error naming the flag and the directory; the
written recipe reruns to the same output."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from actors.serving.serve_config import ServeConfig, check_model_dir
from distributed import quiet, tree
from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.engine.config import EngineConfig
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine.core.reference import generate_ids
from pipeline.engine.protocol import SamplingParams
from pipeline.engine.worker.loader import carries_mtp
from pipeline.format.checker import check_dir
from pipeline.format.description import DESCRIPTION_NAME, MANIFEST_NAME
from pipeline.io.checkpoint import CheckpointReader
from pipeline.quant.evaluation.fakequant import load_fakequant_model
from pipeline.quant.writing.output_files import RECIPE_SUFFIX
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from tiny import FIXTURES, TINY_FIXTURE

MTP = "model.layers.3."          # both models: 3 main layers, the MTP layer 3
PROMPT = [1, 17, 42, 99, 7, 256, 3]
GREEDY = SamplingParams(max_new_tokens=16)


def tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def description(path) -> dict:
    return json.loads((Path(path) / DESCRIPTION_NAME).read_text())


def assert_main_layers_equal(none: str, float_out: str) -> None:
    """``none`` holds exactly ``float_out``'s tensors and description entries but the MTP layer's, each the
    same bytes; config.json is the same file."""
    a, b = tensors(none), tensors(float_out)
    assert not [n for n in a if n.startswith(MTP)] and not [k for k in description(none) if k.startswith(MTP)]
    assert len([n for n in b if n.startswith(MTP)]) > 20
    main = {n: t for n, t in b.items() if not n.startswith(MTP)}
    assert sorted(a) == sorted(main)
    differ = [n for n in a if a[n].dtype != main[n].dtype or a[n].shape != main[n].shape
              or not torch.equal(a[n].view(-1).view(torch.uint8), main[n].view(-1).view(torch.uint8))]
    assert differ == []
    assert description(none) == {k: v for k, v in description(float_out).items() if not k.startswith(MTP)}
    assert (Path(none) / "config.json").read_bytes() == (Path(float_out) / "config.json").read_bytes()


@pytest.fixture(scope="module")
def none_out(tmp_path_factory) -> str:
    dst = str(tmp_path_factory.mktemp("mtp-none") / "q")
    quantize_checkpoint(str(EMBEDDED_MODEL_DIR), dst, Recipe(drop_mtp=True), QuantizeOptions(progress=False),
                        log=quiet)
    return dst


def test_embedded_output_is_the_float_output_less_the_mtp_layer(none_out, embedded_quantized):
    assert_main_layers_equal(none_out, embedded_quantized)
    src = json.loads((Path(EMBEDDED_MODEL_DIR) / "config.json").read_text())
    assert json.loads((Path(none_out) / "config.json").read_text()) == src and src["num_nextn_predict_layers"] == 1
    report = check_dir(none_out)
    assert report.ok, report.to_text()
    assert report.mtp.startswith("not carried") and "MTP layer: not carried" in report.to_text()
    assert check_dir(embedded_quantized).mtp == "carried"


def test_engine_and_fakequant_run_it_without_mtp(none_out, embedded_quantized):
    float_mtp = LLMEngine.from_dir(embedded_quantized, num_blocks=16, mtp=True)
    want = float_mtp.generate([PROMPT], GREEDY)
    assert float_mtp.stats().mtp_drafts > 0
    eng = LLMEngine.from_dir(none_out, num_blocks=16)
    assert eng.generate([PROMPT], GREEDY) == want
    assert eng.loaded.config.num_nextn_predict_layers == 0 and not eng.loaded.model.mtp_layers
    assert eng.stats().mtp_drafts == 0 and set(eng.runner.caches) == {0, 1, 2}
    fq = load_fakequant_model(none_out)
    assert not fq.mtp_layers
    assert generate_ids(fq, PROMPT, GREEDY) == generate_ids(load_fakequant_model(embedded_quantized), PROMPT, GREEDY)


def test_mtp_drafting_asked_of_it_is_one_line(none_out, embedded_quantized, capsys):
    with pytest.raises(ValueError, match=r"^\S+/q: MTP speculative decoding \(--mtp\) needs the MTP layer, which "
                                         r"this checkpoint does not carry; run without --mtp$"):
        LLMEngine.from_dir(none_out, num_blocks=16, mtp=True)
    assert not carries_mtp(none_out) and carries_mtp(embedded_quantized) and carries_mtp(str(EMBEDDED_MODEL_DIR))
    cfg = ServeConfig(model_path=none_out)
    assert check_model_dir(cfg) == "quantized"
    with pytest.raises(ValueError, match=f"^--mtp: {none_out} carries no MTP layer .*serve it without --mtp$"):
        check_model_dir(ServeConfig(model_path=none_out, engine=EngineConfig(mtp=True)))
    from jobs import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert serve.main(["--model-path", none_out, "--mtp", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --mtp: {none_out} carries no MTP layer (quantized with --quant_mtp none, or config.json "
                   "has num_nextn_predict_layers 0); serve it without --mtp"]


def test_generate_cli_runs_it(none_out, capsys):
    from jobs import generate

    assert generate.main(["--model-path", none_out, "--max-new-tokens", "4", "What is a list?"]) == 0
    err = capsys.readouterr().err
    assert "int8 linears" in err and "MTP acceptance" not in err


def test_reader_without_mtp_hides_the_layer():
    full, view = CheckpointReader(str(TINY_FIXTURE)), CheckpointReader(str(TINY_FIXTURE), with_mtp=False)
    assert full.config.num_nextn_predict_layers == 1 and view.config.num_nextn_predict_layers == 0
    assert [n for n in full.tensor_names() if n.startswith(MTP)] and \
        not [n for n in view.tensor_names() if n.startswith(MTP)]
    view.check_headers()
    assert set(view.read_globals()) == set(full.read_globals())


# ----- the command line on the tiny fixture: the legacy defaults (m4 + FA3), rerun from the written recipe --
@pytest.fixture(scope="module")
def tiny_cli(tmp_path_factory):
    """``--quant_mtp none`` and ``float`` outputs of the tiny fixture with the legacy defaults (iter_smooth
    m4, FA3), on four calibration texts."""
    from jobs import quantize

    root = tmp_path_factory.mktemp("tiny-cli")
    calib = root / "calib.json"
    calib.write_text(json.dumps(json.loads((FIXTURES / "calib.json").read_text())[:4]))
    out = {}
    for mode in ("none", "float"):
        out[mode] = str(root / mode)
        argv = ["--model-path", str(TINY_FIXTURE), "--save-path", out[mode], "--calib-data", str(calib),
                "--quant_mtp", mode, "--fa_quant", "--no-progress", "--no-estimate"]
        assert quantize.main(argv) == 0
    return out, calib


def test_cli_none_output_reruns_from_its_recipe(tiny_cli, tmp_path):
    from jobs import quantize

    out, calib = tiny_cli
    assert_main_layers_equal(out["none"], out["float"])
    assert check_dir(out["none"]).ok
    recipe = next(Path(out["none"]).glob(f"*{RECIPE_SUFFIX}"))
    text = recipe.read_text()
    assert "drop_mtp: true" in text and "MTP none" in text and "iter_smooth" in text
    job = json.loads((Path(out["none"]) / MANIFEST_NAME).read_text())["job"]["recipe"]
    assert job["drop_mtp"] is True and job["quantize_mtp"] is False
    again = str(tmp_path / "again")
    assert quantize.main(["--model-path", str(TINY_FIXTURE), "--save-path", again, "--calib-data", str(calib),
                          "--config-path", str(recipe), "--no-progress", "--no-estimate"]) == 0
    a, b = tree(again), tree(out["none"])
    for t in (a, b):
        for name in [n for n in t if n.endswith(RECIPE_SUFFIX)]:
            del t[name]
    assert sorted(a) == sorted(b) and all(a[n] == b[n] for n in b)


def test_evaluate_compares_it_without_mtp_figures(tiny_cli, tmp_path):
    """jobs.evaluate runs the output by fake-quant: its row has no MTP figure (the float model's has)."""
    from jobs import evaluate

    out, calib = tiny_cli
    assert evaluate.main(["--model-path", str(TINY_FIXTURE), "--compare", out["none"], "--dataset", str(calib),
                          "--seq", "64", "--max-tokens", "128", "--variants", "full", "--no-progress",
                          "--no-linears", "--out", str(tmp_path / "eval")]) == 0
    doc = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    rows = {s["output"]: s for s in doc["summary"]}
    assert "mtp_perplexity" in rows["float"] and not [k for k in rows["none"] if k.startswith("mtp")]
    assert rows["none"]["agreement"] > 0.5 and {r["layer"] for r in doc["layers"]} == {0, 1, 2}


def test_fallback_composes_with_it(tiny_cli, tmp_path):
    """--fa-fallback / --linear-fallback on a ``none`` job: the probe and the output leave the MTP layer out,
    the picks are main-layer pieces, and the written recipe records both."""
    from jobs import quantize

    _, calib = tiny_cli
    src = tmp_path / "model"            # a path naming no DeepSeek release: FA3 on every layer
    src.symlink_to(TINY_FIXTURE, target_is_directory=True)
    dst = tmp_path / "q"
    assert quantize.main(["--model-path", str(src), "--save-path", str(dst), "--calib-data", str(calib),
                          "--quant_mtp", "none", "--disable_anti", "--fa-fallback", "1", "--linear-fallback", "1",
                          "--no-progress", "--no-estimate"]) == 0
    report = check_dir(str(dst))
    assert report.ok and report.mtp.startswith("not carried") and len(report.fa_layers) == 2, report.to_text()
    picked = json.loads((dst / "fallback.json").read_text())
    assert picked["fa"]["picked"][0] in (0, 1, 2) and not picked["linear"]["picked"][0].startswith(MTP)
    assert not [k for k in description(dst) if k.startswith(MTP)]
    text = next(dst.glob(f"*{RECIPE_SUFFIX}")).read_text()
    assert "drop_mtp: true" in text and f"fa_exclude_layers:\n  - {picked['fa']['picked'][0]}" in text


def test_cli_refuses_quantize_mtp_with_none(tmp_path, capsys):
    from jobs import quantize

    assert quantize.main(["--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "q"),
                          "--quant_mtp", "none", "--quantize-mtp"]) == 2
    assert "--quantize-mtp quantizes the MTP layer, --quant-mtp none does not" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
