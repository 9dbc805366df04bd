"""pipeline.engine.layers.moe: the engine's MoE (one activation quantization per layer, gate and up stacked) gives
the model's MoE output over the same int8 linears bit for bit, in both epilogues; the loader uses it."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.worker.loader import load_quantized
from pipeline.engine.layers.moe import Int8MoE, can_fuse
from pipeline.engine.layers.qlinear import EXACT, FAST
from pipeline.model.ffn import MoE


@pytest.fixture(scope="module")
def qdir(tiny_quantized):
    """The tiny fixture quantized with the default recipe (conftest's session copy; read-only)."""
    return tiny_quantized


def _moes(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (MoE, Int8MoE))}


@pytest.mark.parametrize("epilogue", [EXACT, FAST])
def test_fused_moe_equals_the_models_moe(qdir, epilogue):
    plain = load_quantized(qdir, epilogue=epilogue, fuse_moe=False).model
    fused = load_quantized(qdir, epilogue=epilogue).model
    ref, got = _moes(plain), _moes(fused)
    assert sorted(ref) == sorted(got) and len(got) == 3        # layers 1, 2 and the MTP layer
    assert all(isinstance(m, MoE) for m in ref.values())
    fused_names = sorted(n for n, m in got.items() if isinstance(m, Int8MoE))
    assert fused_names == ["model.layers.1.mlp", "model.layers.2.mlp"]   # the MTP layer stays FLOAT: not fused
    g = torch.Generator().manual_seed(0)
    for name in ref:
        for rows in (1, 5, 64):                                    # decode-sized and prefill-sized batches
            x = torch.randn(1, rows, plain.config.hidden_size, generator=g)
            with torch.no_grad():
                a, b = ref[name](x), got[name](x)
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (name, rows)
            assert torch.equal(ref[name].last_load, got[name].last_load)


def test_only_all_int8_experts_fuse(qdir):
    model = load_quantized(qdir, fuse_moe=False).model
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert can_fuse(moe)
    moe.experts[3].up_proj.epilogue = FAST if moe.experts[3].up_proj.epilogue == EXACT else EXACT
    assert not can_fuse(moe)                                        # mixed epilogues: left as it is
    with pytest.raises(ValueError, match="Int8MoE: every expert must be W8A8_DYNAMIC"):
        Int8MoE(moe)
    moe.experts[3].up_proj = torch.nn.Linear(moe.experts[3].up_proj.in_features,
                                             moe.experts[3].up_proj.out_features)
    assert not can_fuse(moe)                                        # a float expert
