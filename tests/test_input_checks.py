"""Bad input to jobs.quantize, jobs.plan, jobs.check and jobs.requantize is one line naming what is wrong,
found before any heavy work (no calibration started, nothing written): a tensor of a non-float type, an
FP8 weight without its scale, a shape the config contradicts (vocabulary, head count), an integer field
beyond int64, a --save-path through a loop of symbolic links, --stages 0 or beyond the main layers (the
same range in jobs.plan), a huge calibration line (refused by its length, before tokenizing it); an
output of ours whose manifest was deleted fails jobs.check; ``--source-check sha256`` sees an in-place
edit that keeps a file's size and mtime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jobs import quantize as quantize_job
from test_job_safety import edit_config, source  # noqa: F401 (the fixture is shared with those tests)
from tiny import FIXTURES, TINY_FIXTURE

REPO = Path(__file__).resolve().parents[1]
CALIB = str(FIXTURES / "calib.json")



def edit_tensors(src: Path, edit) -> None:
    for f in src.glob("*.safetensors"):
        t = load_file(f)
        edit(t)
        save_file(t, f, metadata={"format": "pt"})


def refused_early(capsys, tmp_path, *args, needles=()) -> str:
    """Run jobs.quantize: exit 2, one ``error:`` line holding ``needles``, no calibration, nothing written."""
    dst = tmp_path / "out"
    rc = quantize_job.main(["--no-progress", "--no-estimate", "--calib-data", CALIB, "--save-path", str(dst), *args])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, out, err)
    assert "calibrating" not in out and not dst.exists(), out
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_a_tensor_of_an_integer_type_is_refused_before_calibration(capsys, source, tmp_path):
    for dtype, name in ((torch.int32, "I32"), (torch.int64, "I64")):
        edit_tensors(source, lambda t: t.update({k: v.to(dtype) for k, v in t.items() if k.endswith("q_a_layernorm.weight")
                                                 and ".1." in k}))
        refused_early(capsys, tmp_path, "--model-path", str(source),
                      needles=("model.layers.1.self_attn.q_a_layernorm.weight", f"stored as {name}"))
        shutil.rmtree(source)
        shutil.copytree(TINY_FIXTURE, source)


def test_shapes_the_config_contradicts_are_refused_before_calibration(capsys, source, tmp_path):
    cfg = json.loads((TINY_FIXTURE / "config.json").read_text())
    edit_config(source, vocab_size=cfg["vocab_size"] + 7)
    refused_early(capsys, tmp_path, "--model-path", str(source),
                  needles=("model.embed_tokens.weight", f"expected [{cfg['vocab_size'] + 7}, {cfg['hidden_size']}]"))
    edit_config(source, vocab_size=cfg["vocab_size"], num_attention_heads=cfg["num_attention_heads"] * 3)
    refused_early(capsys, tmp_path, "--model-path", str(source), needles=("q_b_proj.weight", "does not match the config"))


@pytest.mark.parametrize("value", [2 ** 63, 2 ** 64, 10 ** 30])
def test_an_integer_field_beyond_int64_is_one_line(capsys, source, tmp_path, value):
    edit_config(source, vocab_size=value)
    refused_early(capsys, tmp_path, "--model-path", str(source), needles=("config.json", "vocab_size", str(value)))


def test_an_fp8_weight_without_its_scale_is_refused_before_calibration(capsys, tmp_path):
    fp8 = tmp_path / "fp8"
    subprocess.run([sys.executable, "-m", "jobs.make_fp8", "--src", str(TINY_FIXTURE), "--dst", str(fp8)], check=True,
                   cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True)
    gone = "model.layers.2.self_attn.kv_b_proj.weight_scale_inv"

    def drop(t):
        del t[gone]

    edit_tensors(fp8, drop)
    index = fp8 / "model.safetensors.index.json"
    if index.exists():
        j = json.loads(index.read_text())
        j["weight_map"].pop(gone, None)
        index.write_text(json.dumps(j))
    refused_early(capsys, tmp_path, "--model-path", str(fp8), needles=(gone, "is missing", "F8_E4M3"))


def test_a_save_path_through_a_symlink_loop_is_refused_before_calibration(capsys, tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "nowhere").symlink_to(tmp_path / "missing" / "dir")
    for save, why in (("loop", "loop of symbolic links"), ("a", "loop of symbolic links"),
                      ("loop/sub", "loop of symbolic links"), ("nowhere", "which does not exist")):
        dst = str(tmp_path / save)
        rc = quantize_job.main(["--no-progress", "--no-estimate", "--calib-data", CALIB, "--model-path",
                                str(TINY_FIXTURE), "--save-path", dst])
        out, err = capsys.readouterr()
        assert rc == 2 and err.startswith(f"error: {dst}: ") and why in err and "calibrating" not in out, err


def test_stages_0_is_refused_and_plan_and_quantize_take_the_same_range(capsys, tmp_path):
    layers = json.loads((TINY_FIXTURE / "config.json").read_text())["num_hidden_layers"]
    rc = quantize_job.main(["--stages", "0", "--save-path", str(tmp_path / "q")])
    assert rc == 2 and capsys.readouterr().err.strip() == \
        "error: --stages must be >= 1, got 0 (leave it out for the single-process job)"
    from jobs import plan as plan_job

    for k in (layers + 1, layers + 5):        # refused from the config, before Ray or the destination
        rc = quantize_job.main(["--model-path", str(TINY_FIXTURE), "--stages", str(k), "--save-path", str(tmp_path / "q")])
        assert rc == 2 and capsys.readouterr().err.strip() == \
            f"error: --stages must be 1..{layers} (the model's main layers), got {k}"
        assert not (tmp_path / "q").exists()
    for k in (0, -1, layers + 1, layers + 5):
        assert plan_job.main(["--model-path", str(TINY_FIXTURE), "--stages", str(k)]) == 2
        assert capsys.readouterr().err.strip() == f"refused: stages must be 1..{layers} (the model's main layers), got {k}"
    for k in range(1, layers + 1):
        assert plan_job.main(["--model-path", str(TINY_FIXTURE), "--stages", str(k)]) == 0
    capsys.readouterr()
    from actors.quantize.quantize_job import stage_specs
    from actors.quantize.ray_session import DistOptions
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.quant.recipe.recipe import Recipe

    reader = CheckpointReader(str(TINY_FIXTURE))
    for k in range(1, layers + 1):               # every stage count jobs.plan takes, the job takes too
        specs, _ = stage_specs(reader, Recipe(), DistOptions(stages=k), 16, 1, 2 ** 30)
        assert len(specs) == k
    with pytest.raises(ValueError, match=rf"^stages must be 1\.\.{layers} \(the model's main layers\), got {layers + 1}$"):
        stage_specs(reader, Recipe(), DistOptions(stages=layers + 1), 16, 1, 2 ** 30)


def test_a_huge_calibration_line_is_refused_by_its_length_before_tokenizing(capsys, tmp_path):
    """50 MB in one line: refused at once (its tokenization alone took minutes), or with --truncate cut
    to the limit, the same tokens as tokenizing it whole would give."""
    from pipeline.quant.calibration.calib_data import tokenize
    from pipeline.text.tokenizer import Tokenizer

    line = ("The os module provides a portable way of using operating system dependent functionality. " * 600_000)[:50_000_000]
    calib = tmp_path / "huge.json"
    calib.write_text(json.dumps([line]))
    rc = quantize_job.main(["--no-progress", "--no-estimate", "--calib-data", str(calib), "--model-path",
                            str(TINY_FIXTURE), "--save-path", str(tmp_path / "q"), "--max-calib-tokens", "512"])
    out, err = capsys.readouterr()
    assert rc == 2 and "sample 0 has 50000000 characters" in err and "limit of 512 tokens" in err, err
    assert not (tmp_path / "q").exists()
    tok = Tokenizer.from_dir(str(TINY_FIXTURE))
    cut = tokenize([line], tok, 512, truncate=True)[0]
    assert cut == tok.encode(line[:20_000])[:512]


def test_an_output_of_ours_without_its_manifest_fails_jobs_check(tmp_path, embedded_quantized, capsys):
    from jobs import check as check_job

    out = tmp_path / "q"
    shutil.copytree(embedded_quantized, out)
    assert check_job.main([str(out), "--no-verify"]) == 0
    capsys.readouterr()
    (out / "manifest.json").unlink()
    assert check_job.main([str(out), "--no-verify"]) == 1
    text = capsys.readouterr().out
    assert "manifest.json" in text and "written by dsquant" in text, text
    assert check_job.main([str(FIXTURES / "msmodelslim-v1-bf16")]) == 0     # msModelSlim's have none: fine


def test_requantize_source_check_sha256_sees_an_edit_that_keeps_size_and_mtime(tmp_path, source):
    from pipeline.io import storage
    from pipeline.io.checkpoint import CheckpointReader
    from pipeline.quant.job.job_state import changed_files, source_fingerprints

    shard = next(source.glob("*.safetensors"))
    try:
        for mode, seen in (("stat", []), ("sha256", [shard.name])):
            storage.set_version_mode(mode)
            before = source_fingerprints(CheckpointReader(str(source)))
            st = shard.stat()
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0x01                       # one byte of the last tensor, in place
            shard.write_bytes(bytes(data))
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))   # as cp -p / rsync -t leave it
            assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
            assert changed_files(before, source_fingerprints(CheckpointReader(str(source)))) == seen, mode
    finally:
        storage.set_version_mode("stat")
    from jobs.requantize import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "--source-check" in help_text and "cp -p" in help_text
