"""The per-channel weight quantizer against its formula, bit for bit: chunked torch ops, FP8 block weights
quantized without being dequantized whole, and the native kernels (pipeline/quant/numerics/native) against both, with
their build, switches and fallback."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8_codes import bits, every_code
from pipeline.quant.numerics import native as native_kernels
from pipeline.io.fp8 import BlockRows, quantize_fp8_blocks
from pipeline.quant.numerics import qparams
from pipeline.quant.numerics.qparams import QuantError, quantize_weight_per_channel


# ----- the quantizer ----------------------------------------------------------------------------------
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunked_weight_quantization_is_the_formula(monkeypatch, dtype, native):
    """Blocks of rows (forced small, with a ragged last block; bf16 with native: the kernel) give the
    one-shot formula's int8 and scale; a NaN or Inf in any row is found through that row's scale."""
    monkeypatch.setattr(qparams, "_BLOCK_ELEMENTS", 3 * 40)
    w = (torch.randn(23, 40, generator=torch.Generator().manual_seed(2)) * 0.05).to(dtype)
    w[4] = 0
    ws = torch.maximum(w.abs().amax(dim=1, keepdim=True) / 127, torch.tensor(qparams.F32_EPS, dtype=dtype))
    q, got_ws, wo = quantize_weight_per_channel(w, native=native)
    assert torch.equal(q, torch.clamp(torch.round(w / ws), -128, 127).to(torch.int8))
    assert torch.equal(bits(got_ws), bits(ws)) and torch.equal(wo, torch.zeros_like(ws))
    for row in (0, 10, 22):
        for v, k in ((float("nan"), 1), (float("inf"), 2), (-float("inf"), 1)):
            bad = w.clone()
            bad[row, :k] = v
            with pytest.raises(QuantError, match=f"lin.weight: {k} non-finite values"):
                quantize_weight_per_channel(bad, "lin.weight", native=native)


def test_native_bf16_kernel_on_every_bf16_value():
    """Every finite bf16 bit pattern (shuffled into rows, so that row maxima range from subnormal to the
    largest finite), plus rows with an exact 127.5 case: the kernel's int8 and scales are torch's."""
    if native_kernels.library() is None:
        pytest.skip(native_kernels.status())
    pats = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    pats = pats[torch.isfinite(pats)]
    perm = torch.randperm(len(pats), generator=torch.Generator().manual_seed(4))
    w = pats[perm][: (len(pats) // 250) * 250].view(-1, 250).contiguous()
    w = torch.cat([w, pats[:250].view(1, 250), torch.tensor([[127.5, -127.5, 1.0] + [0.0] * 247],
                                                            dtype=torch.bfloat16)])
    got = quantize_weight_per_channel(w, native=True)
    want = quantize_weight_per_channel(w, native=False)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("block", [(128, 128), (64, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_block_rows_quantize_as_their_dequantization(dtype, block, native):
    """An FP8 weight quantized without being dequantized whole (bf16: the native kernel, one pass per
    row; else, and with native=False, torch ops a block row at a time) gives the int8 and scales of
    quantizing its dequantization, bit for bit: every code, ragged edges, an all-zero row, scales from tiny
    to large (a block row whose s * 2^8 overflows float32 takes the formula), negative and zero scales."""
    w = every_code((300, 260))
    w.view(torch.uint8)[7] = 0  # an all-zero row
    r, c = math.ceil(300 / block[0]), math.ceil(260 / block[1])
    g = torch.Generator().manual_seed(5)
    s = torch.rand(r, c, generator=g) * 10.0 ** torch.randint(-30, 3, (r, c), generator=g).float()
    s[0, 0], s[0, -1], s[-1, 0] = 1.4e-45, -0.0, -3.5
    if dtype == torch.float32:  # s * 2^8 overflows float32, the products (codes kept small) do not
        s[1, 1] = 5e36
        w.view(torch.uint8)[block[0]:2 * block[0], block[1]:2 * block[1]] &= 0x8F
    rows = BlockRows(w, s, block, "x.weight", dtype)
    want = quantize_weight_per_channel(rows.materialize(), "x.weight")
    got = quantize_weight_per_channel(rows, "x.weight", native=native)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))
    assert got[1].dtype == dtype and bool((got[0][7] == 0).all())


@pytest.mark.parametrize("shape", [(1536, 7168), (7168, 2048), (576, 1000)])
def test_native_kernel_on_release_like_weights(shape):
    """Gaussian weights in the release's FP8 form (V3's shapes and a ragged one): the kernel's int8 and
    scales are the torch path's and those of the dequantized weight, bit for bit."""
    g = torch.Generator().manual_seed(shape[0])
    w8, s = quantize_fp8_blocks(torch.randn(*shape, generator=g).mul_(shape[1] ** -0.5).to(torch.bfloat16))
    rows = BlockRows(w8, s)
    want = quantize_weight_per_channel(rows.materialize())
    for native in (True, False):
        got = quantize_weight_per_channel(rows, native=native)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want)), native


