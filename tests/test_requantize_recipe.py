"""jobs.requantize without recipe flags reruns the output's own recipe (its *_best_practice.yaml) and says
so, instead of rewriting it with the default recipe; a recipe flag still chooses. The distributed job is
replaced by a stand-in that records what it was asked (tests/test_distributed.py runs the real one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import quantize as quantize_job
from jobs import requantize as requantize_job
from tiny import TINY_FIXTURE

OWN = ["--dynamic", "--no-fa-quant", "--disable-anti"]   # not the default recipe (FA3 on, m4)


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("out") / "q"
    assert quantize_job.main(["--no-progress", "--no-estimate", "--model-path", str(TINY_FIXTURE), "--save-path",
                              str(dst), *OWN]) == 0
    return dst


@pytest.fixture
def asked(monkeypatch) -> list:
    import actors.quantize.quantize_job as qj

    calls: list = []

    def record(src, dst, recipe, opts, dist, log=print):
        calls.append(recipe)
        calls.append(opts)
        return {"status": "up-to-date", "fingerprint": "0" * 12}
    monkeypatch.setattr(qj, "quantize_distributed", record)
    return calls


def test_without_recipe_flags_the_outputs_own_recipe_runs(capsys, output, asked):
    rc = requantize_job.main(["--model-path", str(TINY_FIXTURE), "--save-path", str(output)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    recipe, opts = asked
    assert not opts.mindie_format and "as the earlier job ran" not in out      # no job state: nothing taken
    assert recipe.dynamic and not recipe.fa_quant and recipe.steps == (), recipe
    own = next(output.glob("*_best_practice.yaml"))
    assert f"recipe {own} (the output's own" in out, out


def test_a_recipe_flag_still_chooses(capsys, output, asked):
    rc = requantize_job.main(["--model-path", str(TINY_FIXTURE), "--save-path", str(output), "--disable-anti"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert asked[0].fa_quant and not asked[0].dynamic and "the output's own" not in out


def test_two_recipes_in_the_output_are_refused(capsys, output, tmp_path, asked):
    import shutil

    dst = tmp_path / "q"
    shutil.copytree(output, dst)
    (dst / "DeepSeek-R1_best_practice.yaml").write_text((next(output.glob("*_best_practice.yaml"))).read_text())
    rc = requantize_job.main(["--model-path", str(TINY_FIXTURE), "--save-path", str(dst)])
    err = capsys.readouterr().err
    assert rc == 2 and "holds 2 recipes" in err and "--config-path" in err and not asked


def test_an_s3_output_without_credentials_is_one_line(capsys, no_aws_credentials, asked):
    rc = requantize_job.main(["--model-path", str(TINY_FIXTURE), "--save-path", "s3://bucket/out"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: s3://bucket/out: ") and "credentials" in err, err
    assert len(err.strip().splitlines()) == 1 and not asked


def test_the_earlier_jobs_output_options_are_taken_from_its_state(capsys, output, tmp_path, asked):
    import json
    import shutil

    dst = tmp_path / "q"
    shutil.copytree(output, dst)
    (dst / ".dsquant").mkdir()
    (dst / ".dsquant" / "job.json").write_text(json.dumps({
        "output_options": {"mindie_format": True}, "weight_options": {"smooth_alpha": 0.25, "shard_bytes": 2 ** 30}}))
    rc = requantize_job.main(["--model-path", str(TINY_FIXTURE), "--save-path", str(dst)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    _, opts = asked
    assert opts.mindie_format and opts.smooth_alpha == 0.25 and opts.shard_bytes == 2 ** 30
    assert "--mindie-format --smooth-alpha 0.25 --shard-size-gb 1 as the earlier job ran" in out, out
    asked.clear()
    rc = requantize_job.main(["--model-path", str(TINY_FIXTURE), "--save-path", str(dst), "--smooth-alpha", "0.5"])
    out, err = capsys.readouterr()
    assert rc == 0 and asked[1].smooth_alpha == 0.5 and "--smooth-alpha 0.25" not in out, out
