"""jobs.make_checkpoint / pipeline.io.release_layout.synthetic: random-weight DeepSeek-V3 checkpoints at the real width with
fewer layers and experts. Checked here on a narrow variant (hidden 256, 2 heads, experts of 64; the MLA
ranks stay the real 1536 / 512): the written bytes are what layer_bytes predicts, bf16 and FP8 load through
the project's reader into the float model and give finite logits, the routing config holds top_k, and bad
flags are one error line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipeline.io.release_layout.synthetic import REAL_WIDTH, Shape, config, groups, layer_bytes, make_checkpoint

SMALL = Shape(layers=2, experts=4, top_k=2, dense=1, mtp=1, vocab=4096, hidden=256, heads=2, expert_width=64)


@pytest.mark.parametrize("fp8", [False, True])
def test_small_checkpoint_loads_and_runs(tmp_path, fp8):
    from pipeline.engine.worker.loader import load_float

    dst = tmp_path / "ck"
    total = make_checkpoint(dst, SMALL, fp8=fp8, seed=1)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total == sum(layer_bytes(config(SMALL, fp8), fp8).values())
    assert not (tmp_path / "ck.partial").exists()
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["kv_lora_rank"] == REAL_WIDTH["kv_lora_rank"] and cfg["q_lora_rank"] == REAL_WIDTH["q_lora_rank"]
    assert ("quantization_config" in cfg) == fp8
    assert any(n.endswith("weight_scale_inv") for n in index["weight_map"]) == fp8
    model = load_float(str(dst), dtype="float32").model
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 300, 4000]]))
    logits = logits[0] if isinstance(logits, tuple) else logits
    assert logits.shape[-1] == SMALL.vocab and torch.isfinite(logits).all()


def test_routing_holds_top_k():
    for experts, top_k in ((16, 8), (256, 8), (32, 8), (8, 2), (4, 4)):
        n_group, topk_group = groups(experts, top_k)
        assert experts % n_group == 0 and topk_group * (experts // n_group) >= top_k, (experts, top_k)
    assert groups(256, 8) == (8, 4)          # the release's routing
    assert groups(16, 8) == (4, 2)


def test_bad_flags_are_one_line(tmp_path):
    for flags, word in ((["--top-k", "9", "--experts", "8"], "--top-k"), (["--dense", "5"], "--dense"),
                        (["--layers", "0"], "--layers")):
        out = subprocess.run([sys.executable, "-m", "jobs.make_checkpoint", "--save-path", str(tmp_path / "x"),
                              *flags], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.startswith("error: ") and word in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
