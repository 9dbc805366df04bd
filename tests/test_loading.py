"""Loading the float model from checkpoints: FP8 sources equal dequantize-then-load, any fsspec URL."""

from __future__ import annotations

import shutil

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from pipeline.io.checkpoint import CheckpointReader, read_model_config
from pipeline.io.fp8 import dequantize_fp8_blocks
from pipeline.io.release_layout.fp8_copy import write_fp8_copy
from pipeline.model.loading import load_model
from pipeline.model import build_model
from tiny import TINY_FIXTURE, tiny_config, write_checkpoint


def ids(vocab, shape=(2, 24)):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_load_model_equals_direct_build():
    model = load_model(str(TINY_FIXTURE), dtype="float32", device="cpu")
    cfg = read_model_config(str(TINY_FIXTURE / "config.json"))
    ref = build_model(cfg, load_file(str(TINY_FIXTURE / "model.safetensors")), torch.float32)
    x = ids(cfg.vocab_size)
    assert torch.equal(model(x), ref(x))
    assert len(model.mtp_layers) == 1


@torch.no_grad()
@pytest.mark.parametrize("kv_lora, rope", [(48, 16), (512, 64)])     # the second: ragged [576, h] FP8 blocks
def test_fp8_source_equals_dequantize_then_load(tmp_path, kv_lora, rope):
    src = TINY_FIXTURE if kv_lora == 48 else write_checkpoint(
        tmp_path / "src", tiny_config(kv_lora_rank=kv_lora, qk_rope_head_dim=rope, hidden_size=192), seed=3)
    fp8 = tmp_path / "fp8"
    write_fp8_copy(str(src), str(fp8), shards=3)
    model = load_model(str(fp8), dtype="float32", device="cpu")

    # the reference: dequantize every FP8 tensor by hand from the stored bytes, then build
    reader = CheckpointReader(str(fp8))
    tensors = {}
    for f in sorted(fp8.glob("model-*.safetensors")):
        raw = load_file(str(f))
        for name, t in raw.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                t = dequantize_fp8_blocks(t, raw[name + "_scale_inv"], (128, 128), torch.float32)
            tensors[name] = t
    assert any(reader.header(n)[0] == "F8_E4M3" for n in reader.tensor_names())
    ref = build_model(reader.config, tensors, torch.float32)
    x = ids(reader.config.vocab_size)
    assert torch.equal(model(x), ref(x))
    if kv_lora == 512:
        assert reader.header("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv")[1] == (5, 2)


@torch.no_grad()
def test_load_from_memory_url():
    fs = fsspec.filesystem("memory")
    for f in TINY_FIXTURE.iterdir():
        fs.pipe(f"/tiny-load/{f.name}", f.read_bytes())
    try:
        model = load_model("memory://tiny-load", dtype="float32", device="cpu")
        ref = load_model(str(TINY_FIXTURE), dtype="float32", device="cpu")
        x = ids(model.config.vocab_size)
        assert torch.equal(model(x), ref(x))
    finally:
        fs.rm("/tiny-load", recursive=True)


def test_bin_checkpoint_refused(tmp_path):
    shutil.copy(TINY_FIXTURE / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        load_model(str(tmp_path), device="cpu")


def test_bad_dtype_named():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        load_model(str(TINY_FIXTURE), dtype="fp8", device="cpu")
