"""Bounds on what one recipe line can cost, and recipe values refused or warned about: brace patterns are
counted before they are expanded, a pattern list is compiled once, recipe files are small regular files,
part_file_size is finite, rules that decide nothing are named, contradicting flags are refused."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest
import yaml

from jobs import quantize as quantize_job
from pipeline.config import DeepseekV3Config
from pipeline.io import storage
from pipeline.quant.recipe import modelslim_yaml, patterns
from pipeline.quant.recipe.patterns import MAX_ALTERNATIVES, PatternError, check_patterns, expand_braces, matches
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe_source import RecipeRequest, resolve
from tiny import FIXTURES, TINY_FIXTURE, tiny_config


def base_doc() -> dict:
    doc = yaml.safe_load((FIXTURES / "recipe-w8a8-fa3.yaml").read_text())
    doc["spec"].pop("dataset", None)
    return doc


def write(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


# ----- patterns --------------------------------------------------------------------------------------------
def test_braces_are_counted_before_they_are_expanded():
    groups = 13                                    # 8192 alternatives: over the bound, cheap to count
    assert 2 ** groups > MAX_ALTERNATIVES >= 2 ** 12
    with pytest.raises(PatternError, match=f"expand to {2 ** groups} alternatives, more than {MAX_ALTERNATIVES}"):
        expand_braces("{a,b}" * groups)
    with pytest.raises(PatternError, match=f"expand to {2 ** 64} alternatives"):
        expand_braces("{a,b}" * 64)                # 2**64: counted, never built
    assert len(expand_braces("{a,b}" * 12)) == 2 ** 12
    with pytest.raises(PatternError, match="nested deeper than 16"):
        expand_braces("{" * 40 + "a" + "}" * 40)


def test_a_recipe_pattern_error_names_the_file_field_and_pattern(tmp_path):
    doc = base_doc()
    doc["spec"]["process"][0]["configs"][0]["include"] = ["*self_attn*", "x" + "{a,b}" * 24]
    with pytest.raises(QuantError) as e:
        modelslim_yaml.load(write(tmp_path, doc))
    text = str(e.value)
    assert "r.yaml: spec.process[0].configs[0].include[1]" in text and "alternatives" in text, text
    doc["spec"]["process"][0]["configs"][0]["include"] = ["*{q,kv"]
    with pytest.raises(QuantError, match=r"r\.yaml: spec\.process\[0\]\.configs\[0\]\.include\[0\]: pattern '\*\{q,kv': "):
        modelslim_yaml.load(write(tmp_path, doc))


def test_a_pattern_list_is_compiled_once_and_matches_as_fnmatch(monkeypatch):
    translated: list[str] = []
    real = fnmatch.translate
    monkeypatch.setattr(fnmatch, "translate", lambda p: translated.append(p) or real(p))
    wild = tuple(f"model.layers.{i}.mlp.experts.*.x{i}" for i in range(40_000))
    names = ["model.layers.7.mlp.experts.3.x7", "model.layers.7.mlp.experts.3.x8", "model.layers.39999.mlp.experts.0.x39999"]
    assert [matches(n, wild) for n in names] == [True, False, True]
    assert len(translated) == len(wild)            # each pattern translated once, not once per name
    cases = [("model.layers.3.self_attn.q_a_proj", ("*self_attn*",)), ("mlp.gate", ("*gate",)),
             ("mlp.gate_proj", ("*gate",)), ("a.kv_proj", ("a.{q,kv}_proj",)), ("a.b", ("a.[!b]", "a.?")),
             ("a[1]", ("a[[]1]",)), ("a.b", ("a.{b,{c,d}}",)), ("a.x", ("a.{b,{c,d}}",))]
    for name, pats in cases:
        want = any(fnmatch.fnmatchcase(name, p) for pat in pats for p in expand_braces(pat))
        assert matches(name, pats) is want, (name, pats)
        assert matches(name, list(pats)) is want


def test_check_patterns_names_the_index(tmp_path):
    with pytest.raises(PatternError, match=r"include\[1\]: pattern 'a\}'"):
        check_patterns(["*", "a}"], "include")


# ----- recipe files ----------------------------------------------------------------------------------------
def test_a_recipe_file_that_is_no_regular_file_or_too_large_is_refused(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)                                # opening it to read would block for ever
    with pytest.raises(QuantError, match="not a regular file"):
        modelslim_yaml.load(str(fifo))
    with pytest.raises(QuantError, match="/dev/zero: not a regular file"):
        modelslim_yaml.load("/dev/zero")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (modelslim_yaml.MAX_RECIPE_BYTES + 1))
    with pytest.raises(QuantError, match=f"larger than {modelslim_yaml.MAX_RECIPE_BYTES} bytes"):
        modelslim_yaml.load(str(big))


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "-1"])
def test_part_file_size_must_be_finite(tmp_path, value):
    text = yaml.safe_dump(base_doc()).replace("type: ascendv1_saver", f"type: ascendv1_saver\n    part_file_size: {value}")
    path = tmp_path / "r.yaml"
    path.write_text(text)
    assert "part_file_size" in text
    with pytest.raises(QuantError, match=r"spec.save\[0\].part_file_size: must be a finite number"):
        modelslim_yaml.load(str(path))


def test_s3_without_credentials_is_one_line_naming_the_file(capsys, tmp_path, no_aws_credentials):
    doc = base_doc()
    doc["spec"]["dataset"] = "s3://bucket/data.json"
    pinned = dict(doc, dsquant={"dataset_sha256": "0" * 64})
    cases = [(["--config-path", "s3://bucket/r.yaml"], "s3://bucket/r.yaml"),
             (["--calib-data", "s3://bucket/calib.json"], "s3://bucket/calib.json"),
             (["--config-path", write(tmp_path, doc)], "s3://bucket/data.json")]
    for args, url in cases + [(["--config-path", write(tmp_path, pinned)], "s3://bucket/data.json")]:
        rc = quantize_job.main(["--no-progress", "--model-path", str(TINY_FIXTURE), "--save-path",
                                str(tmp_path / "q"), *args])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert url in err and "credentials" in err, err
    storage.set_options("s3")     # nothing registered for later tests


# ----- what is accepted silently no more -------------------------------------------------------------------
def resolved(**req):
    lines: list[str] = []
    r = resolve(RecipeRequest(**req), "/models/x", DeepseekV3Config.from_dict(tiny_config()), lines.append)
    return r, lines


def test_a_rule_that_decides_no_linear_is_named_in_a_warning(tmp_path):
    doc = base_doc()
    doc["spec"]["process"][0]["configs"].append({"type": "linear_quant", "qconfig": doc["spec"]["process"][0]
                                                 ["configs"][0]["qconfig"], "include": ["*typo_proj"]})
    _, lines = resolved(config_path=write(tmp_path, doc))
    warned = [ln for ln in lines if ln.startswith("warning") and "linear_quant rule 3 of 3" in ln]
    assert warned and "'*typo_proj'" in warned[0] and "r.yaml" in warned[0], lines


def test_a_recipe_that_quantizes_nothing_is_refused(tmp_path):
    doc = base_doc()
    doc["spec"]["process"] = [{"type": "linear_quant", "qconfig": doc["spec"]["process"][0]["configs"][0]["qconfig"],
                               "include": ["*typo_proj"]}]
    with pytest.raises(QuantError, match="no linear_quant rule matches a linear of this model and FA3 is off"):
        resolved(config_path=write(tmp_path, doc))


def test_anti_method_and_disable_anti_contradict():
    with pytest.raises(QuantError, match="--anti-method m6 and --disable-anti contradict"):
        resolved(anti_method="m6", disable_anti=True)
    assert resolved(anti_method="none", disable_anti=True)[0].recipe.steps == ()


@pytest.mark.parametrize("args, message", [
    (["--fallback-target", "agreement=0.9"], "--fallback-target: no --fa-fallback or --linear-fallback given"),
    (["--fa-fallback", "²"], "--fa-fallback: expected auto, none or a count such as 3, got '²'"),
    (["--linear-fallback", "-1"], "--linear-fallback: expected auto, none or a count"),
])
def test_fallback_flags_are_checked_naming_the_flag(capsys, tmp_path, args, message):
    rc = quantize_job.main(["--no-progress", "--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "q"),
                            *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == f"error: {message}" or message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "q").exists()


def test_patterns_module_keeps_no_unbounded_cache():
    assert patterns._expand.cache_info().maxsize and patterns.matcher.cache_info().maxsize
