"""Measured fallback in the quantize job (--fa-fallback / --linear-fallback): on an outlier variant of the
embedded model, auto keeps the costly pieces float and the output gets closer to float by a named margin,
N picks exactly N, none is the job without the flags, and the written recipe reproduces the output."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from jobs import quantize
from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.format.checker import check_dir
from pipeline.format.description import FAQUANT, FLOAT, W8A8, W8A8_DYNAMIC
from pipeline.format.reader import read_quantized
from pipeline.model.loading import load_model
from pipeline.model.perplexity import token_stream
from pipeline.quant.evaluation.evaluate import Candidate, compare, windows_of
from pipeline.quant.evaluation.fakequant import load_fakequant_model
from pipeline.quant.evaluation.fallback import fallback_groups, parse_choice
from pipeline.quant.evaluation.outlier_variant import VariantSpec
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.evaluation.sensitivity import Target
from pipeline.quant.evaluation.variant_writer import write_variant
from pipeline.text import corpus
from pipeline.text.tokenizer import Tokenizer
from tiny import FIXTURES

CALIB = str(FIXTURES / "calib.json")
SEED_FLAGS = ["--fa_quant", "--mindie_format", "--calib-data", CALIB, "--no-progress", "--no-estimate"]
MIN_AGREEMENT_GAIN = 0.05          # auto's held-out agreement over the seed command's, at least
MIN_AUTO_AGREEMENT = 0.93          # and at least this much in absolute terms
ATTN_SQNR_GOAL_DB = 30.0           # auto's lowest per-layer attention SQNR on held-out text (its target: 32 dB
                                   # on the calibration samples)
MAX_SMOOTHED_SHARE = 0.10         # the size goal: linear weights above int8 with the smoothing ladder
WEIGHT_FILES = ("quant_model_description.json", "config.json")


def run(src: Path, dst: Path, *flags: str) -> Path:
    assert quantize.main(["--model-path", str(src), "--save-path", str(dst), *SEED_FLAGS, *flags]) == 0
    report = check_dir(str(dst))
    assert report.ok, report.to_text()            # a fallback output is a clean msModelSlim artifact
    return dst


def members(key: str) -> list[str]:
    """The module names a picked key stands for (one of each expert group)."""
    head, brace, rest = key.partition("{")
    names = [head + m for m in rest.rstrip("}").split(",")] if brace else [key]
    return [n.replace("*", "0") for n in names]


def members_all(key: str, names) -> list[str]:
    """Every module a picked key names, from the written tensors' names."""
    from pipeline.quant.recipe.patterns import selected

    return sorted({n[: -len(".weight")] for n in names if n.endswith(".weight") and selected(n[: -len(".weight")], (key,), ())})


def same_output(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.suffix == ".safetensors") + list(WEIGHT_FILES)
    return names == sorted(p.name for p in b.iterdir() if p.suffix == ".safetensors") + list(WEIGHT_FILES) \
        and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def heldout_windows() -> torch.Tensor:
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    return windows_of(token_stream(tok, [d.text for d in corpus.load_heldout(EMBEDDED_MODEL_DIR)[1]]), 128,
                      max_windows=8)


@torch.no_grad()
def heldout_figures(src: Path, out: Path) -> tuple[float, float]:
    """Teacher-forced agreement with float and perplexity change (%) on held-out windows, computed here."""
    win = heldout_windows()
    ref, q = load_model(str(src), dtype=torch.float32, device="cpu"), load_fakequant_model(str(out))
    agree, nll_f, nll_q = 0, 0.0, 0.0
    for x in win:
        x = x[None]
        lf, lq = ref(x[:, :-1]).float().log_softmax(-1), q(x[:, :-1]).float().log_softmax(-1)
        agree += (lf.argmax(-1) == lq.argmax(-1)).sum().item()
        nll_f -= lf.gather(-1, x[:, 1:, None]).sum().item()
        nll_q -= lq.gather(-1, x[:, 1:, None]).sum().item()
    n = win.shape[0] * (win.shape[1] - 1)
    return agree / n, 100 * (math.exp((nll_q - nll_f) / n) - 1)


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fallback")
    src = d / "variant"
    write_variant(EMBEDDED_MODEL_DIR, str(src), VariantSpec(seed=11), log=lambda m: None)
    return d, src, run(src, d / "seed"), run(src, d / "auto", "--fa-fallback", "auto", "--linear-fallback", "auto")


