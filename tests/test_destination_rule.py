"""The destination rule every job that writes a directory follows (pipeline/io/destination/rule.py): never the
source, a directory holding it or one inside it; never a directory holding anything but the job's own kind of
output; its own kind only with --overwrite. Every refusal is one line, exit 2, with nothing changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from jobs import evaluate as evaluate_job
from jobs import make_fp8 as make_fp8_job
from jobs import make_outlier_variant as variant_job
from jobs import quantize as quantize_job
from pipeline.io.destination.rule import check_not_source
from tiny import TINY_FIXTURE


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` by relative name, with its content."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def parent(tmp_path) -> Path:
    """P with a checkpoint in P/src."""
    shutil.copytree(TINY_FIXTURE, tmp_path / "P" / "src")
    return tmp_path / "P"


def variant(capsys, *args) -> tuple[int, str]:
    rc = variant_job.main([*args, "--no-check"])
    return rc, capsys.readouterr().err


def test_variant_into_the_directory_holding_its_source_deletes_nothing(capsys, parent):
    before = tree(parent)
    rc, err = variant(capsys, "--model-path", str(parent / "src"), "--save-path", str(parent), "--overwrite")
    assert rc == 2
    one_line_error(err, str(parent), "contains the source")
    assert tree(parent) == before


def test_variant_over_a_quantized_output_is_refused_even_with_overwrite(capsys, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    for name in ("quant_model_description.json", "quant_model_weights.safetensors", "config.json"):
        (out / name).write_text("{}")
    before = tree(out)
    rc, err = variant(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(out), "--overwrite")
    assert rc == 2
    one_line_error(err, str(out), "not an outlier variant")
    assert tree(out) == before


def test_variant_replaces_an_earlier_variant_only_with_overwrite(capsys, tmp_path):
    out = tmp_path / "v"
    assert variant(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(out), "--seed", "1")[0] == 0
    first = tree(out)
    rc, err = variant(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(out), "--seed", "2")
    assert rc == 2
    one_line_error(err, "already holds an outlier variant", "--overwrite")
    assert tree(out) == first
    rc, err = variant(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(out), "--seed", "2", "--overwrite")
    assert rc == 0, err
    assert tree(out) != first and "outlier_variant.json" in tree(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]      # no temporary, no lock left


@pytest.mark.parametrize("where", ["inside", "holding"])
def test_quantize_never_writes_inside_or_around_its_source(capsys, parent, where):
    dst = parent / "src" / "out" if where == "inside" else parent
    before = tree(parent)
    rc = quantize_job.main(["--no-progress", "--model-path", str(parent / "src"), "--save-path", str(dst),
                            "--overwrite", "--dynamic", "--no-fa-quant", "--disable-anti"])
    assert rc == 2
    one_line_error(capsys.readouterr().err, "inside the source" if where == "inside" else "contains the source")
    assert tree(parent) == before


def test_make_fp8_into_the_directory_holding_its_source_is_refused(capsys, parent):
    before = tree(parent)
    rc = make_fp8_job.main(["--src", str(parent / "src"), "--dst", str(parent / "src" / "fp8")])
    assert rc == 2
    one_line_error(capsys.readouterr().err, "inside the source", "--dst")
    assert tree(parent) == before


@pytest.mark.parametrize("case", ["foreign", "model", "compare", "inside"])
def test_evaluate_out_is_refused_before_any_work(capsys, parent, tmp_path, case):
    out = {"foreign": tmp_path / "home", "model": parent, "compare": parent / "src",
           "inside": parent / "src" / "eval"}[case]
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep")
    args = ["--no-progress", "--out", str(out)]
    args += ["--compare", str(parent / "src")] if case == "compare" else ["--model-path", str(parent / "src")]
    before = tree(tmp_path)
    rc = evaluate_job.main(args)
    assert rc == 2
    needle = {"foreign": "not an evaluation report", "model": "not an evaluation report (src)",
              "compare": "the destination is the source", "inside": "inside the source"}[case]
    one_line_error(capsys.readouterr().err, str(out), needle, "--out")
    assert tree(tmp_path) == before


def test_locations_are_compared_resolved(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    for dst, needle in ((f"{tmp_path}/link/b/../", "is the source"), (f"{tmp_path}/link/b/c", "inside"),
                        (f"file://{tmp_path}", "contains")):
        with pytest.raises(ValueError, match=needle):
            check_not_source(str(tmp_path / "a"), dst)
    check_not_source(str(tmp_path / "a"), str(tmp_path / "ab"))          # a sibling sharing a prefix: fine
    check_not_source("s3://bucket/model", "s3://bucket/model-w8a8")
    with pytest.raises(ValueError, match="contains"):
        check_not_source("s3://bucket/models/m", "s3://bucket/models")


def test_evaluate_out_may_hold_the_outputs_it_compares(tmp_path):
    """``--compare OUT/plain --out OUT``: the evaluation writes only its own names into OUT."""
    out = tmp_path / "eval"
    (out / "plain").mkdir(parents=True)
    (out / "report.md").write_text("earlier")
    evaluate_job.check_out(evaluate_job.parse_args(["--compare", str(out / "plain"), "--out", str(out)]))


def test_make_checkpoint_replaces_only_its_own_checkpoint_and_keeps_it_when_the_write_fails(capsys, tmp_path,
                                                                                             monkeypatch):
    from jobs import make_checkpoint as make_checkpoint_job

    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("keep")
    assert make_checkpoint_job.main(["--save-path", str(home), "--overwrite"]) == 2
    one_line_error(capsys.readouterr().err, f"--save-path {home}", "not a checkpoint this job wrote (notes.txt)")
    own = tmp_path / "ckpt"
    own.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "model-00001-of-00001.safetensors"):
        (own / name).write_text("earlier")
    before = tree(own)
    assert make_checkpoint_job.main(["--save-path", str(own)]) == 2
    one_line_error(capsys.readouterr().err, "already holds a checkpoint this job wrote", "--overwrite")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device", str(own))
    monkeypatch.setattr("pipeline.io.safetensors_io.save_safetensors", full_disk)
    monkeypatch.setattr(make_checkpoint_job, "layer_bytes", lambda cfg, fp8: {None: 1})   # needs no disk room
    assert make_checkpoint_job.main(["--save-path", str(own), "--overwrite", "--layers", "1"]) == 2
    one_line_error(capsys.readouterr().err, "No space left on device")
    assert tree(own) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "home"]
