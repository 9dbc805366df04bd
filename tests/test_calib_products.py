"""How the calibration forward multiplies bf16/fp16 operands (pipeline.quant.numerics.products, Recipe.calib_products):
``fp32`` is the fp32 GEMM of the upcast operands rounded once, bit for bit, and within one rounding of torch's
own reduced-precision matmul; ``auto`` (the default) upcasts only where torch has no native kernel; only the
calibration thread sees the mode; the statistics it gives stay within a
named bound of the reference mode's (``model``), and the static linears' and the weights' are the same."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.quant.numerics.observers import MinMax
from pipeline.quant.numerics.products import calibration_products
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.recipe import Recipe
from test_layerwise_calibration import embedded_samples, layer_stats, max_relative_change

# One rounding apart: fp32 sums in two orders differ by a few fp32 ulps, which moves a result to the
# neighbouring bf16 (fp16) value at most: |diff| <= one ulp of the result = 2^-7 (2^-10) of its magnitude.
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
# The bound on any recorded statistic's relative change, fp32 against model products. Measured on the
# embedded model (24 samples, AVX2 CPU): the static linears' min/max equal; FA3 query windows moved by a
# bf16 ulp, and one head's by 5.6% (its scale 3.9%) where two candidate 0.9999-windows were near-tied and
# the narrower one changed sides. Any change of backend does the same (oneDNN's AMX GEMMs, cuBLAS).
CALIB_PRODUCTS_REL = 0.08


def _operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, 96, generator=g).to(dtype)
    w = (torch.randn(40, 96, generator=g) / 10).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    return x, w, b


def _within_one_rounding(got, ref, dtype):
    assert got.dtype == ref.dtype == dtype
    bound = ULP[dtype] * ref.float().abs() + 1e-30
    assert bool(((got.float() - ref.float()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_products_are_the_upcast_gemm_rounded_once(dtype):
    x, w, b = _operands(dtype)
    q, k = x.unflatten(-1, (4, 24)), w[:24].unflatten(-1, (4, 24)).transpose(0, 1)        # [2, 9, 4, 24], [4, 24, 24]
    native = (F.linear(x, w, b), F.linear(x, w), torch.einsum("bshd,hdc->bshc", q, k))
    with calibration_products("fp32"):
        got = (F.linear(x, w, b), torch.nn.functional.linear(x, w), torch.einsum("bshd,hdc->bshc", q, k),
               torch.einsum("bshd,hdc->bshc", [q, k]))
    want = (F.linear(x.float(), w.float(), b.float()).to(dtype), F.linear(x.float(), w.float()).to(dtype),
            torch.einsum("bshd,hdc->bshc", q.float(), k.float()).to(dtype))
    for g, r in zip(got, want + want[2:]):
        assert torch.equal(g, r)
    for g, n in zip(got, native + native[2:]):
        _within_one_rounding(g, n, dtype)


def test_other_operands_and_the_model_mode_are_left_alone():
    x, w, b = _operands(torch.bfloat16)
    xf, wf = x.float(), w.float()
    def mixed():   # bf16 with float16 operands: not the mode's to upcast, torch's own answer (or error)
        try:
            return torch.einsum("sd,kd->sk", x[0], w.to(torch.float16))
        except RuntimeError as e:
            return type(e).__name__

    with calibration_products("fp32"):
        f32 = F.linear(xf, wf)                                   # float32: nothing to upcast
        inside = mixed()
    outside = mixed()
    assert torch.equal(f32, F.linear(xf, wf))
    assert torch.equal(inside, outside) if isinstance(outside, torch.Tensor) else inside == outside
    with calibration_products("model"):
        assert torch.equal(F.linear(x, w, b), F.linear(x, w, b))


def test_auto_upcasts_only_where_torch_has_no_native_kernel(monkeypatch):
    import pipeline.quant.numerics.products as products

    x, w, _ = _operands(torch.bfloat16, seed=3)
    upcast = F.linear(x.float(), w.float()).to(torch.bfloat16)
    native = products.has_native_gemm(torch.bfloat16, torch.device("cpu"))
    with calibration_products("auto"):
        got = F.linear(x, w)
    assert torch.equal(got, F.linear(x, w) if native else upcast)
    assert products.resolved("auto", torch.bfloat16) == ("model (auto: torch's bfloat16 matmuls on cpu)" if native else
                                                         "fp32 (auto: torch has no native bfloat16 GEMM on this cpu)")
    assert products.resolved("fp32", torch.bfloat16) == "fp32 (asked)"
    assert products.resolved("auto", torch.float32) == "float32 model (nothing to upcast)"
    assert products.resolved("auto", torch.bfloat16, "cuda") == "model (auto: torch's bfloat16 matmuls on cuda)"
    for has in (True, False):
        monkeypatch.setattr(products, "has_native_gemm", lambda dt, dev, has=has: has)
        with calibration_products("auto"):
            got = F.linear(x, w)
        assert torch.equal(got, F.linear(x, w) if has else upcast), has


def test_only_the_calibration_thread_sees_the_mode():
    x, w, _ = _operands(torch.bfloat16, seed=1)
    out: dict = {}
    with calibration_products("fp32"):
        t = threading.Thread(target=lambda: out.update(other=F.linear(x, w)))
        t.start()
        t.join()
        out["here"] = F.linear(x, w)
    assert torch.equal(out["other"], F.linear(x, w))                              # torch's own bf16 linear
    assert torch.equal(out["here"], F.linear(x.float(), w.float()).to(torch.bfloat16))


def test_the_recipe_names_a_bad_mode():
    want = "recipe: field 'calib_products' must be one of \\('auto', 'fp32', 'model'\\), got 'fp64'"
    with pytest.raises(QuantError, match=want):
        Recipe(calib_products="fp64")
    with pytest.raises(QuantError, match="calib_products"):
        Recipe.from_dict({"calib_products": 32})
    assert Recipe().calib_products == "auto" and Recipe.from_dict({}).to_dict()["calib_products"] == "auto"


def test_jobs_quantize_flag():
    from jobs.quantize import make_job, parse_args

    assert make_job(parse_args(["--calib-products", "model"]))[2].calib_products == "model"
    assert make_job(parse_args([]))[2].calib_products == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--calib-products", "fp16"])


def test_statistics_stay_within_the_bound_of_the_reference_mode():
    """The embedded model (bf16), layer by layer: every recorded end and scale within CALIB_PRODUCTS_REL of
    the reference mode's, the counts equal (measured on an AVX2 CPU: the static linears' min/max equal)."""
    samples = embedded_samples(24)
    ref = layer_stats(str(EMBEDDED_MODEL_DIR), samples, 1, Recipe(calib_products="model"))
    got = layer_stats(str(EMBEDDED_MODEL_DIR), samples, 1, Recipe(calib_products="fp32"))
    ends, scales = max_relative_change(ref, got)
    assert ends <= CALIB_PRODUCTS_REL and scales <= CALIB_PRODUCTS_REL, (ends, scales)
    assert any(isinstance(v, MinMax) for v in ref.values())


def test_kept_weights_give_the_same_bits_and_a_new_activation_sees_new_weights(monkeypatch):
    from pipeline.quant.numerics.products import KEEP_ENV

    lin = torch.nn.Linear(96, 40).to(torch.bfloat16)
    x, _, _ = _operands(torch.bfloat16, seed=2)
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16)
    with calibration_products("fp32"):
        kept = [lin(x), lin(x)]                       # the second call reuses the upcast weight and bias
    monkeypatch.setenv(KEEP_ENV, "0")
    with calibration_products("fp32"):
        upcast_each_call = lin(x)
    assert all(torch.equal(t, want) for t in (*kept, upcast_each_call))
    monkeypatch.delenv(KEEP_ENV)
    with torch.no_grad():
        lin.weight.mul_(2)                            # between activations (smoothing does this)
    with calibration_products("fp32"):
        assert torch.equal(lin(x), F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16))
    monkeypatch.setenv(KEEP_ENV, "lots")
    with pytest.raises(QuantError, match=f"{KEEP_ENV}: expected a number of GB, got 'lots'"):
        with calibration_products("fp32"):
            pass


def test_weights_kept_across_activations_until_cleared():
    """A pipeline stage's KeptWeights: the second activation reuses the first one's upcast weight; after an
    in-place change the owner clears it and the next activation sees the new weight."""
    from pipeline.quant.numerics.products import KeptWeights

    lin = torch.nn.Linear(96, 40, bias=False).to(torch.bfloat16)
    x, _, _ = _operands(torch.bfloat16, seed=4)
    kept = KeptWeights(budget=1 << 20)
    for _ in range(2):
        with calibration_products("fp32", kept):
            assert torch.equal(lin(x), F.linear(x.float(), lin.weight.float()).to(torch.bfloat16))
    assert list(kept.entries) == [id(lin.weight)] and kept.left == (1 << 20) - 40 * 96 * 4
    with torch.no_grad():
        lin.weight.mul_(2)
    kept.clear()
    with calibration_products("fp32", kept):
        assert torch.equal(lin(x), F.linear(x.float(), lin.weight.float()).to(torch.bfloat16))
    small = KeptWeights(budget=100)                 # too small to keep it: upcast per call, the same bits
    with calibration_products("fp32", small):
        assert torch.equal(lin(x), F.linear(x.float(), lin.weight.float()).to(torch.bfloat16))
    assert small.entries == {}


def test_auto_leaves_the_rerun_fingerprint_as_it_was():
    """Outputs written before the field existed stay up to date for a scheduled rerun with the default (as long
    as nothing else changed: the calibration semantics are part of the fingerprint); an explicit mode is part
    of the fingerprint."""
    from pipeline.quant.job import job_state

    before = {k: v for k, v in Recipe().to_dict().items()
              if k not in ("calib_products", "linear_rules", "fa_include", "fa_exclude", "steps", "drop_mtp",
                           "mlp_smooth_layers", "mlp_smooth_alpha")}
    assert Recipe().fingerprint() == before and "calib_products" in Recipe().to_dict()
    assert Recipe(drop_mtp=True).fingerprint() == {**before, "drop_mtp": True}   # also a later field
    assert Recipe(calib_products="model").fingerprint() == {**before, "calib_products": "model"}
    from pipeline.io.checkpoint import CheckpointReader
    from tiny import TINY_FIXTURE

    def key(recipe):
        return job_state.JobKey.of(CheckpointReader(str(TINY_FIXTURE)), recipe, [[1, 2, 3]], smooth_alpha=0.5,
                                   shard_bytes=1 << 30, mindie_format=False)

    assert key(Recipe()).recipe == before
    assert key(Recipe()).job == key(Recipe(calib_products="auto")).job != key(Recipe(calib_products="fp32")).job
