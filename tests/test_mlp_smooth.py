"""MLP input smoothing (pipeline.quant.transforms.mlp_smooth): on the outlier variant of tests/test_fallback.py
the transform keeps the float model's function bit for bit and flattens the norm's planted channels; the
quantize job's ``--mlp-smooth-layers`` writes a clean output of the same types that its recipe reproduces,
closer to float than the seed command's, which the engine serves as fake quantization computes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from jobs import quantize
from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.format.reader import read_quantized
from pipeline.model.loading import load_model
from pipeline.quant.evaluation.outlier_variant import VariantSpec
from pipeline.quant.evaluation.variant_writer import write_variant
from pipeline.quant.recipe.modelslim_yaml import parse, to_yaml
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.transforms.mlp_smooth import smooth_mlp_input
from pipeline.quant.transforms.smooth import ChannelAbsMax
from test_fallback import heldout_figures, run, same_output

LOGIT_TOL = 0.0            # power-of-two scales: every product is exact, the logits bit-identical
RATIO_BEFORE_MIN = 16.0    # the variant's post-attention norm output: max over median channel range, at least
RATIO_AFTER_MAX = 4.0      # after smoothing (alpha 0.5), at most
MIN_AGREEMENT_GAIN = 0.03  # held-out agreement of the smoothed output over the seed command's (measured 0.06)
LAYERS = "0,1,2"


@pytest.fixture(scope="module")
def variant(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mlp_smooth")
    write_variant(EMBEDDED_MODEL_DIR, str(d / "v"), VariantSpec(seed=11), log=lambda m: None)
    return d / "v"


def _norm_ranges(model, ids) -> tuple[torch.Tensor, dict[int, ChannelAbsMax]]:
    n = model.config.num_hidden_layers
    stats = {i: ChannelAbsMax() for i in range(n)}
    hooks = [model.model.layers[i].post_attention_layernorm.register_forward_hook(
        lambda mod, a, out, s=stats[i]: s.observe(out)) for i in range(n)]
    try:
        with torch.no_grad():
            logits = model(ids)
    finally:
        for h in hooks:
            h.remove()
    return logits, stats


def _ratio(stats: ChannelAbsMax) -> float:
    return (stats.value.max() / stats.value.median()).item()


def test_the_transform_keeps_the_float_function(variant):
    model = load_model(str(variant), dtype=torch.bfloat16, device="cpu")
    cfg = model.config
    ids = torch.arange(3, 131).reshape(1, -1) % cfg.vocab_size
    before, stats = _norm_ranges(model, ids)
    moved = 0
    for i, st in stats.items():
        layer = model.model.layers[i]
        params = {f"model.layers.{i}.{k}": v for k, v in layer.named_parameters()}
        new, s = smooth_mlp_input(params, cfg, i, st.value, 0.5)
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))          # powers of two
        moved += int((s != 1).sum())
        with torch.no_grad():
            for k, v in new.items():
                if v is not params[k]:
                    params[k].copy_(v)
    after, smoothed = _norm_ranges(model, ids)
    assert moved > 0
    torch.testing.assert_close(after.float(), before.float(), rtol=0, atol=LOGIT_TOL)
    for i in stats:
        assert _ratio(stats[i]) >= RATIO_BEFORE_MIN and _ratio(smoothed[i]) <= RATIO_AFTER_MAX, i


def test_the_smoothed_output_is_closer_reproducible_and_served(variant, tmp_path):
    from pipeline.engine.core.engine import LLMEngine
    from pipeline.engine.core.reference import generate_ids
    from pipeline.engine.protocol import SamplingParams
    from pipeline.quant.evaluation.fakequant import load_fakequant_model

    seed = run(variant, tmp_path / "seed")
    out = run(variant, tmp_path / "smoothed", "--mlp-smooth-layers", LAYERS)
    assert read_quantized(str(out))[1] == read_quantized(str(seed))[1]        # every type as the recipe's
    recipe_file = next(out.glob("*_best_practice.yaml"))
    assert yaml.safe_load(recipe_file.read_text())["dsquant"]["mlp_smooth_layers"] == [0, 1, 2]
    again = run(variant, tmp_path / "again", "--config-path", str(recipe_file))
    assert same_output(out, again)
    a0, p0 = heldout_figures(variant, seed)
    a1, p1 = heldout_figures(variant, out)
    assert a1 >= a0 + MIN_AGREEMENT_GAIN and abs(p1) < abs(p0), (a0, a1, p0, p1)
    prompt, params = [1, 17, 42, 99, 7, 256, 3], SamplingParams(max_new_tokens=12)
    want = generate_ids(load_fakequant_model(str(out)), prompt, params)
    assert LLMEngine.from_dir(str(out), num_blocks=16, cache_dtype="float32").generate([prompt], params) == [want]


def test_the_recipe_field_round_trips_and_bad_layers_are_one_line(variant, tmp_path, capsys):
    r = Recipe(mlp_smooth_layers=(2, 1), mlp_smooth_alpha=0.25)
    assert r.mlp_smooth_layers == (1, 2)
    back = parse(yaml.safe_load(to_yaml(r))).recipe
    assert (back.mlp_smooth_layers, back.mlp_smooth_alpha) == ((1, 2), 0.25)
    assert "mlp_smooth_layers" not in Recipe().fingerprint()             # older outputs stay up to date
    assert quantize.main(["--model-path", str(variant), "--save-path", str(tmp_path / "x"), "--no-progress",
                          "--no-estimate", "--mlp-smooth-layers", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: recipe: mlp_smooth_layers [3] are not main layers of the model (0..2; the MTP layer is " \
                  "never smoothed)", err
    assert not (tmp_path / "x").exists()
