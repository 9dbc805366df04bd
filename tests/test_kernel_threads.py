"""The C kernels split over their thread pools (csrc/pool.h) give the same bits for any thread count: the
int8 linears (both kinds, both epilogues, float32 and bf16, odd shapes whose last panel is partial, row
blocks), the pre-quantized product (``apply_quantized``, ``_acc``), the routed experts of the embedded
model's MoE layers, the bf16 float linears (lm_head), and the absorbed decode attention (heads in groups;
bf16 weights against their float32 copies), each with 1, 2 and 3 threads; and an engine's runner keeps the
pools as wide as torch's threads.

Tolerance: none (``torch.equal``): a panel of output columns (a group of heads) is one task, computed by the
same operations in the same order whichever thread runs it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.engine.attention.batched import DecodeBatch
from pipeline.engine.layers.moe import Int8MoE
from pipeline.engine.layers.qlinear import EXACT, FAST, INT_MM, W8A8DynamicLinear, W8A8StaticLinear
from pipeline.engine.native import cpu_attention, cpu_float, cpu_linear
from pipeline.engine.worker.loader import load_quantized

pytestmark = pytest.mark.skipif(cpu_linear.library() is None, reason="no C compiler: the torch path only")

THREADS = (1, 2, 3)
SHAPES = ((700, 96), (64, 512), (130, 7))       # (n, k): 11 panels with a partial last one, one, three
ROWS = (1, 5, 130)                              # 130: two row blocks


@pytest.fixture
def pool():
    saved_torch, saved_pool = torch.get_num_threads(), cpu_linear.threads()
    torch.set_num_threads(1)
    yield cpu_linear.set_threads
    cpu_linear.set_threads(saved_pool)
    torch.set_num_threads(saved_torch)


def linear(kind: str, n: int, k: int, epilogue: str, g: torch.Generator):
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    if kind == "static":
        return W8A8StaticLinear("lin", w, torch.tensor([0.05]), torch.tensor([3.0]),
                                torch.randint(-9000, 9000, (n,), dtype=torch.int32, generator=g),
                                torch.rand(n, generator=g) * 1e-3, epilogue=epilogue)
    return W8A8DynamicLinear("lin", w, (torch.rand(n, 1, generator=g) * 1e-2).to(torch.bfloat16),
                             torch.randn(n, generator=g).to(torch.bfloat16), epilogue=epilogue)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("epilogue", [EXACT, FAST])
def test_linear_bits_do_not_depend_on_threads(pool, kind, epilogue):
    g = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        mod = linear(kind, n, k, epilogue, g)
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k, generator=g) * 4).to(dtype)
                mod.kernel = INT_MM if n % 8 == 0 and k % 8 == 0 else "fp32_chunked"
                ref = mod(x)
                mod.kernel = "native"
                for t in THREADS:
                    assert pool(t) == t
                    out = mod(x)
                    assert mod.last_kernel == "native"
                    assert torch.equal(out, ref), (kind, epilogue, n, k, m, dtype, t)


def test_prequantized_product_bits_do_not_depend_on_threads(pool):
    g = torch.Generator().manual_seed(2)
    mod = linear("dynamic", 700, 96, EXACT, g)
    q = torch.randint(-128, 128, (130, 96), dtype=torch.int8, generator=g)
    s = torch.rand(130, 1, generator=g) * 0.1
    pool(1)
    acc1, y1 = cpu_linear.apply_quantized(mod, q, None), cpu_linear.apply_quantized(mod, q, s)
    for t in THREADS[1:]:
        pool(t)
        assert torch.equal(cpu_linear.apply_quantized(mod, q, None), acc1)
        assert torch.equal(cpu_linear.apply_quantized(mod, q, s), y1)
    assert torch.equal(acc1, q.int() @ mod.weight.int().T)      # the exact product


def test_routed_experts_bits_do_not_depend_on_threads(pool, qdir):
    model = load_quantized(qdir).model
    layers = [m for m in model.modules() if isinstance(m, Int8MoE)]
    assert layers
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for moe in layers:
            for rows in (1, 7, 130):
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(1, rows, model.config.hidden_size, generator=g).to(dtype)
                    pool(1)
                    ref = moe(x)
                    for t in THREADS[1:]:
                        pool(t)
                        assert torch.equal(moe(x), ref), (rows, dtype, t)


def test_runner_follows_torch_threads(pool):
    torch.set_num_threads(2)
    assert cpu_linear.follow_torch() == 2 and cpu_linear.threads() == 2
    torch.set_num_threads(1)
    assert cpu_linear.follow_torch() == 1 and cpu_linear.threads() == 1


@pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler: the torch path only")
@pytest.mark.parametrize("nz,int8", [(False, True), (True, False)])
def test_decode_attention_bits_do_not_depend_on_threads_or_the_weights_dtype(pool, nz, int8):
    """The absorbed decode over 22 heads (head groups of 4 with a short last one on 2 and 3 threads): the
    same bits for 1, 2 and 3 threads, and for bf16 weights and their float32 copies (bf16 -> float32 is
    exact; the C call converts while it reads)."""
    from test_native_attention import SCALE, _setup

    lengths, H, dn, C, dv = [1, 40, 17, 3], 22, 24, 72, 40
    cache, tables, _, qp = _setup(lengths, nz, int8, torch.bfloat16, C=C, R=24, H=H)
    g = torch.Generator().manual_seed(12)
    w_uk = (torch.randn(H, dn, C, generator=g) * 0.2).to(torch.bfloat16)
    w_uv_t = (torch.randn(H, C, dv, generator=g) * 0.2).to(torch.bfloat16)
    q_nope = torch.randn(len(lengths), H, dn, generator=g)
    batch = DecodeBatch.build(tables, lengths, 16, cache.num_blocks)
    cpu_attention.set_threads(1)
    try:
        ref = cpu_attention.decode_attention(q_nope, qp, cache, batch, SCALE, w_uk=w_uk.float(), w_uv_t=w_uv_t.float())
        for t in THREADS:
            assert cpu_attention.set_threads(t) == t
            got = cpu_attention.decode_attention(q_nope, qp, cache, batch, SCALE, w_uk=w_uk, w_uv_t=w_uv_t)
            assert torch.equal(got, ref), t
    finally:
        cpu_attention.set_threads(1)


@pytest.mark.skipif(cpu_float.library() is None, reason="no C compiler: the torch path only")
def test_bf16_linear_bits_do_not_depend_on_threads(pool):
    """The float linears (lm_head, a float model's): column tasks of 128, a partial last one."""
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(96, 300, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(300, 96, generator=g).to(torch.bfloat16).float())
    mod = cpu_float.NativeLinear(lin)
    for m in (1, 6):
        x = torch.randn(m, 96, generator=g)
        with torch.no_grad():
            cpu_float.set_threads(1)
            ref = mod(x)
            try:
                for t in THREADS[1:]:
                    assert cpu_float.set_threads(t) == t
                    assert torch.equal(mod(x), ref), (m, t)
            finally:
                cpu_float.set_threads(1)
        torch.testing.assert_close(ref, x @ lin.weight.T, rtol=1e-5, atol=1e-5)
