"""pipeline.engine.layers.qlinear: int8 linears that compute with the stored integers, against the quantizer's real
output for the tiny fixture model, the fake-quant reference (QuantLinear), exact int64 products, msModelSlim's
own ascendV1 files (bf16 and fp16), and the float model.

Bounds used below, and why:
- OUTPUT_ULPS = 0: the module's output in the reference mode (``epilogue=EXACT``) equals QuantLinear's bit
  for bit. Both quantize the activation with the same float32 ops, both get the exact integer product, and
  both run the same epilogue (float64 multiply in the same order, rounded to float32, then to the model
  dtype), so no rounding can differ.
- FAST_EPILOGUE_ULPS = 4 (float32) and FAST_BF16_ULPS = 1: the float32 epilogue (``epilogue=FAST``) against the
  reference; at most three float32 roundings instead of one (qlinear's module docstring derives it).
- The integer product equals the int64 product exactly (0 difference) on every kernel, K up to 4096.
- SQNR of the module against the float linear (float weights of the source checkpoint, float32 matmul), on
  the float model's own activations for calibration texts: measured minima 28.6 dB (W8A8, the o_proj
  layers) and 35.6 dB (W8A8_DYNAMIC, layer 0's down_proj); the thresholds leave about 3.5 dB of margin.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from pipeline.engine import int8_arith as ql
from pipeline.engine.int8_arith import (FLOAT64, FP32_CHUNKED, INT_MM, Int8LinearError, decode_deq_scale,
                                       int8_matmul, select_kernel)
from pipeline.engine.layers.qlinear import (EXACT, FAST, FAST_EPILOGUE_ULPS, NATIVE, W8A8DynamicLinear, W8A8StaticLinear,
                                     build_from_checkpoint, build_int8_linear, linear_tensors)
from pipeline.model.loading import load_model
from pipeline.quant.numerics import qparams
from pipeline.format.description import W8A8, W8A8_DYNAMIC
from pipeline.format.reader import read_quantized
from pipeline.quant.evaluation.fakequant import QuantLinear
from pipeline.quant.job.run import QuantizeOptions, calibration_samples
from tiny import FIXTURES, TINY_FIXTURE

OUTPUT_ULPS = 0                 # reference mode vs fake-quant reference: bit-identical (module docstring)
FAST_BF16_ULPS = 1              # fast epilogue vs reference, cast to bf16
SQNR_MIN_DB = {W8A8: 25.0, W8A8_DYNAMIC: 32.0}   # measured minima 28.6 and 35.6 dB
BIAS_ONCE_TOL = 0.25            # |static linear with bias - float linear + bias|, bias 5.0 (measured 0.068)
CALIB_SAMPLES = 4               # calibration texts run through the float model for activations
N_STATIC, N_DYNAMIC = 12, 57    # tiny fixture, Recipe(): 4 attention linears x 3 layers; 3 dense + 2 x 9 x 3
OPTS = QuantizeOptions(calib_path=str(FIXTURES / "calib.json"))
STATIC_NAME = "model.layers.0.self_attn.q_a_proj"
DYNAMIC_NAME = "model.layers.0.mlp.gate_proj"


# ----- fixtures: one real quantized directory, real activations ------------------------------------
@pytest.fixture(scope="module")
def quantized(tiny_quantized):
    """(types, tensors) of the tiny fixture quantized by the project's quantizer (seed dialect, bf16, on
    OPTS's texts: conftest's session copy)."""
    _, types, tensors = read_quantized(tiny_quantized)
    return types, tensors


@pytest.fixture(scope="module")
def activations():
    """Input of every nn.Linear of the float bf16 model (name -> [tokens, k]) on calibration texts: the
    activations the static scales were calibrated on."""
    model = load_model(str(TINY_FIXTURE), dtype=torch.bfloat16, device="cpu", with_mtp=False)
    samples = calibration_samples(str(TINY_FIXTURE), OPTS, model.config.max_position_embeddings)
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(name):
        def f(module, args):
            seen.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]).clone())
        return f

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.inference_mode():
        for s in samples[:CALIB_SAMPLES]:
            model(torch.tensor([s]))
    for h in handles:
        h.remove()
    return {k: torch.cat(v) for k, v in seen.items()}


def quant_prefixes(types) -> list[str]:
    return [k[:-len(".weight")] for k, v in types.items() if k.endswith(".weight") and v in (W8A8, W8A8_DYNAMIC)]


def input_for(prefix: str, k: int, acts: dict, dtype: torch.dtype) -> torch.Tensor:
    """The recorded activation of ``prefix``; for a linear the float run did not reach (an MTP layer, an
    expert no token chose), a seeded random one of the same scale."""
    if prefix in acts:
        return acts[prefix].to(dtype)
    g = torch.Generator().manual_seed(sum(map(ord, prefix)))
    return torch.randn(64, k, generator=g).to(dtype)


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two same-dtype float tensors (0 = bit-identical)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    ia, ib = a.contiguous().view(bits).long(), b.contiguous().view(bits).long()
    sign = 1 << (8 * a.element_size() - 1)
    ia = torch.where(ia < 0, -(ia + sign), ia)  # monotonic ordering of sign-magnitude floats
    ib = torch.where(ib < 0, -(ib + sign), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


# ----- the module against the fake-quant reference, on the project's own output --------------------
def test_every_quantized_linear_equals_fakequant(quantized, activations):
    types, tensors = quantized
    prefixes = quant_prefixes(types)
    kinds = [types[p + ".weight"] for p in prefixes]
    assert (kinds.count(W8A8), kinds.count(W8A8_DYNAMIC)) == (N_STATIC, N_DYNAMIC)
    worst = {"fp32": 0, "bf16": 0}
    for p in prefixes:
        mod = build_from_checkpoint(p, tensors, types, epilogue=EXACT)
        assert isinstance(mod, W8A8StaticLinear if types[p + ".weight"] == W8A8 else W8A8DynamicLinear)
        x = input_for(p, mod.in_features, activations, torch.bfloat16)
        y = mod(x)
        ref = QuantLinear(types[p + ".weight"], linear_tensors(tensors, p))(x)
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        assert ulp_diff(y, ref) <= OUTPUT_ULPS, p
        # the torch path's kernel, or the fused C forward where it runs (the same bits: test_native_linear.py)
        assert mod.last_kernel in (select_kernel("cpu", mod.out_features, mod.in_features), NATIVE), p
        x32 = x.float()  # a float32 model: the float32 result of the epilogue itself, uncast
        assert ulp_diff(mod(x32), QuantLinear(types[p + ".weight"], linear_tensors(tensors, p))(x32)) <= OUTPUT_ULPS, p
        one_ulp_up = (y.view(torch.int16) + 1).view(torch.bfloat16)  # the comparison sees a single ulp
        assert ulp_diff(one_ulp_up, ref) == 1 + ulp_diff(y, ref), p
        # leading dims are kept: a [B, S, k] input gives [B, S, n], the same rows
        assert torch.equal(mod(x[:12].reshape(3, 4, -1)), y[:12].reshape(3, 4, -1)), p
        fast = build_from_checkpoint(p, tensors, types, epilogue=FAST)   # the float32 epilogue
        worst["fp32"] = max(worst["fp32"], ulp_diff(fast(x32), mod(x32)))
        worst["bf16"] = max(worst["bf16"], ulp_diff(fast(x), y))
    assert worst["fp32"] <= FAST_EPILOGUE_ULPS and worst["bf16"] <= FAST_BF16_ULPS, worst


def test_activation_quantization_is_the_quantizers(quantized, activations):
    """The int8 activations are qparams' own, bit for bit, on real inputs and on exact ties (half steps
    round to even)."""
    types, tensors = quantized
    t = linear_tensors(tensors, STATIC_NAME)
    x = activations[STATIC_NAME]
    assert torch.equal(ql.quantize_static(x, t["input_scale"], t["input_offset"]),
                       qparams.quantize_static(x, t["input_scale"], t["input_offset"]))
    x_q, s = ql.quantize_per_token(activations[DYNAMIC_NAME])
    ref_q, ref_s = qparams.dynamic_quant_per_token(activations[DYNAMIC_NAME])
    assert torch.equal(x_q, ref_q) and torch.equal(s, ref_s)
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.5, -128.5, 300.0])
    got = ql.quantize_static(ties, torch.tensor([1.0]), torch.tensor([0.0]))
    assert got.tolist() == [0, 2, 2, 0, -2, 126, 127, -128, 127]


# ----- the exact integer product --------------------------------------------------------------------
def int64_product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return a.long() @ w.long().T


@pytest.mark.parametrize("kernel", [FP32_CHUNKED, FLOAT64, INT_MM])
def test_integer_product_is_exact(kernel):
    g = torch.Generator().manual_seed(1)
    for k in (1, 7, 8, 1023, 1024, 1025, 4096):
        for m, n in ((1, 24), (3, 20), (40, 16)):
            if kernel == INT_MM and (k % 8 or n % 8):
                with pytest.raises(Int8LinearError, match="int_mm needs k and n multiples of 8"):
                    int8_matmul(torch.zeros(m, k, dtype=torch.int8), torch.zeros(n, k, dtype=torch.int8), kernel)
                continue
            rand = (torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8),
                    torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8))
            worst = (torch.full((m, k), -128, dtype=torch.int8), torch.full((n, k), -128, dtype=torch.int8))
            sign = (torch.randint(0, 2, (m, k), generator=g) * 255 - 128).to(torch.int8)
            extreme = (sign, (torch.randint(0, 2, (n, k), generator=g) * 255 - 128).to(torch.int8))
            for a, w in (rand, worst, extreme):
                got = int8_matmul(a, w, kernel)
                assert got.dtype == torch.float64
                assert torch.equal(got.long(), int64_product(a, w)), (kernel, k, m, n)
                assert torch.equal(got, got.round())


def test_chunking_is_what_makes_fp32_exact():
    """One fp32 GEMM over K = 4095 of 127 * 127 gives 66048255, an odd number above 2^24 that float32
    cannot hold; the chunked kernel gets it exactly. A chunk above 1024 is refused."""
    a = torch.full((2, 4095), 127, dtype=torch.int8)
    w = torch.full((8, 4095), 127, dtype=torch.int8)
    exact = int64_product(a, w)
    assert int(exact[0, 0]) == 127 * 127 * 4095 > 2 ** 24
    naive = (a.float() @ w.float().T).long()
    assert not torch.equal(naive, exact)
    assert torch.equal(int8_matmul(a, w, FP32_CHUNKED).long(), exact)
    assert ql.FP32_EXACT_CHUNK * 128 * 128 == 2 ** 24
    with pytest.raises(Int8LinearError, match="chunk 2048"):
        int8_matmul(a, w, FP32_CHUNKED, chunk=2048)


def test_kernel_choice():
    assert select_kernel("cpu", 64, 128) == INT_MM
    assert select_kernel("cpu", 61, 127) == FP32_CHUNKED
    assert select_kernel("cpu", 64, 1) == FP32_CHUNKED     # CPU _int_mm is wrong for k = 1
    assert select_kernel("cuda", 64, 128) == INT_MM
    assert select_kernel(torch.device("cuda", 0), 64, 131064) == INT_MM
    assert select_kernel("cuda", 60, 128) == FLOAT64       # n not a multiple of 8
    assert select_kernel("cuda", 64, 100) == FLOAT64       # k not a multiple of 8
    assert select_kernel("cuda", 64, 131072) == FLOAT64    # int32 could overflow


def test_every_kernel_gives_the_same_output(quantized, activations):
    """Forcing fp32_chunked or float64 instead of int_mm (with its row padding for fewer than 17 rows)
    changes no bit."""
    types, tensors = quantized
    for p in (STATIC_NAME, DYNAMIC_NAME, "model.layers.2.mlp.shared_experts.down_proj"):
        mod = build_from_checkpoint(p, tensors, types)
        x = activations[p]
        auto = mod(x)
        assert mod.last_kernel in (INT_MM, NATIVE)     # NATIVE: the C forward (tests/test_native_linear.py)
        for kernel in (FP32_CHUNKED, FLOAT64):
            mod.kernel = kernel
            assert torch.equal(mod(x), auto), (p, kernel)
            assert torch.equal(mod(x[:5]), auto[:5]), (p, kernel)
            assert mod.last_kernel == kernel
        mod.kernel = "int4"
        with pytest.raises(Int8LinearError, match=f"{p}: unknown kernel 'int4'"):
            mod(x)
    with pytest.raises(Int8LinearError, match=f"{STATIC_NAME}: unknown kernel 'int4'"):
        build_from_checkpoint(STATIC_NAME, tensors, types, kernel="int4")


def test_load_state_dict_replaces_every_tensor(quantized, activations):
    """After load_state_dict (in-place copies) the module computes with the new tensors, the cached float32
    weight of the fp32_chunked kernel included."""
    types, tensors = quantized
    for a, b in ((STATIC_NAME, "model.layers.1.self_attn.q_a_proj"),
                 (DYNAMIC_NAME, "model.layers.0.mlp.up_proj")):
        own = {k: v.clone() for k, v in linear_tensors(tensors, a).items()}  # the module holds, not copies
        mod_a, mod_b = build_int8_linear(a, types[a + ".weight"], own), build_from_checkpoint(b, tensors, types)
        x = activations[a]
        before = mod_a(x)
        mod_a.load_state_dict(mod_b.state_dict())
        after = mod_a(x)
        assert not torch.equal(after, before)
        assert torch.equal(after, mod_b(x)), (a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_int_mm_equals_cpu(quantized, activations):
    types, tensors = quantized
    for p in (STATIC_NAME, DYNAMIC_NAME):
        cpu = build_from_checkpoint(p, tensors, types)
        gpu = build_from_checkpoint(p, tensors, types).to("cuda")
        x = activations[p]
        for rows in (x, x[:3]):
            assert torch.equal(gpu(rows.cuda()).cpu(), cpu(rows)), p
            assert gpu.last_kernel == INT_MM


# ----- deq_scale: float32 and int64 bit patterns --------------------------------------------------
def test_deq_scale_bit_patterns_decode_to_float32():
    assert float(decode_deq_scale(torch.tensor([0x3F800000], dtype=torch.int64))) == 1.0
    assert float(decode_deq_scale(torch.tensor([0x40490FDB], dtype=torch.int64))) == float(torch.tensor(math.pi))
    f = torch.tensor([0.0123, 1e-5, 3.5, 2.0 ** -126, 2.0 ** -140, 0.0], dtype=torch.float32)
    signed = f.view(torch.int32).to(torch.int64)                  # msModelSlim's form
    for stored in (signed, signed & 0xFFFFFFFF):
        assert torch.equal(decode_deq_scale(stored).view(torch.int32), f.view(torch.int32))
    assert torch.equal(decode_deq_scale(f), f)
    assert torch.equal(decode_deq_scale(signed), qparams.deq_scale_to_float32(signed))
    with pytest.raises(Int8LinearError, match="d: int64 values outside"):
        decode_deq_scale(signed + 2 ** 32, "d")
    with pytest.raises(Int8LinearError, match="d: negative"):
        decode_deq_scale(torch.tensor([0xBF800000], dtype=torch.int64), "d")       # -1.0
    with pytest.raises(Int8LinearError, match="d: 1 non-finite"):
        decode_deq_scale(torch.tensor([0x7FC00000], dtype=torch.int64), "d")       # NaN
    with pytest.raises(Int8LinearError, match="d: dtype torch.float16"):
        decode_deq_scale(f.half(), "d")


def test_int64_deq_scale_gives_the_same_output(quantized, activations):
    """The same linear with deq_scale stored as the fp16 models store it (int64 bit pattern)."""
    types, tensors = quantized
    t = linear_tensors(tensors, STATIC_NAME)
    as_int64 = dict(t, deq_scale=qparams.deq_scale_to_int64(t["deq_scale"]))
    x = activations[STATIC_NAME]
    assert torch.equal(build_int8_linear(STATIC_NAME, W8A8, as_int64)(x), build_int8_linear(STATIC_NAME, W8A8, t)(x))


@pytest.mark.parametrize("fixture", ["msmodelslim-v1-fp16", "msmodelslim-v1-bf16"])
def test_msmodelslim_ascendv1_files_equal_fakequant(fixture, activations):
    """msModelSlim's own output (ascendV1: float32 scales, no weight_scale on static layers; fp16: deq_scale
    as int64 bit patterns), MTP layer included: every linear equals the fake-quant reference."""
    _, types, tensors = read_quantized(str(FIXTURES / fixture))
    md = torch.float16 if "fp16" in fixture else torch.bfloat16
    prefixes = quant_prefixes(types)
    assert len(prefixes) == N_STATIC + N_DYNAMIC + 4 + 27  # + the MTP layer's attention and MoE linears
    deq_dtypes = set()
    for p in prefixes:
        mod = build_from_checkpoint(p, tensors, types, epilogue=EXACT)
        x = input_for(p, mod.in_features, activations, md)
        ref = QuantLinear(types[p + ".weight"], linear_tensors(tensors, p))(x)
        assert ulp_diff(mod(x), ref) <= OUTPUT_ULPS, p
        assert ulp_diff(build_from_checkpoint(p, tensors, types, epilogue=FAST)(x), ref) <= FAST_BF16_ULPS, p
        if isinstance(mod, W8A8StaticLinear):
            deq_dtypes.add(mod.deq_scale.dtype)
            assert torch.equal(decode_deq_scale(mod.deq_scale), qparams.deq_scale_to_float32(mod.deq_scale))
    assert deq_dtypes == {torch.int64 if md == torch.float16 else torch.float32}


# ----- bias -----------------------------------------------------------------------------------------
def test_bias_static_folded_in_quant_bias_dynamic_added(quantized, activations):
    types, tensors = quantized
    g = torch.Generator().manual_seed(3)
    # static: quant_bias built with a bias carries it; a stored bias is not added a second time
    w = torch.randn(48, 128, generator=g).bfloat16() * 0.1
    b = torch.full((48,), 5.0, dtype=torch.bfloat16)
    x = activations[STATIC_NAME]
    s, o = qparams.static_activation_params(x.min(), x.max(), torch.bfloat16)
    w8, ws, wo = qparams.quantize_weight_per_channel(w)
    deq, qb = qparams.deq_scale_and_quant_bias(s, o, w8, ws, bias=b)
    params = dict(weight=w8, input_scale=s, input_offset=o, quant_bias=qb, deq_scale=deq, weight_scale=ws,
                  weight_offset=wo)
    y = build_int8_linear("lin", W8A8, params)(x).float()
    assert torch.equal(build_int8_linear("lin", W8A8, dict(params, bias=b))(x).float(), y)
    exact = x.float() @ w.float().T + b.float()
    # the bias is there once, not twice: measured max error 0.068 (bf16 output rounding <= 0.031 at |y| < 16,
    # plus quantization), against 5.0 for a bias added twice
    assert (y - exact).abs().max() < BIAS_ONCE_TOL
    # dynamic: the bias is added in float32 after the epilogue
    t = linear_tensors(tensors, DYNAMIC_NAME)
    bias = torch.randn(t["weight"].shape[0], generator=g)
    x32 = activations[DYNAMIC_NAME].float()
    plain = build_int8_linear(DYNAMIC_NAME, W8A8_DYNAMIC, t)(x32)
    assert torch.equal(build_int8_linear(DYNAMIC_NAME, W8A8_DYNAMIC, dict(t, bias=bias))(x32), plain + bias)


# ----- bad inputs -----------------------------------------------------------------------------------
BAD_STATIC = [
    ("drop", "input_scale", "input_scale: missing"),
    ("drop", "weight", "weight: missing"),
    ("set", ("weight", lambda t: t.float()), "weight: expected a non-empty int8"),
    ("set", ("input_scale", lambda t: torch.zeros_like(t)), "input_scale: must be > 0"),
    ("set", ("input_scale", lambda t: torch.full_like(t, float("nan"))), "input_scale: 1 non-finite"),
    ("set", ("input_scale", lambda t: t.repeat(2)), "input_scale: expected a float tensor"),
    ("set", ("input_offset", lambda t: t + 0.5), "input_offset: must be an integer"),
    ("set", ("input_offset", lambda t: torch.full_like(t, 200.0)), "input_offset: must be an integer"),
    ("set", ("quant_bias", lambda t: t.long()), "quant_bias: expected int32"),
    ("set", ("quant_bias", lambda t: t[:-1]), "quant_bias: expected int32"),
    ("set", ("deq_scale", lambda t: t.half()), "deq_scale: dtype torch.float16"),
    ("set", ("deq_scale", lambda t: -t), "deq_scale: negative"),
    ("set", ("deq_scale", lambda t: t[:3]), "deq_scale: expected shape"),
    ("set", ("weight_offset", lambda t: t + 1), "weight_offset: must be all zeros"),
    ("set", ("bias", lambda t: torch.zeros(3)), "bias: expected a float tensor"),
]
BAD_DYNAMIC = [
    ("drop", "weight_scale", "weight_scale: missing"),
    ("set", ("weight_scale", lambda t: t[:-1]), "weight_scale: expected a float tensor"),
    ("set", ("weight_scale", lambda t: t.int()), "weight_scale: expected a float tensor"),
    ("set", ("weight_scale", lambda t: -t), "weight_scale: negative"),
    ("set", ("weight_scale", lambda t: t / 0), "weight_scale: 256 non-finite"),
    ("set", ("weight", lambda t: t[0]), "weight: expected a non-empty int8"),
]


@pytest.mark.parametrize("kind,name,case", [(W8A8, STATIC_NAME, c) for c in BAD_STATIC]
                         + [(W8A8_DYNAMIC, DYNAMIC_NAME, c) for c in BAD_DYNAMIC])
def test_bad_tensor_is_named(quantized, kind, name, case):
    types, tensors = quantized
    params = linear_tensors(tensors, name)
    build_int8_linear(name, kind, params)  # the unmodified tensors build
    action, what, message = case
    if action == "drop":
        params.pop(what)
    else:
        leaf, change = what
        params[leaf] = change(params.get(leaf, params["weight_scale"][:, 0]))
    with pytest.raises(Int8LinearError, match=f"^{name}.{message}"):
        build_int8_linear(name, kind, params)
    assert issubclass(Int8LinearError, ValueError)


def test_bad_type_and_input_are_named(quantized):
    types, tensors = quantized
    params = linear_tensors(tensors, STATIC_NAME)
    for kind in ("FLOAT", "W4A16"):
        with pytest.raises(ValueError, match=f"^{STATIC_NAME}: type '{kind}'"):
            build_int8_linear(STATIC_NAME, kind, params)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.nope: no 'model.layers.0.self_attn.nope.weight'"):
        build_from_checkpoint("model.layers.0.self_attn.nope", tensors, types)
    with pytest.raises(ValueError, match="self_attn.kv_b_proj: type 'FLOAT' is not quantized"):
        build_from_checkpoint("model.layers.0.self_attn.kv_b_proj", tensors, types)
    mod = build_int8_linear(STATIC_NAME, W8A8, params)
    with pytest.raises(ValueError, match=rf"^{STATIC_NAME}: input must be a float tensor \[\.\.\., 128\]"):
        mod(torch.zeros(2, 64))
    with pytest.raises(ValueError, match=f"^{STATIC_NAME}: input must be a float tensor"):
        mod(torch.zeros(2, 128, dtype=torch.int8))


# ----- against the float model ----------------------------------------------------------------------
def test_sqnr_against_the_float_linear(quantized, activations):
    """On the float model's own activations, every quantized linear is within the quantization error of
    the float linear (source weights, float32 matmul): SQNR = 10 log10(|y|^2 / |y - y_q|^2) above
    SQNR_MIN_DB for its type."""
    types, tensors = quantized
    src = load_file(str(TINY_FIXTURE / "model.safetensors"))
    worst = {W8A8: math.inf, W8A8_DYNAMIC: math.inf}
    for p in quant_prefixes(types):
        if p not in activations:
            continue
        kind = types[p + ".weight"]
        x = activations[p]
        y = x.float() @ src[p + ".weight"].float().T
        y_q = build_from_checkpoint(p, tensors, types)(x).float()
        sqnr = 10 * math.log10(float(y.pow(2).sum()) / float((y - y_q).pow(2).sum()))
        worst[kind] = min(worst[kind], sqnr)
        assert sqnr > SQNR_MIN_DB[kind], (p, sqnr)
    assert all(v < math.inf for v in worst.values())  # both kinds were measured


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 33])
def test_int_mm_on_the_cpu_needs_no_row_padding(rows):
    """The CPU's _int_mm takes any row count (only CUDA's needs 17+, padded there): exact int64 products."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randint(-128, 128, (rows, 264), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (40, 264), dtype=torch.int8, generator=g)
    exact = x.long() @ w.long().T
    assert torch.equal(ql._int_mm_int32(x, w).long(), exact)
    assert torch.equal(int8_matmul(x, w, INT_MM).long(), exact)


def test_epilogue_is_checked(quantized):
    types, tensors = quantized
    with pytest.raises(Int8LinearError, match=f"{DYNAMIC_NAME}: unknown epilogue 'fp16'"):
        build_from_checkpoint(DYNAMIC_NAME, tensors, types, epilogue="fp16")
