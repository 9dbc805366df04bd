"""iter_smooth and flex_smooth_quant against msModelSlim's own outputs (tests/fixtures/msmodelslim-v1-bf16-
{itersmooth,flexsmooth}, made with the AVX2 kernels): the comparisons run in a subprocess that pins those
kernels before torch is imported (tests/anti_outlier_parity.py says what is compared and how)."""

from __future__ import annotations

import pytest

from pinned_isa import TESTS, run_pinned

# Layers 1-2 see activations that msModelSlim propagated through its smoothed, fake-quantized layers
# 0-1 (and computed with its own attention code); ours come from plain float forwards. These bounds hold
# what that difference leaves (measured: int8 equal >= 0.878, weight scales >= 0.757, norm weights and
# kv_b_proj rel <= 0.02, biases rel <= 0.055); a formula error moves every one of them far more.
DEEP_INT8_EQUAL = 0.85        # fraction of equal int8 weights
DEEP_SCALE_EQUAL = 0.7        # fraction of equal weight scales (through deq_scale)
DEEP_FLOAT_REL = 0.03         # norm weights, kv_b_proj: max |ours - theirs| / max |theirs|
DEEP_BIAS_REL = 0.08          # the shift's biases
OV_THEIR_CHOICE_EQUAL = 0.99  # flex ov of layer 0 with msModelSlim's alpha/beta (measured 0.992, 0.995)


def parity(step: str, *layers: int) -> dict:
    return run_pinned(TESTS / "anti_outlier_parity.py", step, *map(str, layers))


@pytest.fixture(scope="module")
def iter_smooth():
    return parity("iter_smooth", 0, 1, 2)


def exact(res: dict) -> list[str]:
    return sorted(n for n, r in res.items() if r.get("equal") != 1.0 or not r.get("dtype"))


def test_iter_smooth_layer0_equals_msmodelslim(iter_smooth):
    """Layer 0: every subgraph's statistics come from the embedding through layer 0's own float weights,
    so every tensor iter_smooth writes or changes is msModelSlim's bit for bit: the norm weights (bf16),
    the shift's norm and linear biases (float32), kv_b_proj's value rows, and the int8 weights and weight
    scales quantized from the smoothed q_a / kv_a / q_b / o_proj."""
    res = iter_smooth["layers"]["0"]
    p = "model.layers.0."
    for name in ("input_layernorm.weight", "input_layernorm.bias", "self_attn.q_a_layernorm.weight",
                 "self_attn.q_a_layernorm.bias", "self_attn.q_a_proj.bias", "self_attn.kv_a_proj_with_mqa.bias",
                 "self_attn.q_b_proj.bias", "self_attn.kv_b_proj.weight", "self_attn.q_a_proj.weight",
                 "self_attn.q_a_proj.weight_scale", "self_attn.kv_a_proj_with_mqa.weight",
                 "self_attn.kv_a_proj_with_mqa.weight_scale", "self_attn.q_b_proj.weight",
                 "self_attn.q_b_proj.weight_scale", "self_attn.o_proj.weight", "self_attn.o_proj.weight_scale"):
        assert p + name in res
    assert exact(res) == []
    assert len(res) == 16   # nothing else changed


def test_iter_smooth_layer0_activation_parameters(iter_smooth):
    """The shifted norm's output gives q_a / kv_a activation parameters equal to msModelSlim's (its offset
    0: the shift centres them), and quant_bias holds the linear bias divided by deq_scale in bf16."""
    for name, res in iter_smooth["layer0_activation"].items():
        assert exact(res) == [], name


def test_iter_smooth_deeper_layers_within_propagation_bounds(iter_smooth):
    for layer in ("1", "2"):
        res = iter_smooth["layers"][layer]
        assert len(res) == 16
        for name, r in res.items():
            assert r["dtype"], name
            if name.endswith("proj.weight") and "kv_b_proj" not in name:
                assert r["equal"] >= DEEP_INT8_EQUAL, (name, r)
            elif name.endswith("weight_scale"):
                assert r["equal"] >= DEEP_SCALE_EQUAL, (name, r)
            elif name.endswith(".bias"):
                assert r["rel"] <= DEEP_BIAS_REL, (name, r)
            else:
                assert r["rel"] <= DEEP_FLOAT_REL, (name, r)


def test_flex_smooth_layer0_norm_linear_equals_msmodelslim():
    """flex_smooth_quant's layer-0 norm-linear subgraphs, alpha/beta search included, are msModelSlim's
    bit for bit (the norm weights, the int8 weights and weight scales of q_a / kv_a / q_b). Its ov
    subgraph reads o_proj's input, which msModelSlim computed with DeepSeek's own attention code: ours
    rounds differently in places, enough to tip the search (alpha 0.3 beta 1.0 against msModelSlim's
    0.25 / 0.75, recovered from its kv_b_proj rows); see docs/recipes.md."""
    out = parity("flex_smooth_quant", 0)
    res = out["layers"]["0"]
    p = "model.layers.0."
    norm_linear = [p + n for n in ("input_layernorm.weight", "self_attn.q_a_layernorm.weight",
                                   "self_attn.q_a_proj.weight", "self_attn.q_a_proj.weight_scale",
                                   "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight_scale",
                                   "self_attn.q_b_proj.weight", "self_attn.q_b_proj.weight_scale")]
    assert exact({n: res[n] for n in norm_linear}) == []
    assert out["choices"][p + "input_layernorm"] == [0.4, 0.6]
    assert out["choices"][p + "self_attn.q_a_layernorm"] == [0.7, 0.45]
    # with msModelSlim's choice, the ov fold gives its tensors but for the value row of the one channel
    # (of 64) whose o_proj input maximum differs (bf16 rounding in the attention): 1 of 128 rows of kv_b
    fixed = out["layer0_ov_their_choice"]
    assert fixed[p + "self_attn.kv_b_proj.weight"]["equal"] >= OV_THEIR_CHOICE_EQUAL
    assert fixed[p + "self_attn.o_proj.weight"]["equal"] >= OV_THEIR_CHOICE_EQUAL
    assert sorted(res) == sorted(norm_linear + [p + "self_attn.kv_b_proj.weight", p + "self_attn.o_proj.weight",
                                                p + "self_attn.o_proj.weight_scale"])