def test_auto_keeps_the_costly_pieces_float_and_improves(outs):
    d, src, seed, auto = outs
    report = json.loads((auto / "fallback.json").read_text())
    fa, lin, dyn = report["fa"]["picked"], report["linear"]["picked"], report["linear"]["dynamic"]
    assert fa or lin or dyn
    assert report["target"] == {"min_agreement": 0.98, "max_ppl_delta_pct": 1.0, "min_attn_sqnr_db": 32.0}
    assert report["with_fallback"]["min_attn_sqnr_db"] >= 32.0 > report["quantized"]["min_attn_sqnr_db"]
    _, types, _ = read_quantized(str(auto))
    for i in fa:                                    # no FA3 tensors there; the seed output has them
        assert f"model.layers.{i}.self_attn.fa_k.scale" not in types
    assert all(types.get(f"model.layers.{i}.self_attn.fa_k.scale") == FAQUANT
               for i in range(3) if i not in fa)
    seed_types = read_quantized(str(seed))[1]
    for key in lin:                                 # a name, or one pattern for a fused pair
        for prefix in members(key):
            assert types[prefix + ".weight"] == FLOAT and seed_types[prefix + ".weight"] != FLOAT, key
    for key in dyn:                                 # static in the seed output, per-token here
        for prefix in members(key):
            assert types[prefix + ".weight"] == W8A8_DYNAMIC and seed_types[prefix + ".weight"] == W8A8, key
    # the bytes above int8 that fallback.json reports are the written FLOAT weights' bytes above int8
    shapes = {n: t.numel() for n, t in read_quantized(str(auto))[2].items()}
    kept = sum(shapes[m + ".weight"] for key in lin for m in members_all(key, shapes))
    assert report["linear"]["bytes"]["above_int8"] == kept == report["linear"]["search"]["bytes_above_int8"]
    assert report["linear"]["bytes"]["rungs"]["FLOAT"]["bytes"] == 2 * kept
    # the held-out slice validates the pick: the target stands on both
    target = Target(**report["target"])
    for k in ("with_fallback", "with_fallback_heldout"):
        figures = report[k]
        assert figures["agreement"] >= target.min_agreement and figures["ppl_delta_pct"] <= target.max_ppl_delta_pct, k
    assert report["heldout_samples"] > 0 and report["samples"] == 3 * report["heldout_samples"]
    a0, p0 = heldout_figures(src, seed)
    a1, p1 = heldout_figures(src, auto)
    assert a1 >= a0 + MIN_AGREEMENT_GAIN and a1 >= MIN_AUTO_AGREEMENT, (a0, a1)
    assert abs(p1) < abs(p0), (p0, p1)
    res = compare(load_model(str(src), dtype=torch.float32, device="cpu"),
                  [Candidate("auto", "W8A8 + FA3", load_fakequant_model(str(auto), dtype=torch.float32))],
                  heldout_windows(), per_linear=False)
    assert res.summary[1]["min_attn_sqnr_db"] >= ATTN_SQNR_GOAL_DB, res.layers


def test_the_written_recipe_reproduces_the_fallback(outs):
    d, src, _, auto = outs
    yaml_file = next(auto.glob("*_best_practice.yaml"))
    again = d / "again"
    assert quantize.main(["--model-path", str(src), "--save-path", str(again), "--config-path", str(yaml_file),
                          "--calib-data", CALIB, "--mindie-format", "--no-progress", "--no-estimate"]) == 0
    assert same_output(auto, again)


def test_the_ladder_smooths_the_mlp_input_and_keeps_fewer_bytes(outs):
    """auto smooths the MLP input of the layers where that lowers the measured MLP error (here all: the
    variant plants outliers in every post-attention norm), the written recipe names them, and the output
    keeps fewer linear weights above int8 than the ladder without the smoothing (measured 4.2% against
    47.2%), within the issue's 10%."""
    from pipeline.quant.evaluation.fallback.share import output_share

    d, src, _, auto = outs
    report = json.loads((auto / "fallback.json").read_text())
    ms = report["mlp_smooth"]
    assert ms["kept"] == ms["candidates"] == [0, 1, 2]
    assert all(e["with"] < e["without"] for e in ms["mlp_error"].values())
    written = yaml.safe_load(next(auto.glob("*_best_practice.yaml")).read_text())
    assert written["dsquant"]["mlp_smooth_layers"] == ms["kept"]
    plain = run(src, d / "auto-nosmooth", "--fa-fallback", "auto", "--linear-fallback", "auto",
                "--fallback-mlp-smooth", "none")
    assert "mlp_smooth" not in json.loads((plain / "fallback.json").read_text())
    with_, without = output_share(str(auto))["share"], output_share(str(plain))["share"]
    assert with_ <= MAX_SMOOTHED_SHARE < without, (with_, without)


def test_n_picks_exactly_n(outs):
    d, src, _, _ = outs
    out = run(src, d / "n", "--fa_fallback", "1", "--linear_fallback", "2")
    report = json.loads((out / "fallback.json").read_text())
    assert len(report["fa"]["picked"]) == 1 and len(report["linear"]["picked"]) == 2
    assert report["fa"]["picked"] == [report["fa"]["costs"][0]["key"]]
    assert report["linear"]["picked"] == [c["key"] for c in report["linear"]["costs"][:2]]


def test_none_is_the_job_without_the_flags(outs):
    d, src, seed, _ = outs
    out = run(src, d / "none", "--fa-fallback", "none", "--linear-fallback", "none")
    assert same_output(seed, out) and not (out / "fallback.json").exists()
    assert next(out.glob("*_best_practice.yaml")).read_bytes() == next(seed.glob("*_best_practice.yaml")).read_bytes()


