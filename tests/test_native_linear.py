"""pipeline.engine.native.cpu_linear: the int8 linears' fused C forward (quantize, int32 product, epilogue) equals
the torch path (the reference: quantize_static / quantize_per_token, torch._int_mm, the float64 or float32
epilogue, the casts) bit for bit, for both kinds, both epilogues, float32 and bf16 input, with and without
bias, on random values and on every linear of the embedded model; the VNNI and the plain C loops agree,
and so do the AMX tiles (on a CPU with them) and the VNNI ones;
the switches turn it off; a changed weight is repacked.

Tolerance: none. Every comparison is ``torch.equal`` (the C code runs the same float32 / float64
operations in the same order, built without FMA contraction; the integer product is exact on both).
"""

from __future__ import annotations

import pytest
import torch

from pipeline.cbuild import EXACT_FLAGS, NativeLibrary, cpu_flags
from pipeline.engine.native import cpu_linear
from pipeline.engine.worker.loader import load_quantized
from pipeline.engine.layers.qlinear import (EXACT, FAST, FP32_CHUNKED, INT_MM, NATIVE, Int8Linear, Int8LinearError,
                                     W8A8DynamicLinear, W8A8StaticLinear, quantize_per_token, quantize_static)

pytestmark = [pytest.mark.skipif(cpu_linear.library() is None, reason="no C compiler: the torch path only"),
              pytest.mark.usefixtures("one_torch_thread")]        # conftest: fast on 2 shared cores

ROWS = (1, 3, 17, 64, 300)      # 300: C row blocks of 128, 128 and 44
SHAPES = ((128, 256), (576, 256), (100, 130), (7, 5))     # (n, k): decode shapes and odd, unpadded ones


def make(kind: str, n: int, k: int, epilogue: str, bias: bool, g: torch.Generator) -> Int8Linear:
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    if kind == "static":
        return W8A8StaticLinear("lin", w, torch.tensor([0.03]), torch.tensor([-7.0]),
                                torch.randint(-20000, 20000, (n,), dtype=torch.int32, generator=g),
                                torch.rand(n, generator=g) * 1e-3, epilogue=epilogue)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return W8A8DynamicLinear("lin", w, (torch.rand(n, 1, generator=g) * 1e-2).to(torch.bfloat16), b,
                             epilogue=epilogue)


