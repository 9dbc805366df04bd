"""The quantizer end to end: python -m jobs.quantize / quantize_checkpoint on real checkpoints, checked by
the checker, against msModelSlim's own output, from FP8 sources, with smoothing, and after a crash."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.io.checkpoint import CheckpointReader
from pipeline.io.release_layout.fp8_copy import write_fp8_copy
from pipeline.format.checker import check_dir
from pipeline.quant.recipe.recipe import Recipe
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from tiny import FIXTURES, TINY_FIXTURE, fail_quantize_layer

REPO = Path(__file__).resolve().parents[1]
CALIB = str(FIXTURES / "calib.json")
OPTS = QuantizeOptions(calib_path=CALIB)


def weights(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_job_reproduces_msmodelslim_integers(tmp_path):
    """Through the whole job (calibration, streaming, writer): the ascendV1 output of the fixture checkpoint
    holds msModelSlim's int8 weights, dynamic weight scales, and layer 0's static input parameters
    bit for bit, and the same set of tensors and types."""
    dst = tmp_path / "q"
    quantize_checkpoint(str(TINY_FIXTURE), str(dst), Recipe(dialect="ascendV1", quantize_mtp=True), OPTS, log=lambda m: None)
    assert check_dir(str(dst)).ok
    ours, ref = weights(dst), weights(FIXTURES / "msmodelslim-v1-bf16")
    assert set(ours) == set(ref)
    exact = [k for k in ref if ref[k].dtype == torch.int8 or (".mlp." in k and k.endswith("weight_scale"))
             or k.startswith("model.layers.0.self_attn.q_a_proj.input") or
             k.startswith("model.layers.0.self_attn.kv_a_proj_with_mqa.input")]
    assert len(exact) > 150
    for k in exact:
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k


def test_fp8_source_gives_the_same_output_as_its_bf16_dequantization(tmp_path, calib4):
    fp8 = tmp_path / "fp8"
    write_fp8_copy(str(TINY_FIXTURE), str(fp8), shards=2)
    # the same weights as a plain bf16 checkpoint: dequantize the FP8 copy and save it
    reader = CheckpointReader(str(fp8))
    deq = tmp_path / "deq"
    deq.mkdir()
    tensors = dict(reader.read_globals())
    for i in range(reader.config.num_hidden_layers + 1):
        tensors.update(reader.read_layer(i))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(deq / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (deq / f).write_bytes((TINY_FIXTURE / f).read_bytes())
    opts = dataclasses.replace(OPTS, calib_path=calib4)  # both on the same texts: any texts
    quantize_checkpoint(str(fp8), str(tmp_path / "a"), Recipe(), opts, log=lambda m: None)
    quantize_checkpoint(str(deq), str(tmp_path / "b"), Recipe(), opts, log=lambda m: None)
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert "quantization_config" not in (tmp_path / "a" / "config.json").read_text()


def test_smoothing_keeps_the_format(tmp_path, calib4):
    plain, smooth = tmp_path / "plain", tmp_path / "smooth"
    opts = dataclasses.replace(OPTS, calib_path=calib4)  # both on the same texts: any texts
    quantize_checkpoint(str(TINY_FIXTURE), str(plain), Recipe(), opts, log=lambda m: None)
    quantize_checkpoint(str(TINY_FIXTURE), str(smooth), Recipe(smooth=True), opts, log=lambda m: None)
    assert check_dir(str(smooth)).ok
    a, b = weights(plain), weights(smooth)
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
    assert (plain / "quant_model_description.json").read_text() == (smooth / "quant_model_description.json").read_text()
    assert not torch.equal(a["model.layers.1.self_attn.kv_a_layernorm.weight"],
                           b["model.layers.1.self_attn.kv_a_layernorm.weight"])


def test_crash_mid_run_leaves_nothing_that_looks_complete(tmp_path, monkeypatch, calib4):
    dst = tmp_path / "q"
    fail_quantize_layer(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="injected failure"):
        quantize_checkpoint(str(TINY_FIXTURE), str(dst), Recipe(),
                            dataclasses.replace(OPTS, calib_path=calib4, shard_bytes=200_000), log=lambda m: None)
    left = sorted(p.name for p in dst.iterdir()) if dst.exists() else []
    assert not any(n.endswith(".index.json") or n == "quant_model_description.json" or
                   n.startswith("quant_model_weight") for n in left), left


def run_job(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "jobs.quantize", "--no-progress", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_msmodelslim_spellings_and_errors(tmp_path, calib4):
    dst = tmp_path / "out"
    r = run_job("--model_path", str(TINY_FIXTURE), "--save_path", str(dst), "--calib_file", calib4, "--fa_quant",
                "--mindie_format", "--fa_exclude_layers", "0", "--batch_size", "4")
    assert r.returncode == 0, r.stderr
    # the seed's command keeps msModelSlim's FA3 list of the model its path names: "V3" is in
    # tests/fixtures/tiny-deepseek-v3, so layers 0, 1, 2 (V3's list, as far as the checkpoint goes) stay bf16
    assert "FA3 off layers [0, 1, 2]: DeepSeek-V3's list" in r.stdout
    report = check_dir(str(dst))
    assert report.ok and report.fa_layers == []
    assert '"model_type": "deepseekv2"' in (dst / "config.json").read_text()
    again = run_job("--model-path", str(TINY_FIXTURE), "--save-path", str(dst), "--calib-data", CALIB)
    assert again.returncode == 2 and "already holds quantized output" in again.stderr
    bad = run_job("--model-path", str(TINY_FIXTURE), "--save-path", str(tmp_path / "x"), "--fa-exclude-layers", "7")
    assert bad.returncode == 2 and "fa_exclude_layers" in bad.stderr
