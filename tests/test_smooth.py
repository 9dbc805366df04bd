"""Smoothing folds exactly: the float model's output is unchanged, the channels are balanced, and the
format (which tensors exist, their shapes and dtypes) is the same."""

from __future__ import annotations

import pytest
import torch

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.model.loading import load_model
from pipeline.quant.calibration.calib_data import load_texts, tokenize
from pipeline.quant.transforms.smooth import (ChannelAbsMax, apply_smoothing, collect_smoothing_stats, smooth_latent,
                                   smooth_scales)
from pipeline.text.tokenizer import Tokenizer
from tiny import TINY_FIXTURE, FIXTURES

FOLD_RTOL = 1e-4   # fp32 logits after folding, relative to their max magnitude (only rounding changes)


@pytest.mark.parametrize("path, calib", [(str(TINY_FIXTURE), str(FIXTURES / "calib.json")),
                                         (EMBEDDED_MODEL_DIR, None)], ids=["tiny-fixture", "embedded"])
@torch.no_grad()
def test_smoothing_keeps_the_float_function(path, calib):
    model = load_model(path, dtype="float32", device="cpu")
    tok = Tokenizer.from_dir(path)
    samples = tokenize(load_texts(calib)[:8], tok, max_tokens=256, truncate=True)
    ids = torch.tensor([samples[0][:48]])
    before_shapes = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    logits, h = model(ids, return_hidden=True)
    mtp_before, _ = model.mtp(h[:, :-1], ids[:, 1:])
    stats = collect_smoothing_stats(model, samples)
    latent_before = stats["model.layers.1.latent"].value
    apply_smoothing(model, stats)
    after, h2 = model(ids, return_hidden=True)
    mtp_after, _ = model.mtp(h2[:, :-1], ids[:, 1:])
    scale = logits.abs().max()
    assert (after - logits).abs().max() <= FOLD_RTOL * scale
    assert (mtp_after - mtp_before).abs().max() <= FOLD_RTOL * mtp_before.abs().max()
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == before_shapes
    # the latent's channel ranges are closer together after smoothing (what the per-tensor fa_k scale needs)
    latent_after = collect_smoothing_stats(model, samples)["model.layers.1.latent"].value
    spread = lambda m: (m.max() / m.clamp_min(1e-6).median()).item()   # noqa: E731
    assert spread(latent_after) < spread(latent_before)


def test_scales_formula_and_dead_channels():
    a = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0])
    s = smooth_scales(a, w, alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        smooth_scales(a, w, alpha=1.5)
    with pytest.raises(ValueError, match="must have the same shape"):
        smooth_scales(a, w[:3])


def test_latent_fold_is_exact_in_the_absorbed_products():
    g = torch.Generator().manual_seed(0)
    C, H, dn, dv = 8, 2, 4, 4
    c = torch.randn(5, C, generator=g) * torch.linspace(0.1, 10, C)
    norm_w = torch.rand(C, generator=g) + 0.5
    kv_b = torch.randn(H * (dn + dv), C, generator=g)
    g2, kv_b2, d = smooth_latent(norm_w, kv_b, (c * norm_w).abs().amax(0), torch.rand(C, generator=g) + 0.1)
    # c is produced by the norm: c' = c_hat * g2 = (c_hat * g) / d
    torch.testing.assert_close((c * g2) @ kv_b2.T, (c * norm_w) @ kv_b.T, rtol=1e-5, atol=1e-5)
    assert d.shape == (C,)


def test_channel_absmax_merge_is_exact():
    xs = [torch.randn(3, 7, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    whole, a, b = ChannelAbsMax(), ChannelAbsMax(), ChannelAbsMax()
    for i, x in enumerate(xs):
        whole.observe(x)
        (a if i % 2 else b).observe(x)
    assert torch.equal(a.merge(b).value, whole.value)