def inputs(m: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random rows with a zero row (s_tok = eps) and a row of large values (clamping) among them."""
    x = torch.randn(m, k, generator=g) * 3
    if m >= 3:
        x[1] = 0
        x[2] *= 1000
    return x.to(dtype)


def torch_path(mod: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    mod.kernel = INT_MM if mod.in_features % 8 == 0 and mod.out_features % 8 == 0 else FP32_CHUNKED
    try:
        return mod(x)
    finally:
        mod.kernel = "auto"


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("epilogue", [EXACT, FAST])
def test_native_forward_equals_the_torch_path(kind, epilogue):
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        for bias in ((False, True) if kind == "dynamic" else (False,)):
            mod = make(kind, n, k, epilogue, bias, g)
            for m in ROWS:
                for dtype in (torch.float32, torch.bfloat16):
                    x = inputs(m, k, dtype, g)
                    got = mod(x)
                    assert mod.last_kernel == NATIVE, (n, k, m)
                    want = torch_path(mod, x)
                    assert got.dtype == want.dtype == dtype and torch.equal(got, want), (kind, n, k, m, dtype, bias)
            x = inputs(6, k, torch.float32, g)     # leading dims kept; a strided view read in place
            assert torch.equal(mod(x.reshape(2, 3, k)), torch_path(mod, x).reshape(2, 3, n))
            wide = torch.randn(5, 2 * k, generator=g)[:, ::2]
            assert torch.equal(mod(wide), torch_path(mod, wide))


def test_rounding_ties_and_clamps_are_torch_round():
    """x / scale + offset landing on .5 exactly rounds half to even; beyond [-128, 127] it clamps. The
    weight [I 0] makes y_j = x_q[j] (deq_scale 1): the int8 activations themselves."""
    k = 512
    w = torch.eye(k, dtype=torch.int8)[:256].contiguous()
    mod = W8A8StaticLinear("ties", w, torch.tensor([1.0]), torch.tensor([0.0]), torch.zeros(256, dtype=torch.int32),
                           torch.ones(256))
    x = (torch.arange(k, dtype=torch.float32) - k / 2) / 2           # -128, -127.5, ..., 127.5: every half
    x = torch.stack([x, x * 3])                                      # and beyond the int8 range
    y = mod(x)
    assert mod.last_kernel == NATIVE and torch.equal(y, torch_path(mod, x))
    assert torch.equal(y, quantize_static(x[:, :256], torch.tensor(1.0), torch.tensor(0.0)).float())
    assert y[0, 1].item() == -128 and y[0, 3].item() == -126 and y[1].min().item() == -128   # -127.5 -> -128


@pytest.mark.parametrize("epilogue", [EXACT, FAST])
def test_pre_quantized_rows_and_the_exact_product(epilogue):
    """apply_quantized (the MoE's shared expert, the sharded experts) and _acc (RowParallel) on int8 rows."""
    g = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        mod = make("dynamic", n, k, epilogue, False, g)
        for m in ROWS:
            x_q, s = quantize_per_token(inputs(m, k, torch.float32, g))
            acc = mod._acc(x_q)
            assert mod.last_kernel == NATIVE and acc.dtype == torch.int32
            assert torch.equal(acc.long(), x_q.long() @ mod.weight.long().T)
            got = mod.apply_quantized(x_q, s)
            mod.kernel = FP32_CHUNKED
            assert torch.equal(got, mod.apply_quantized(x_q, s)), (n, k, m)
            mod.kernel = "auto"
    static = make("static", 64, 32, epilogue, False, g)
    x2 = inputs(5, 32, torch.float32, g)
    assert torch.equal(static.finish(static._acc(static.quantize_input(x2))), torch_path(static, x2))


def test_every_linear_of_the_embedded_model(qdir):
    model = load_quantized(qdir, fuse_moe=False).model
    mods = [m for m in model.modules() if isinstance(m, Int8Linear)]
    kinds = {type(m) for m in mods}
    assert kinds == {W8A8StaticLinear, W8A8DynamicLinear} and len(mods) > 20
    g = torch.Generator().manual_seed(2)
    for m in mods:
        for rows in (1, 17):
            x = torch.randn(rows, m.in_features, generator=g)
            got = m(x)
            assert m.last_kernel == NATIVE
            assert torch.equal(got, torch_path(m, x)), m.name


def test_large_batches_and_the_switches_use_the_torch_path(monkeypatch):
    g = torch.Generator().manual_seed(3)
    mod = make("dynamic", 64, 64, EXACT, True, g)
    x = inputs(cpu_linear.max_rows(64, 64) + 1, 64, torch.float32, g)
    threads, pool = torch.get_num_threads(), cpu_linear.threads()
    try:
        cpu_linear.set_threads(1)                         # (an engine run before may have widened the pool)
        torch.set_num_threads(2)
        y = mod(x)
        assert mod.last_kernel == INT_MM                  # auto, several threads: above max_rows, torch._int_mm
        torch.set_num_threads(1)
        assert torch.equal(mod(x), y) and mod.last_kernel == NATIVE     # one thread: the C kernel
    finally:
        torch.set_num_threads(threads)
        cpu_linear.set_threads(pool)
    mod.kernel = NATIVE
    assert torch.equal(mod(x), y) and mod.last_kernel == NATIVE
    for var, value in (("DSQUANT_KERNELS", "torch"), ("DSQUANT_NATIVE", "0"), ("DSQUANT_NATIVE_LINEAR", "0")):
        with monkeypatch.context() as mp:                # the switches are read when a module is built
            mp.setenv(var, value)
            off = make("dynamic", 64, 64, EXACT, True, torch.Generator().manual_seed(3))
        assert not off.native and mod.native, var
        assert torch.equal(off(x[:2]), y[:2]) and off.last_kernel == INT_MM, var
        off.kernel = NATIVE
        with pytest.raises(Int8LinearError, match="lin: kernel 'native' cannot run .* off when it was built"):
            off(x[:2])
    assert cpu_linear.max_rows(256, 768) == 64 and cpu_linear.max_rows(7168, 1536) == 8    # wide: fewer rows
    mod.kernel = NATIVE
    with pytest.raises(Int8LinearError, match="lin: kernel 'native' cannot run on cpu for torch.float16"):
        mod(x.half())
    with pytest.raises(Int8LinearError, match=r"lin: input must be a float tensor \[..., 64\]"):
        mod(x[:, :63])                                    # a wrong shape: the torch path's error


def test_a_changed_weight_is_repacked():
    g = torch.Generator().manual_seed(4)
    mod = make("dynamic", 64, 64, EXACT, False, g)
    x = inputs(4, 64, torch.float32, g)
    before = mod(x)
    other = make("dynamic", 64, 64, EXACT, False, g)
    mod.load_state_dict(other.state_dict())               # in place: versions change
    after = mod(x)
    assert not torch.equal(after, before) and torch.equal(after, torch_path(other, x))
    mod.weight_scale = other.weight_scale * 2             # a buffer replaced
    assert torch.equal(mod(x), torch_path(mod, x))
    mod.weight.copy_(torch.flip(mod.weight, [0]))         # the weight changed in place
    assert torch.equal(mod(x), torch_path(mod, x))
    mod.weight_scale.mul_(3)                              # a scale edited in place: drop() says so
    cpu_linear.drop(mod)
    assert torch.equal(mod(x), torch_path(mod, x))
    mod.to(torch.float64)                                 # float buffers converted (_apply)
    assert mod.weight_scale.dtype == torch.float64 and torch.equal(mod(x), torch_path(mod, x))


@pytest.mark.parametrize("extra", [(), ("-mavx2",)], ids=["plain-c", "avx2"])
def test_the_plain_c_and_avx2_loops_equal_the_native_ones(monkeypatch, extra):
    """The same source built for the baseline x86-64 / any CPU (no -march: no AVX-512, the plain C loops),
    and for AVX2 without AVX-512 (the vpmaddwd loops): the same int32 products, so the same outputs as
    this machine's build (VNNI, AVX2 or AMX)."""
    if extra and "avx2" not in cpu_flags().split():
        pytest.skip("no AVX2 on this CPU")
    plain = NativeLibrary(cpu_linear.SOURCE, cpu_linear._declare,
                          tuple(f for f in EXACT_FLAGS if not f.startswith("-march=")) + extra,
                          what="plain C kernel" if not extra else "AVX2 C kernel")
    lib = plain.library()
    assert lib is not None and lib.native_has_vnni() == 0
    g = torch.Generator().manual_seed(5)
    mods = [make(kind, n, k, epi, True, g) for kind in ("static", "dynamic") for epi in (EXACT, FAST)
            for n, k in SHAPES]
    want = {id(m): [m(inputs(rows, m.in_features, dt, torch.Generator().manual_seed(rows)))
                    for rows in ROWS for dt in (torch.float32, torch.bfloat16)] for m in mods}
    monkeypatch.setattr(cpu_linear, "_LIB", plain)
    for m in mods:
        m.__dict__.pop("_native_packed", None)            # repack with the plain library
        got = [m(inputs(rows, m.in_features, dt, torch.Generator().manual_seed(rows)))
               for rows in ROWS for dt in (torch.float32, torch.bfloat16)]
        assert m.last_kernel == NATIVE
        assert all(torch.equal(a, b) for a, b in zip(got, want[id(m)])), m.kind


def test_the_amx_tiles_equal_the_vnni_ones(monkeypatch):
    """Calls of AMX_MIN_ROWS (32) rows or more run on the AMX tiles where the CPU has them: the same exact
    int32 product, so the same outputs as the library built without AMX (VNNI), for whole and short
    32-row blocks, k a multiple of 64 (the tiles) and not (VNNI either way), both kinds and dtypes."""
    if not cpu_linear.library().native_has_amx():
        pytest.skip(f"no AMX here ({cpu_linear.status()}): the VNNI and plain C paths are the ones tested")
    vnni = NativeLibrary(cpu_linear.SOURCE, cpu_linear._declare, EXACT_FLAGS + ("-mno-amx-tile", "-mno-amx-int8"),
                         what="VNNI-only C kernel")
    assert vnni.library() is not None and vnni.library().native_has_amx() == 0
    g = torch.Generator().manual_seed(6)
    mods = [make(kind, n, k, EXACT, True, g) for kind in ("static", "dynamic") for n, k in ((576, 256), (256, 768),
                                                                                          (100, 130))]
    rows = (32, 33, 64, 100, 257)

    def outputs():
        for m in mods:
            m.__dict__.pop("_native_packed", None)
        out = []
        for m in mods:
            for r in rows:
                x = inputs(r, m.in_features, torch.bfloat16, torch.Generator().manual_seed(r))
                out += [m(x), m(x.float()), m._acc(quantize_per_token(x.float())[0])]
                assert m.last_kernel == NATIVE
        return out

    amx = outputs()
    monkeypatch.setattr(cpu_linear, "_LIB", vnni)
    assert all(torch.equal(a, b) for a, b in zip(amx, outputs()))
