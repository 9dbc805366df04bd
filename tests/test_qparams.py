"""The quantization arithmetic (pipeline/quant/numerics/qparams.py): error bounds, the runtime identities on real
calibration activations, integer ranges, the degenerate-input rules and bad inputs.

Error bounds used below, per element, with md the model dtype and eps_md its machine epsilon:
- activations: |x - dq(q(x))| <= s / 2 inside the quantization range (x_q computed in float32);
- weights: |W - W8 * ws| <= ws * (1/2 + 32 * eps_md): W / ws is itself rounded to md before round(), and
  |W / ws| < 128 where md's spacing is 64 * eps_md (0.25 for bf16, 1/32 for fp16);
- deq_scale = md(s * ws) carries a relative rounding of eps_md / 2.
So for y = x @ W.T and the runtime's y_q = deq_scale * (x_q @ W8.T + quant_bias), with x^, W^ the
dequantized values and y~ = x^ @ W^.T:
    |y_q - y| <= (s/2) * sum_j |W^_ij| + ws_i * (1/2 + 32 eps_md) * sum_j |x_j| + (eps_md / 2) * |y~_i|.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.model.loading import load_model
from pipeline.quant.numerics.observers import MinMax
from pipeline.quant.numerics.qparams import (
    F32_EPS, QuantError, deq_scale_and_quant_bias, deq_scale_to_float32, deq_scale_to_int64,
    dequantize_static, dequantize_weight, dynamic_quant_per_token, fa_offset, fa_scale, int_matmul,
    quantize_static, quantize_weight_per_channel, static_activation_params, w8a8_dynamic_linear,
    w8a8_static_linear,
)
from pipeline.text.tokenizer import Tokenizer
from tests.tiny import FIXTURES, TINY_FIXTURE

N_TEXTS = 4  # calibration texts run for the real-activation checks (each ~300 tokens)
# half a quantization step, plus float32's rounding of x / s (< 128: half an ulp is 2^-18)
HALF_STEP = 0.5 + 2 ** -16


def weight_error_bound(md: torch.dtype) -> float:
    """Max |W - W8 * ws| / ws: half a step plus md's rounding of W / ws below 128."""
    return 0.5 + 32 * torch.finfo(md).eps