def test_native_kernel_is_built_where_a_compiler_is(tmp_path):
    """Where a C compiler is on PATH (CI, this machine) the kernel must build: a silent fall back to the
    torch ops would hide a broken build. DSQUANT_NATIVE=0 turns it off; a compiler that fails leaves the
    torch ops, with the reason, and the same results."""
    if native_kernels._compiler() is None:
        pytest.skip("no C compiler on PATH: the torch ops run (tested above)")
    assert native_kernels.library() is not None, native_kernels.status()
    code = ("import torch; from pipeline.quant.numerics import native;"
            "from pipeline.quant.numerics.qparams import quantize_weight_per_channel;"
            "w = torch.linspace(-3, 3, 64 * 48).view(64, 48).to(torch.bfloat16);"
            "print(native.status()); print(quantize_weight_per_channel(w)[0].sum().item())")
    env = {**os.environ, "DSQUANT_CACHE_DIR": str(tmp_path)}
    runs = {how: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=extra,
                                cwd=Path(__file__).parents[1]).stdout.splitlines()
            for how, extra in [("native", env), ("off", {**env, "DSQUANT_NATIVE": "0"}),
                               ("broken", {**env, "CC": "false"})]}
    assert runs["native"][0].startswith(f"native ({tmp_path}")
    assert runs["off"][0] == "torch ops (disabled by DSQUANT_NATIVE=0)"
    assert runs["broken"][0].startswith("torch ops (false -O3") and "failed on fp8_int8.c" in runs["broken"][0]
    assert runs["native"][1] == runs["off"][1] == runs["broken"][1]


@pytest.mark.parametrize("native, dtype, scale, code", [
    (native, torch.float16, 1e3, None) for native in (True, False)] + [
    (native, torch.bfloat16, float("inf"), None) for native in (True, False)] + [
    (True, torch.bfloat16, 1.0, 0x7F)])  # the torch ops decode NaN codes as anything: the reader rejects them first
def test_fp8_block_rows_non_finite_results_name_the_weight(dtype, scale, code, native):
    """Products that overflow the model dtype, an infinite scale, a NaN code: QuantError naming the weight."""
    w = every_code((130, 64))
    if code is not None:
        w.view(torch.uint8)[129, 3] = code
    s = torch.ones(2, 1)
    s[1, 0] = scale
    with pytest.raises(QuantError, match=r"x.weight: \d+ non-finite values"):
        quantize_weight_per_channel(BlockRows(w, s, (128, 128), "x.weight", dtype), "x.weight", native=native)


def test_row_sums_are_exact():
    """The kernel's (and torch's, on a non-contiguous view the kernel declines) int64 row sums, extreme rows
    included."""
    q = torch.randint(-128, 128, (1000, 3000), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    q[0], q[1] = -128, 127
    want = q.to(torch.int64).sum(dim=1)
    assert torch.equal(qparams._row_sums(q), want) and want[0] == -128 * 3000
    if native_kernels.library() is not None:
        assert torch.equal(native_kernels.int8_row_sums(q), want)
    assert native_kernels.int8_row_sums(q[:, ::2]) is None
    assert torch.equal(qparams._row_sums(q[:, ::2]), q[:, ::2].to(torch.int64).sum(dim=1))
