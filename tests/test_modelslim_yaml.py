"""msModelSlim's recipe files, presets and the legacy script's flags (pipeline.quant.recipe.modelslim_yaml, presets,
recipe_source): what each resolves to, and one-line errors for what is not understood."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline import layout
from pipeline.config import DeepseekV3Config
from pipeline.format.description import ASCEND_V1, FLOAT, W8A8, W8A8_DYNAMIC
from pipeline.quant.recipe import modelslim_yaml, presets
from pipeline.quant.recipe.linear_rules import default_rules
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.recipe.recipe_source import RecipeRequest, resolve
from pipeline.quant.recipe.steps import FlexSmooth, IterSmooth, QuaRot
from tiny import FIXTURES, tiny_config

RECIPES = sorted(FIXTURES.glob("recipe-*.yaml")) + sorted(FIXTURES.glob("msmodelslim-*/DeepSeek-V3_best_practice.yaml"))
R1_LIST = [0, 1, 2, 46, 47, 50, 54, 55, 56, 57, 58, 59, 60]
V3_LIST = [0, 1, 2, 46, 50, 51, 53, 54, 55, 56, 57, 59, 60]


def cfg(layers: int = 3) -> DeepseekV3Config:
    return DeepseekV3Config.from_dict(tiny_config(num_hidden_layers=layers))


def resolved(model_path: str, layers: int = 61, **req):
    lines: list[str] = []
    r = resolve(RecipeRequest(**req), model_path, cfg(layers), lines.append)
    return r, lines


def write(tmp_path: Path, doc, name: str = "r.yaml") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


def base_doc() -> dict:
    return yaml.safe_load((FIXTURES / "recipe-w8a8-fa3.yaml").read_text())


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_fixture_recipe_parses_and_round_trips(path):
    rf = modelslim_yaml.load(str(path))
    r = rf.recipe
    assert r.rules == default_rules() and r.linear_rules == () and r.fa_quant and r.fa_include == ("*",) and r.quantize_mtp
    assert r.dialect == ASCEND_V1 and rf.dataset == "calib.json" and rf.part_file_size == 4
    kinds = [st.type for st in r.steps]
    assert kinds == {"recipe-itersmooth.yaml": ["iter_smooth"], "recipe-flexsmooth.yaml": ["flex_smooth_quant"],
                     "recipe-quarot-c8.yaml": ["quarot", "flex_smooth_quant"]}.get(path.name, kinds)
    again = modelslim_yaml.parse(yaml.safe_load(modelslim_yaml.to_yaml(r, dataset=rf.dataset,
                                                                        part_file_size=rf.part_file_size)))
    assert again.recipe == r and again.dataset == rf.dataset


def test_step_settings_are_read_as_written():
    it = modelslim_yaml.load(str(FIXTURES / "recipe-itersmooth.yaml")).recipe.steps[0]
    assert it == IterSmooth(alpha=0.5, scale_min=1e-5, symmetric=False, enable_subgraph_type=("norm-linear", "ov"))
    q = modelslim_yaml.load(str(FIXTURES / "recipe-quarot-c8.yaml")).recipe.steps
    assert q == (QuaRot(block_size=16), FlexSmooth(enable_subgraph_type=("norm-linear", "ov")))


def test_rules_decide_each_linears_type_and_the_first_match_wins(tmp_path):
    doc = base_doc()
    doc["spec"]["process"][0]["configs"].insert(0, {
        "type": "linear_quant", "qconfig": doc["default_w8a8_dynamic"], "include": ["model.layers.1.self_attn.o_proj"]})
    r = modelslim_yaml.load(write(tmp_path, doc)).recipe
    c = cfg()
    assert r.layer_types(c, 1)["model.layers.1.self_attn.o_proj"] == W8A8_DYNAMIC
    assert r.layer_types(c, 2)["model.layers.2.self_attn.o_proj"] == W8A8
    assert r.layer_types(c, 2)["model.layers.2.self_attn.kv_b_proj"] == FLOAT
    assert r.layer_types(c, 1)["model.layers.1.mlp.gate"] == FLOAT
    assert r.layer_types(c, 1)["model.layers.1.mlp.experts.0.gate_proj"] == W8A8_DYNAMIC


def test_fa3_patterns_pick_layers(tmp_path):
    doc = base_doc()
    doc["spec"]["process"][1]["exclude"] = ["model.layers.1.*", "model.layers.3.*"]
    r = modelslim_yaml.load(write(tmp_path, doc)).recipe
    assert [r.fa_layer(cfg(), i) for i in range(4)] == [True, False, True, False]


def test_default_recipe_keeps_its_fingerprint():
    """Outputs written before the rule / pattern / step fields existed stay up to date."""
    assert set(Recipe().fingerprint()) == {"fa_quant", "dynamic", "fa_exclude_layers", "quantize_mtp", "dialect",
                                           "smooth", "q_ratio", "k_ratio", "v_ratio",
                                           "calibration"}
    changed = dataclasses.replace(Recipe(), steps=(IterSmooth(),))
    assert changed.fingerprint() != Recipe().fingerprint() and Recipe.from_dict(changed.to_dict()) == changed


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(apiversion="modelslim_v0"), "apiversion must be 'modelslim_v1'"),
    (lambda d: d.update(extra_key=3), "unknown top-level key 'extra_key'"),
    (lambda d: d["spec"].update(runner_x=1), r"spec: unknown key\(s\) \['runner_x'\]"),
    (lambda d: d["spec"]["process"].insert(0, {"type": "gptq"}), "'gptq' is msModelSlim's but not supported"),
    (lambda d: d["spec"]["process"].insert(0, {"type": "frobnicate"}), "unknown process type 'frobnicate'"),
    (lambda d: d["spec"]["process"].insert(0, {"type": "iter_smooth", "alpah": 0.5}), r"unknown key\(s\) \['alpah'\]"),
    (lambda d: d["spec"]["process"].insert(0, {"type": "iter_smooth", "alpha": 2}), "iter_smooth.alpha: must be a number"),
    (lambda d: d["spec"]["process"].insert(0, {"type": "quarot", "block_size": 24}), "power of two"),
    (lambda d: d["spec"]["process"].append({"type": "iter_smooth"}), "iter_smooth after a quantization step"),
    (lambda d: d["spec"]["process"][0]["configs"][1]["qconfig"]["weight"].update(dtype="int4"),
     r"weight.dtype: 'int4' is not supported"),
    (lambda d: d["spec"]["process"][0]["configs"][0]["qconfig"]["act"].update(scope="per_group"),
     r"act: \{'scope': 'per_group'\} is not supported"),
    (lambda d: d["spec"]["process"][1].update(details={"fa_q": {}}), "details: per-branch FA3 settings"),
    (lambda d: d["spec"]["save"][0].update(type="npz_saver"), "type must be one of"),
    (lambda d: d["spec"].update(process=[{"type": "fa3_quant"}]), "no linear_quant"),
    (lambda d: d.update(dsquant={"fa_exclude": 3}), r"dsquant: unknown key\(s\) \['fa_exclude'\]"),
])
def test_what_is_not_understood_is_a_one_line_error_naming_it(tmp_path, edit, message):
    doc = base_doc()
    edit(doc)
    with pytest.raises(QuantError, match=message) as e:
        modelslim_yaml.load(write(tmp_path, doc))
    assert "\n" not in str(e.value) and "r.yaml" in str(e.value)


@pytest.mark.parametrize("text,message", [("spec: [", "not valid YAML at line 1"), ("\udcff", None)])
def test_unreadable_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    if message is None:
        path.write_bytes(b"\xff\xfe")
        message = "not UTF-8"
    else:
        path.write_text(text)
    with pytest.raises(QuantError, match=message):
        modelslim_yaml.load(str(path))
    with pytest.raises(QuantError, match="not found"):
        modelslim_yaml.load(str(tmp_path / "missing.yaml"))


def test_the_dataset_resolves_next_to_the_recipe_then_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "recipes").mkdir()
    rpath = shutil.copy(FIXTURES / "recipe-w8a8-fa3.yaml", tmp_path / "recipes" / "r.yaml")
    rf = modelslim_yaml.load(str(rpath))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(QuantError, match="spec.dataset 'calib.json' not found"):
        rf.dataset_path()
    (tmp_path / "calib.json").write_text(json.dumps(["x"]))
    assert rf.dataset_path() == str(tmp_path / "calib.json")
    (tmp_path / "recipes" / "calib.json").write_text(json.dumps(["y"]))
    assert rf.dataset_path() == str(tmp_path / "recipes" / "calib.json")
    r, _ = resolved("/m/tiny", 3, config_path=str(rpath), calib_data="/elsewhere.json")
    assert r.calib_path == "/elsewhere.json"  # the command line wins


@pytest.mark.parametrize("path,want,source", [
    ("/models/DeepSeek-R1", R1_LIST, "DeepSeek-R1's list"),
    ("/models/deepseek-r1-0528", R1_LIST, "DeepSeek-R1's list"),
    ("/models/DeepSeek-V3", V3_LIST, "DeepSeek-V3's list"),
    ("/models/DeepSeek-V3.1", [0, 1, 2, 50, 51, 53, 54, 55, 56, 57, 58, 59, 60], "DeepSeek-V3.1's list"),
    ("/models/my-model", [], "no list"),
])
def test_the_seed_command_keeps_fa3_off_the_models_list_and_runs_m4(path, want, source):
    r, lines = resolved(path, fa_quant=True)
    assert list(r.recipe.fa_exclude_layers) == want
    assert r.recipe.steps == (IterSmooth(alpha=0.5, scale_min=1e-5, symmetric=False,
                                         enable_subgraph_type=("norm-linear", "ov")),)
    assert any(source in ln for ln in lines) and source in r.yaml_text()
    assert [i for i in range(62) if not r.recipe.fa_layer(cfg(61), i)] == want + [61]  # MTP float: no FA3


def test_model_type_overrides_the_path_and_disable_anti_turns_m4_off():
    r, _ = resolved("/models/DeepSeek-R1", model_type="DeepSeek-V3", disable_anti=True)
    assert list(r.recipe.fa_exclude_layers) == V3_LIST and r.recipe.steps == ()
    assert r.model_type == "DeepSeek-V3" and r.file_name == "DeepSeek-V3_best_practice.yaml"
    r, _ = resolved("/models/x", anti_method="m6", rot=True, quant_mtp="mix")
    assert [s.type for s in r.recipe.steps] == ["quarot", "flex_smooth_quant"] and r.recipe.quantize_mtp
    r, _ = resolved("/models/x", anti_method="none")
    assert r.recipe.steps == ()


def test_a_shorter_checkpoint_keeps_the_layers_it_has_and_warns():
    r, lines = resolved("/models/DeepSeek-R1-tiny", layers=3)
    assert r.recipe.fa_exclude_layers == (0, 1, 2)
    assert any("warning" in ln and "[46, 47, 50" in ln for ln in lines)


def test_project_options_compose_with_the_legacy_defaults():
    r, _ = resolved("/models/DeepSeek-V3", fa_exclude_layers=(5, 1), smooth=True, dynamic=True)
    assert r.recipe.fa_exclude_layers == tuple(sorted(set(V3_LIST) | {5}))
    assert r.recipe.smooth and r.recipe.dynamic and r.recipe.dialect == "seed"


@pytest.mark.parametrize("model_type", presets.MODEL_TYPES)
@pytest.mark.parametrize("quant_type", presets.QUANT_TYPES)
def test_every_preset_resolves(model_type, quant_type):
    r, _ = resolved("/models/x", model_type=model_type, quant_type=quant_type)
    rec = r.recipe
    assert rec.dialect == ASCEND_V1 and rec.quantize_mtp and rec.fa_quant == (quant_type == "w8a8c8")
    if quant_type == "w8a8c8":
        assert [s.type for s in rec.steps] == ["quarot", "flex_smooth_quant"] and rec.steps[0].block_size == 32
        off = [i for i in range(62) if not rec.fa_layer(cfg(61), i)]
        assert off == {"DeepSeek-V3": V3_LIST, "DeepSeek-R1": R1_LIST, "DeepSeek-R1-0528": R1_LIST + [61],
                       "DeepSeek-V3.1": list(range(15)) + list(range(46, 62))}[model_type]
    else:
        assert [s.type for s in rec.steps] == ["iter_smooth"]


@pytest.mark.parametrize("req,message", [
    (dict(quant_type="w8a8c8"), "--quant-type needs --model-type"),
    (dict(quant_type="w8a8", model_type="DeepSeek-V3", rot=True), "--rot: the legacy script's flags"),
    (dict(config_path="x.yaml", quant_type="w8a8", model_type="DeepSeek-V3"), "give one"),
    (dict(quant_mtp="half"), "--quant-mtp: unknown mode 'half'"),
    (dict(anti_method="m9"), "unknown method 'm9'"),
])
def test_conflicting_recipe_flags_are_one_line_errors(req, message):
    with pytest.raises(QuantError, match=message):
        resolved("/models/x", **req)


def test_the_written_recipe_runs_again_to_the_same_recipe(tmp_path):
    for req in (dict(), dict(model_type="DeepSeek-R1", quant_type="w8a8c8"), dict(rot=True, quant_mtp="mix"),
                dict(quant_mtp="none", fa_quant=True), dict(model_type="DeepSeek-R1-0528", quant_type="w8a8c8",
                                                            quant_mtp="none")):
        r, _ = resolved("/models/DeepSeek-R1", **req)
        path = write(tmp_path, r.yaml_text(), r.file_name)
        again, _ = resolved("/models/DeepSeek-R1", config_path=path)
        assert again.recipe == r.recipe


@pytest.mark.parametrize("req", [dict(), dict(rot=True, anti_method="m6"), dict(model_type="DeepSeek-R1-0528",
                                                                                 quant_type="w8a8c8")],
                         ids=["legacy", "legacy-rot", "preset"])
def test_quant_mtp_none_leaves_the_mtp_layer_out_and_says_so(req):
    """msModelSlim's ``--quant_mtp none``: ``drop_mtp`` (nothing of the MTP layer quantized); FA3 lists and
    --fa-exclude-layers keep the main layers only (R1-0528's preset names the MTP layer 61); the written
    recipe says so and names ``drop_mtp``; it composes with --rot and presets."""
    r, _ = resolved("/models/DeepSeek-R1-0528", quant_mtp="none", fa_exclude_layers=(3, 61), **req)
    rec = r.recipe
    assert rec.drop_mtp and not rec.quantize_mtp
    assert 61 not in rec.fa_exclude_layers and 3 in rec.fa_exclude_layers
    assert [s.type for s in rec.steps] == (["quarot", "flex_smooth_quant"] if req else ["iter_smooth"])
    text = r.yaml_text()
    assert "drop_mtp: true" in text and "# mtp: none: the MTP layer (model.layers.61) is not read" in text
    assert "61" not in r.notes.get("fa3", "")
    float_r, _ = resolved("/models/DeepSeek-R1-0528", fa_exclude_layers=(3, 61), **req)
    assert float_r.recipe == dataclasses.replace(rec, drop_mtp=False, quantize_mtp=float_r.recipe.quantize_mtp,
                                                 fa_exclude_layers=float_r.recipe.fa_exclude_layers)
    assert rec.fingerprint() != float_r.recipe.fingerprint() and "drop_mtp" not in float_r.recipe.fingerprint()


def test_drop_mtp_in_a_recipe_file_and_its_conflicts(tmp_path):
    doc = yaml.safe_load((FIXTURES / "recipe-w8a8-fa3.yaml").read_text())
    doc["spec"].pop("dataset", None)
    r, _ = resolved("/models/x", config_path=write(tmp_path, {**doc, "dsquant": {"drop_mtp": True}}))
    assert r.recipe.drop_mtp and not r.recipe.quantize_mtp      # the file's MTP "mix" does not apply
    assert "# mtp: none" in r.yaml_text()
    with pytest.raises(QuantError, match="'quantize_mtp' and 'drop_mtp' are both true"):
        Recipe(quantize_mtp=True, drop_mtp=True)
    with pytest.raises(QuantError, match=r"fa_exclude_layers \[3\] not in the model .*MTP layer left out"):
        Recipe(drop_mtp=True, fa_exclude_layers=(3,)).check_config(layout.without_mtp(cfg(3)))
