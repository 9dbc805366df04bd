"""The quantize/check jobs on bad input and failures (issue 15): every input validated before heavy work,
an old output never lost to a failed overwrite, no write into a source or a foreign directory, a full disk
a clear error that leaves nothing behind, manifest hashes verified, one-line errors (exit 2) for hostile
files and config values."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jobs import check as check_job
from jobs import make_fp8 as make_fp8_job
from jobs import quantize as quantize_job
from pipeline.format.checker import check_dir
from pipeline.io import storage
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from tiny import FIXTURES, TINY_FIXTURE, fail_quantize_layer

SAMPLE = ["The quick brown fox jumps over the lazy dog. " * 3]


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib") / "one.json"
    path.write_text(json.dumps(SAMPLE))
    return str(path)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, calib) -> Path:
    """A valid quantized output of the tiny fixture (copied by the tests that touch it)."""
    dst = tmp_path_factory.mktemp("out") / "q"
    quantize_checkpoint(str(TINY_FIXTURE), str(dst), Recipe(), QuantizeOptions(calib_path=calib), log=lambda m: None)
    return dst


@pytest.fixture
def output(finished, tmp_path) -> Path:
    dst = tmp_path / "q"
    shutil.copytree(finished, dst)
    return dst


@pytest.fixture
def source(tmp_path) -> Path:
    """A writable copy of the tiny fixture."""
    src = tmp_path / "src"
    shutil.copytree(TINY_FIXTURE, src)
    return src


def edit_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def quantize(capsys, *args) -> tuple[int, str, str]:
    rc = quantize_job.main(["--no-progress", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


# ----- item 5, 15: inputs and the destination checked before any heavy work ------------------------------
def test_malformed_calib_data_is_reported_before_the_model_loads(capsys, source, tmp_path):
    bad = tmp_path / "calib.json"
    bad.write_text('["a", ')
    rc, out, err = quantize(capsys, "--model-path", str(source), "--save-path", str(tmp_path / "q"),
                            "--calib-data", str(bad))
    assert rc == 2 and "calibrating" not in out
    one_line_error(err, str(bad), "not valid JSON")


def test_existing_output_is_refused_before_calibration_naming_the_flag(capsys, output, calib):
    rc, out, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(output),
                            "--calib-data", calib)
    assert rc == 2 and "calibrating" not in out
    one_line_error(err, str(output), "already holds quantized output", "--overwrite")
    assert "overwrite=True" not in err


def test_unreachable_s3_endpoint_is_refused_before_calibration(capsys, calib, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    t = time.time()
    saved = storage.options().get("s3")          # the session's S3 server, when another test started it
    try:
        rc, out, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", "s3://nobucket/q",
                                "--calib-data", calib, "--s3-endpoint", "http://127.0.0.1:9")
    finally:
        if saved is None:
            storage._OPTIONS.pop("s3", None)
        else:
            storage.set_options("s3", **saved)
    assert rc == 2 and "calibrating" not in out
    one_line_error(err, "s3://nobucket/q", "http://127.0.0.1:9")
    assert time.time() - t < 60


# ----- item 12: a failed overwrite keeps the old output -------------------------------------------------
def test_overwrite_with_a_float32_config_over_bf16_weights_keeps_the_old_output(capsys, output, source, calib):
    before = snapshot(output)
    edit_config(source, torch_dtype="float32")
    rc, out, err = quantize(capsys, "--model-path", str(source), "--save-path", str(output), "--calib-data", calib,
                            "--overwrite")
    assert rc == 2 and "calibrating" not in out
    one_line_error(err, "float32", "BF16")
    assert snapshot(output) == before


def test_overwrite_with_one_f16_tensor_in_a_bf16_checkpoint_keeps_the_old_output(capsys, output, source, calib):
    before = snapshot(output)
    tensors = load_file(str(source / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name].to(torch.float16)
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    rc, out, err = quantize(capsys, "--model-path", str(source), "--save-path", str(output), "--calib-data", calib,
                            "--overwrite")
    assert rc == 2 and "calibrating" not in out
    one_line_error(err, name, "F16")
    assert snapshot(output) == before


def test_overwrite_that_crashes_mid_write_keeps_the_old_output(output, calib, monkeypatch):
    before = snapshot(output)
    fail_quantize_layer(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="injected failure"):
        quantize_checkpoint(str(TINY_FIXTURE), str(output), Recipe(dialect="seed", dynamic=True),
                            QuantizeOptions(calib_path=calib, overwrite=True), log=lambda m: None)
    assert snapshot(output) == before
    assert sorted(p.name for p in output.iterdir()) == sorted(before)  # no leftover part either
    assert check_dir(str(output)).ok


def test_overwrite_replaces_a_finished_output_completely(output, calib):
    quantize_checkpoint(str(TINY_FIXTURE), str(output), Recipe(dialect="ascendV1"),
                        QuantizeOptions(calib_path=calib, overwrite=True), log=lambda m: None)
    report = check_dir(str(output))
    assert report.ok and report.dialect == "ascendV1"
    assert all(f.startswith("quant_model_weights-") for f in report.weight_files), report.weight_files
    assert not [p.name for p in output.iterdir() if p.name.startswith(".")]


# ----- item 13: never into a source or a foreign directory ----------------------------------------------
def test_save_path_spelled_as_the_source_is_refused(capsys, source, calib):
    before = snapshot(source)
    rc, _, err = quantize(capsys, "--model-path", str(source), "--save-path", f"{source}/.", "--calib-data", calib)
    assert rc == 2
    one_line_error(err, "source")
    assert snapshot(source) == before


def test_save_path_holding_other_files_is_refused(capsys, tmp_path, calib):
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep")
    rc, _, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(dst), "--calib-data", calib,
                          "--overwrite")
    assert rc == 2
    one_line_error(err, str(dst), "notes.txt")
    assert sorted(p.name for p in dst.iterdir()) == ["notes.txt"]


def test_make_fp8_into_a_quantized_output_is_refused(capsys, output):
    before = snapshot(output)
    rc = make_fp8_job.main(["--src", str(TINY_FIXTURE), "--dst", str(output)])
    err = capsys.readouterr().err
    assert rc == 2
    one_line_error(err, str(output))
    assert snapshot(output) == before


def test_make_fp8_into_its_source_spelled_differently_is_refused(capsys, source):
    before = snapshot(source)
    rc = make_fp8_job.main(["--src", str(source), "--dst", f"{source}/../{source.name}/"])
    err = capsys.readouterr().err
    assert rc == 2
    one_line_error(err, "source")
    assert snapshot(source) == before


# ----- item 14: a full disk -------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root; skipped without)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_is_a_clear_error_and_leaves_no_temporary(small_disk):
    path = str(small_disk / "big.bin")
    with pytest.raises(OSError, match=rf"{path}: no space left .* 2097152 bytes"):
        storage.write_bytes(path, b"x" * 2 * 1024 ** 2)
    assert list(small_disk.iterdir()) == []


def test_disk_filling_up_mid_write_is_a_clear_error_and_a_rerun_works(small_disk):
    from test_writer import write_model

    dst = str(small_disk / "q")
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 700 * 1024)  # the writer's shards need more than the 324 KiB left
    with pytest.raises(OSError, match=rf"{dst}/\.quant_model_weight_w8a8\.part-.*: no space left on the device "
                                      r"to write \d+ bytes"):
        write_model(dst, "seed")
    assert sorted(p.name for p in small_disk.rglob("*") if p.is_file()) == ["filler"]
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    write_model(dst, "seed")
    assert check_dir(dst).ok


def test_quantize_onto_a_full_disk_fails_cleanly_and_a_rerun_works(capsys, small_disk, calib):
    dst = small_disk / "q"
    rc, out, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(dst), "--calib-data", calib)
    assert rc == 2 and "calibrating" not in out
    one_line_error(err, str(dst), "bytes")
    assert [p for p in small_disk.rglob("*") if p.is_file()] == []
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    rc, out, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(dst), "--calib-data", calib)
    assert rc == 0, err
    assert check_dir(str(dst)).ok


def test_a_crashed_writers_leftover_does_not_block_the_rerun(capsys, tmp_path, calib):
    dst = tmp_path / "q"
    dst.mkdir()
    leftover = dst / ".quant_model_weight_w8a8.part-0123456789ab-00001.safetensors.tmp-0123456789ab"
    leftover.write_bytes(b"half a shard")
    rc, _, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(dst), "--calib-data", calib)
    assert rc == 0, err
    assert not leftover.exists() and check_dir(str(dst)).ok


# ----- item 16: the checker verifies the manifest ---------------------------------------------------------
def test_check_finds_a_flipped_byte_by_its_sha256(capsys, output):
    shard = sorted(output.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    assert check_job.main([str(output)]) == 1
    out = capsys.readouterr().out
    assert "[manifest]" in out and f"{shard.name}: sha256" in out
    assert check_job.main([str(output), "--no-verify"]) == 0
    assert "OK: no violations" in capsys.readouterr().out


def test_check_finds_a_truncated_shard_by_its_size_even_without_hashes(capsys, output):
    shard = sorted(output.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes() + b"\0" * 8)
    assert check_job.main([str(output), "--no-verify"]) == 1
    assert f"{shard.name}: size" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["msmodelslim-v1-bf16", "msmodelslim-v1-fp16"])
def test_check_says_when_there_is_no_manifest(capsys, name):
    assert check_job.main([str(FIXTURES / name)]) == 0
    out = capsys.readouterr().out
    assert "manifest: none (sizes and hashes not verified)" in out and "OK: no violations" in out


# ----- item 17: hostile files and config values: one line, exit 2 -----------------------------------------
DEEP = "[" * 200_000 + "]" * 200_000


def test_deeply_nested_config_is_one_line(capsys, source, calib, tmp_path):
    (source / "config.json").write_text(DEEP)
    rc, _, err = quantize(capsys, "--model-path", str(source), "--save-path", str(tmp_path / "q"), "--calib-data", calib)
    assert rc == 2
    one_line_error(err, "config.json", "nested")


def test_deeply_nested_safetensors_header_is_one_line(capsys, source, calib, tmp_path):
    text = ('{"a":' * 100_000 + "1" + "}" * 100_000).encode()
    (source / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    rc, _, err = quantize(capsys, "--model-path", str(source), "--save-path", str(tmp_path / "q"), "--calib-data", calib)
    assert rc == 2
    one_line_error(err, "model.safetensors", "nested")


def test_deeply_nested_index_is_one_line(capsys, source, calib, tmp_path):
    (source / "model.safetensors.index.json").write_text(DEEP)
    rc, _, err = quantize(capsys, "--model-path", str(source), "--save-path", str(tmp_path / "q"), "--calib-data", calib)
    assert rc == 2
    one_line_error(err, "model.safetensors.index.json", "nested")


def test_deeply_nested_calibration_file_is_one_line(capsys, tmp_path):
    bad = tmp_path / "deep.json"
    bad.write_text(DEEP)
    rc, _, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "q"),
                          "--calib-data", str(bad))
    assert rc == 2
    one_line_error(err, str(bad), "nested")


def test_deeply_nested_description_is_a_violation_not_a_traceback(capsys, output):
    (output / "quant_model_description.json").write_text(DEEP)
    assert check_job.main([str(output)]) == 1
    assert "nested" in capsys.readouterr().out


def test_config_symlink_loop_is_one_line(capsys, source, calib, tmp_path):
    (source / "config.json").unlink()
    os.symlink("config.json", source / "config.json")
    rc, _, err = quantize(capsys, "--model-path", str(source), "--save-path", str(tmp_path / "q"), "--calib-data", calib)
    assert rc == 2
    one_line_error(err, "config.json")


def test_directory_where_the_calibration_file_belongs_is_one_line(capsys, tmp_path):
    bad = tmp_path / "dir.json"
    bad.mkdir()
    rc, _, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "q"),
                          "--calib-data", str(bad))
    assert rc == 2
    one_line_error(err, str(bad), "directory")


def test_directory_where_the_config_belongs_is_one_line(capsys, source, calib, tmp_path):
    (source / "config.json").unlink()
    (source / "config.json").mkdir()
    rc, _, err = quantize(capsys, "--model-path", str(source), "--save-path", str(tmp_path / "q"), "--calib-data", calib)
    assert rc == 2
    one_line_error(err, "config.json", "directory")


@pytest.mark.parametrize("field", ["num_hidden_layers", "n_routed_experts"])
def test_huge_config_counts_are_bounded_by_the_tensors(capsys, source, calib, tmp_path, field):
    edit_config(source, **{field: 10 ** 9})
    t = time.time()
    rc, _, err = quantize(capsys, "--model-path", str(source), "--save-path", str(tmp_path / "q"), "--calib-data", calib)
    assert rc == 2
    one_line_error(err, "config.json", field, str(10 ** 9))
    assert time.time() - t < 10


def test_negative_rope_theta_is_one_line(capsys, source, calib, tmp_path):
    edit_config(source, rope_theta=-10000)
    rc, _, err = quantize(capsys, "--model-path", str(source), "--save-path", str(tmp_path / "q"), "--calib-data", calib)
    assert rc == 2
    one_line_error(err, "config.json", "rope_theta")


def test_non_utf8_jsonl_names_the_file(capsys, tmp_path):
    bad = tmp_path / "calib.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    rc, _, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "q"),
                          "--calib-data", str(bad))
    assert rc == 2
    one_line_error(err, str(bad), "line 2", "UTF-8")


def test_lone_surrogate_in_calibration_text_names_the_sample(capsys, tmp_path):
    bad = tmp_path / "calib.json"
    bad.write_text('["fine", "bad \\ud800 text"]')
    rc, _, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "q"),
                          "--calib-data", str(bad))
    assert rc == 2
    one_line_error(err, str(bad), "sample 1", "surrogate")


@pytest.mark.parametrize("flag,value,message", [("--shard-size-gb", "0", "--shard-size-gb must be a finite number > 0"),
                                                ("--shard-size-gb", "inf", "--shard-size-gb must be a finite number > 0"),
                                                ("--max-calib-tokens", "0", "--max-calib-tokens must be >= 1"),
                                                ("--smooth-alpha", "1.5", r"--smooth-alpha must be in [0, 1]")])
def test_bad_option_values_fail_before_calibration(capsys, tmp_path, calib, flag, value, message):
    rc, out, err = quantize(capsys, "--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "q"),
                            "--calib-data", calib, "--smooth", flag, value)
    assert rc == 2 and "calibrating" not in out
    one_line_error(err, message)