@pytest.fixture(scope="module")
def real():
    """Layer 0's q_a_proj and mlp.gate_proj inputs on calibration texts, with the float weights (bf16).
    One thread: the tiny model gains nothing from more, and oversubscribed cores slow it 50x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _capture()
    finally:
        torch.set_num_threads(threads)


def _capture() -> dict:
    tok = Tokenizer.from_dir(str(TINY_FIXTURE))
    texts = json.loads((FIXTURES / "calib.json").read_text())[:N_TEXTS]
    model = load_model(str(TINY_FIXTURE), dtype=torch.bfloat16, device="cpu")
    layer = model.model.layers[0]
    cap: dict[str, list] = {"attn": [], "mlp": []}
    hooks = [layer.self_attn.q_a_proj.register_forward_pre_hook(lambda m, a: cap["attn"].append(a[0])),
             layer.mlp.gate_proj.register_forward_pre_hook(lambda m, a: cap["mlp"].append(a[0]))]
    with torch.no_grad():
        for t in texts:
            model(torch.tensor([tok.encode(t, add_bos=False)]))
    for h in hooks:
        h.remove()
    flat = {k: torch.cat([x.reshape(-1, x.shape[-1]) for x in v]) for k, v in cap.items()}
    return {"x": flat["attn"], "w": layer.self_attn.q_a_proj.weight.detach(),
            "x_mlp": flat["mlp"], "w_mlp": layer.mlp.gate_proj.weight.detach()}


# ----- runtime identities on real activations ------------------------------------------------------
def test_static_runtime_identity_on_calibration_activations(real):
    x, w = real["x"], real["w"]
    md = w.dtype
    mm = MinMax.observe(x)
    s, o = static_activation_params(mm.lo, mm.hi, md)
    q, ws, _ = quantize_weight_per_channel(w)
    deq, qb = deq_scale_and_quant_bias(s, o, q, ws)
    y = x.double() @ w.double().T
    y_q = w8a8_static_linear(x, q, s, o, deq, qb).double()

    x_hat = dequantize_static(quantize_static(x, s, o), s, o).double()
    w_hat = dequantize_weight(q, ws).double()
    # every calibration value lies inside the range: error at most half a step
    assert float((x_hat - x.double()).abs().max()) <= float(s) * HALF_STEP
    eps = torch.finfo(md).eps
    bound = (float(s) / 2 * w_hat.abs().sum(1)
             + ws.double()[:, 0] * weight_error_bound(md) * x.double().abs().sum(1, keepdim=True)
             + eps / 2 * (x_hat @ w_hat.T).abs())
    err = (y_q - y).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # and in aggregate far inside it: SQNR measured 38.4 dB on these activations
    sqnr = 10 * torch.log10(y.pow(2).sum() / (y_q - y).pow(2).sum())
    assert sqnr > 35, float(sqnr)


def test_dynamic_runtime_identity_on_calibration_activations(real):
    x, w = real["x_mlp"], real["w_mlp"]
    q, ws, wo = quantize_weight_per_channel(w)
    assert bool((wo == 0).all())
    y = x.double() @ w.double().T
    y_d = w8a8_dynamic_linear(x, q, ws).double()
    x_q, s_tok = dynamic_quant_per_token(x)
    assert bool((x_q.float() * s_tok - x.float()).abs().le(s_tok * HALF_STEP).all())
    w_hat = dequantize_weight(q, ws).double()
    bound = (s_tok.double() / 2 * w_hat.abs().sum(1)
             + ws.double()[:, 0] * weight_error_bound(w.dtype) * x.double().abs().sum(1, keepdim=True))
    assert bool(((y_d - y).abs() <= bound).all())
    assert 10 * torch.log10(y.pow(2).sum() / (y_d - y).pow(2).sum()) > 35  # measured 40.1 dB


# ----- quantize / dequantize bounds ----------------------------------------------------------------
@pytest.mark.parametrize("md", [torch.bfloat16, torch.float16, torch.float32])
def test_weight_quantization_bounds_and_range(md):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 96, generator=g) * torch.rand(64, 1, generator=g) * 3).to(md)
    q, ws, wo = quantize_weight_per_channel(w)
    assert q.dtype == torch.int8 and ws.dtype == md and wo.dtype == md
    assert ws.shape == (64, 1) and wo.shape == (64, 1) and bool((wo == 0).all())
    assert int(q.min()) >= -128 and int(q.max()) <= 127
    # the range is used: each row's max maps to ~127; md rounding of W / ws can reach -128 (kept, as
    # msModelSlim clamps to [-128, 127])
    assert bool((q.long().abs().amax(1) >= 126).all())
    err = (dequantize_weight(q, ws) - w.float()).abs() / ws.float()
    assert float(err.max()) <= weight_error_bound(md)
    # formula, op by op in md
    ws_ref = w.abs().amax(1, keepdim=True) / 127
    assert torch.equal(ws, ws_ref) and torch.equal(q, torch.clamp(torch.round(w / ws_ref), -128, 127).to(torch.int8))


def test_static_quantization_error_inside_range():
    x = torch.linspace(-3.0, 5.0, 10001).to(torch.bfloat16)
    s, o = static_activation_params(x.min(), x.max(), torch.bfloat16)
    assert s.shape == (1,) and o.shape == (1,) and s.dtype == o.dtype == torch.bfloat16
    q = quantize_static(x, s, o)
    assert q.dtype == torch.int8
    inside = (x.float() / s.float() + o.float()).abs() <= 127  # away from the clamped ends
    err = (dequantize_static(q, s, o) - x.float()).abs()
    assert float(err[inside].max()) <= float(s) * HALF_STEP
    assert int(q.min()) <= -127 and int(q.max()) >= 126


def test_static_params_formula_in_model_dtype():
    # values of layer 0's q_a_proj input on the fixture: fp32 arithmetic would give another fp16 scale
    for md, lo, hi in ((torch.bfloat16, -4.1875, 4.28125), (torch.float16, -4.1796875, 4.29296875)):
        s, o = static_activation_params(lo, hi, md)
        assert float(s) == 0.033203125 and float(o) == -2.0
    s32 = torch.tensor(4.29296875) / 255 - torch.tensor(-4.1796875) / 255
    assert float(s32.half()) != 0.033203125


def test_zero_and_one_sided_activation_ranges():
    s, o = static_activation_params(0.0, 0.0, torch.bfloat16)
    assert float(s) == pytest.approx(F32_EPS, rel=1e-2) and float(o) == -128
    s, o = static_activation_params(0.5, 2.0, torch.bfloat16)  # lo clamps to 0: zero is exact
    assert float(o) == -128 and float(dequantize_static(quantize_static(torch.zeros(1), s, o), s, o)) == 0
    s, o = static_activation_params(-2.0, -0.5, torch.bfloat16)  # hi clamps to 0
    assert float(o) >= 126 and float(dequantize_static(quantize_static(torch.zeros(1), s, o), s, o)) == 0
    assert int(quantize_static(torch.tensor([-2.0]), s, o)) == -128


def test_all_zero_weight_row_rule():
    w = torch.randn(4, 16).to(torch.bfloat16)
    w[2] = 0
    q, ws, _ = quantize_weight_per_channel(w)
    assert bool((q[2] == 0).all()) and float(ws[2, 0]) == pytest.approx(F32_EPS, rel=1e-2)
    assert bool((dequantize_weight(q, ws)[2] == 0).all())
    q_other, ws_other, _ = quantize_weight_per_channel(w[[0, 1, 3]])
    assert torch.equal(q[[0, 1, 3]], q_other) and torch.equal(ws[[0, 1, 3]], ws_other)
    # a row too small for its own scale is floored the same way, and stays finite
    w32 = torch.full((1, 8), 1e-30)
    q32, ws32, _ = quantize_weight_per_channel(w32)
    assert float(ws32) == F32_EPS and bool((q32 == 0).all())


# ----- export --------------------------------------------------------------------------------------
def test_deq_scale_and_quant_bias_formula():
    w = torch.randn(8, 32).to(torch.bfloat16)
    q, ws, _ = quantize_weight_per_channel(w)
    s, o = static_activation_params(-1.5, 2.5, torch.bfloat16)
    deq, qb = deq_scale_and_quant_bias(s, o, q, ws)
    assert deq.dtype == torch.float32 and deq.shape == (8,) and qb.dtype == torch.int32
    assert torch.equal(deq, (s * ws[:, 0]).float())
    assert torch.equal(qb.long(), -int(o) * q.long().sum(1))
    bias = torch.randn(8)
    _, qb_b = deq_scale_and_quant_bias(s, o, q, ws, bias=bias)
    # msModelSlim divides in the model dtype (bias / (s * ws) in bf16: coarse above 256, as its output holds)
    ratio = (bias.to(torch.bfloat16) / (s * ws[:, 0])).float().double()
    assert torch.equal(qb_b.long(), torch.round(ratio - (int(o) * q.long().sum(1)).double()).long())


def test_fp16_deq_scale_is_an_int64_bit_pattern_that_round_trips():
    w = torch.randn(8, 32).half()
    q, ws, _ = quantize_weight_per_channel(w)
    s, o = static_activation_params(-1.5, 2.5, torch.float16)
    deq, _ = deq_scale_and_quant_bias(s, o, q, ws)
    assert deq.dtype == torch.int64
    back = deq_scale_to_float32(deq)
    assert back.dtype == torch.float32 and torch.equal(back, (s * ws[:, 0]).float())
    x = torch.rand(100) * 1e-3 + 1e-9
    assert torch.equal(deq_scale_to_float32(deq_scale_to_int64(x)).view(torch.int32), x.view(torch.int32))
    assert int(deq_scale_to_int64(torch.tensor([1.0]))) == 0x3F800000


def test_int_matmul_is_exact_beyond_float32():
    k = 4096  # 127 * 127 * 4096 > 2^24: float32 accumulation would round
    a = torch.full((2, k), 127, dtype=torch.int8)
    b = torch.full((3, k), 127, dtype=torch.int8)
    b[1] = -128
    out = int_matmul(a, b)
    assert out.dtype == torch.int64 and out.tolist() == [[127 * 127 * k, -127 * 128 * k, 127 * 127 * k]] * 2
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (5, 77), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (6, 77), generator=g, dtype=torch.int8)
    assert torch.equal(int_matmul(a, b), a.long() @ b.long().T)


def test_dynamic_per_token():
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    x[0, 1] = 0
    x_q, s = dynamic_quant_per_token(x)
    assert x_q.shape == x.shape and s.shape == (3, 5, 1) and s.dtype == torch.float32
    assert bool((x_q.abs().amax(-1)[x.abs().amax(-1) > 0] == 127).all())
    assert bool((x_q[0, 1] == 0).all()) and float(s[0, 1]) == F32_EPS


def test_fa_scale_shapes_and_formula():
    lo = torch.tensor([-1.0, -0.25, 0.5, -3.0])
    hi = torch.tensor([0.5, 2.0, 1.0, -1.0])
    s = fa_scale(lo, hi, torch.bfloat16)
    assert s.shape == (4, 1) and s.dtype == torch.bfloat16
    expect = torch.tensor([1.0, 2.0, 1.0, 3.0]) / 127
    assert torch.equal(s[:, 0], expect.to(torch.bfloat16))
    k = fa_scale(torch.tensor([0.0]), torch.tensor([0.0]), torch.float16)
    assert k.shape == (1, 1) and float(k) == pytest.approx(F32_EPS, rel=1e-2)
    off = fa_offset(s)
    assert off.dtype == torch.int8 and off.shape == (4, 1) and bool((off == 0).all())


# ----- bad inputs ----------------------------------------------------------------------------------
def test_bad_inputs_raise_naming_the_tensor():
    w = torch.randn(4, 8)
    bad = w.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(QuantError, match="q_proj.weight: 1 non-finite"):
        quantize_weight_per_channel(bad, name="q_proj.weight")
    with pytest.raises(QuantError, match="weight: expected 2 dims"):
        quantize_weight_per_channel(torch.randn(8))
    with pytest.raises(QuantError, match="weight: dtype torch.int32"):
        quantize_weight_per_channel(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(QuantError, match="weight: empty"):
        quantize_weight_per_channel(torch.empty(0, 4))
    with pytest.raises(QuantError, match="o_proj: x_min 2.0 > x_max 1.0"):
        static_activation_params(2.0, 1.0, torch.bfloat16, name="o_proj")
    with pytest.raises(QuantError, match="o_proj x_max: not finite"):
        static_activation_params(-1.0, float("inf"), torch.bfloat16, name="o_proj")
    with pytest.raises(QuantError, match="model dtype torch.int8"):
        static_activation_params(-1.0, 1.0, torch.int8)
    q, ws, _ = quantize_weight_per_channel(w)
    s, o = static_activation_params(-1.0, 1.0, torch.float32)
    with pytest.raises(QuantError, match="lin.weight_scale: expected torch.float32 \\[4, 1\\]"):
        deq_scale_and_quant_bias(s, o, q, ws[:3], name="lin")
    with pytest.raises(QuantError, match="lin.input_offset: must be an integer"):
        deq_scale_and_quant_bias(s, o + 0.5, q, ws, name="lin")
    with pytest.raises(QuantError, match="lin.weight: expected a non-empty 2-D int8"):
        deq_scale_and_quant_bias(s, o, q.float(), ws, name="lin")
    with pytest.raises(QuantError, match="lin.bias: expected shape \\[4\\]"):
        deq_scale_and_quant_bias(s, o, q, ws, bias=torch.zeros(5), name="lin")
    with pytest.raises(QuantError, match="x_q: expected int8 \\[..., 8\\]"):
        int_matmul(torch.zeros(2, 7, dtype=torch.int8), q)
    with pytest.raises(QuantError, match="fa_q: lo \\[2\\] and hi \\[3\\] differ"):
        fa_scale(torch.zeros(2), torch.zeros(3), torch.bfloat16, name="fa_q")
    with pytest.raises(QuantError, match="x: 1 non-finite"):
        dynamic_quant_per_token(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(QuantError, match="deq_scale: expected float32 or int64"):
        deq_scale_to_float32(torch.zeros(2, dtype=torch.int32))