def test_overwrite_replaces_a_fallback_output(outs):
    """fallback.json belongs to the output it sits in: --overwrite replaces it, and an output written
    without the flags leaves none behind."""
    d, src, seed, auto = outs
    again = d / "over"
    shutil.copytree(auto, again)
    run(src, again, "--overwrite")
    assert same_output(seed, again) and not (again / "fallback.json").exists()


def test_q_a_and_kv_a_fall_back_together():
    names = [f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")]
    names += [f"model.layers.1.mlp.experts.{e}.down_proj" for e in range(3)]
    groups = fallback_groups(names)
    assert groups["model.layers.1.self_attn.{q_a_proj,kv_a_proj_with_mqa}"] == \
        ["model.layers.1.self_attn.q_a_proj", "model.layers.1.self_attn.kv_a_proj_with_mqa"]
    assert groups["model.layers.0.self_attn.o_proj"] == ["model.layers.0.self_attn.o_proj"]
    assert len(groups["model.layers.1.mlp.experts.*.down_proj"]) == 3 and len(groups) == 5
    assert sorted(n for g in groups.values() for n in g) == sorted(names)
    # the key is a rule pattern matching exactly its members
    from pipeline.quant.recipe.patterns import selected
    for key, group in groups.items():
        assert [n for n in names if selected(n, (key,), ())] == group


@pytest.mark.parametrize("text, want", [("auto", "auto"), ("AUTO", "auto"), ("none", None), ("3", 3), ("0", 0)])
def test_choice_parsing(text, want):
    assert parse_choice(text, "--fa-fallback") == want


def test_bad_values_are_one_line(capsys, tmp_path):
    with pytest.raises(QuantError, match=r"--fa-fallback: expected auto, none or a count such as 3, got 'abc'"):
        parse_choice("abc", "--fa-fallback")
    assert quantize.main(["--save-path", str(tmp_path / "x"), "--linear-fallback", "-1"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: --linear-fallback: expected auto, none or a count such as 3, got '-1'"
    assert quantize.main(["--save-path", str(tmp_path / "x"), "--fa-fallback", "9", "--calib-data", CALIB,
                          "--no-progress", "--no-estimate"]) == 2
    assert "--fa-fallback 9: the recipe quantizes only 3 FA3 layers" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_target_parsing():
    from pipeline.quant.evaluation.fallback import TARGET, parse_target, target_text

    assert parse_target("agreement=0.98,ppl=1.0,sqnr=32") == TARGET
    assert parse_target(target_text(TARGET)) == TARGET and f"default {target_text(TARGET)})" in \
        " ".join(quantize.build_parser().format_help().split())          # the job's help says the default
    assert parse_target("sqnr=30") == Target(min_attn_sqnr_db=30.0)
    assert parse_target("agreement=0.99,ppl=0.5,kl=0.01") == Target(0.99, 0.01, 0.5)
    for bad, msg in (("agreement=2", "min_agreement must be in"), ("foo=1", "got 'foo=1'"), ("ppl", "got 'ppl'"),
                     ("ppl=nan", "finite number")):
        with pytest.raises(QuantError, match=msg):
            parse_target(bad)


def test_float_weights_are_what_the_probe_quantized(tmp_path):
    """The probe's on_layer hook keeps each quantized linear's float weight as the recipe quantizes it
    (smoothed, not the source's): quantized per channel again, it gives the written int8 weight exactly;
    installed, it replaces the dequantized placeholder, so a linear that falls back is measured in float."""
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.quant.evaluation.fallback import FloatWeights
    from pipeline.quant.numerics.qparams import quantize_weight_per_channel
    from pipeline.quant.recipe.recipe import Recipe
    from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
    from pipeline.quant.recipe.steps import IterSmooth

    src, dst = tmp_path / "variant", tmp_path / "q"
    write_variant(EMBEDDED_MODEL_DIR, str(src), VariantSpec(seed=12), log=lambda m: None, check=False)
    recipe = Recipe(steps=(IterSmooth(alpha=0.5, symmetric=False, enable_subgraph_type=("norm-linear", "ov")),))
    weights = FloatWeights(CheckpointReader(str(src)).config, recipe)
    quantize_checkpoint(str(src), str(dst), recipe, QuantizeOptions(calib_path=CALIB, estimate=False),
                        log=lambda m: None, on_layer=weights)
    _, types, tensors = read_quantized(str(dst))
    quantized = sorted(n for n, k in types.items() if n.endswith(".weight") and k not in (FLOAT, FAQUANT))
    assert quantized and sorted(n for n in weights.tensors if n.endswith(".weight")) == quantized
    source = load_model(str(src), dtype=torch.bfloat16, device="cpu").state_dict()
    moved = 0
    for name in quantized:
        q, ws, _ = quantize_weight_per_channel(weights.tensors[name], name)
        assert torch.equal(q, tensors[name]), name
        moved += not torch.equal(weights.tensors[name], source[name])
    assert moved > 0                                      # the smoothing is in them
    model = load_fakequant_model(str(dst), w8a8=False, fa3=False)
    weights.install(model)
    for name in quantized:
        assert torch.equal(model.get_parameter(name), weights.tensors[name].float()), name
