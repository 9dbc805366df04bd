"""pipeline.engine.triton: the Triton kernels against the engine's torch paths, at tiny shapes.

Without a CUDA device the kernels run on CPU tensors through Triton's interpreter: TRITON_INTERPRET=1 is
set below before any kernel module is imported (the kernels are defined at import). With a CUDA device
the same tests run compiled on it (the ``gpu``-marked parameters) and the CPU ones are skipped, unless
TRITON_INTERPRET=1 was set by the caller. Skipped as a whole when triton is not installed.

What is compared: integers (quantized activations, int32 accumulators) bit for bit; floats within the
named tolerances below.
"""

from __future__ import annotations

import os

import pytest
import torch

_SET_INTERPRET = "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available()
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"                     # before triton and the kernel modules are imported
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

pytest.importorskip("triton")

from pipeline.config import DeepseekV3Config                                         # noqa: E402
from pipeline.engine.attention.paged import paged_decode_attention                          # noqa: E402
from pipeline.engine import config as engine_config                                          # noqa: E402
from pipeline.engine.triton.int8_gemm import (int8_gemm_dynamic, int8_gemm_quantized,  # noqa: E402
                                               int8_gemm_static, int8_linear, int8_matmul_acc)
from pipeline.engine.triton.mla_decode import (block_table_tensor, paged_mla_decode,  # noqa: E402
                                                paged_mla_decode_cache)
from pipeline.engine.triton.moe_gemm import StackedExperts, fused_moe, int8_moe_forward, route  # noqa: E402
from pipeline.engine.layers.moe import Int8MoE                                               # noqa: E402
from pipeline.engine.cache.paged_cache import PagedLatentCache                              # noqa: E402
from pipeline.engine.layers.qlinear import (EXACT, FAST, FAST_EPILOGUE_ULPS, build_int8_linear,  # noqa: E402
                                     quantize_per_token, quantize_static)
from pipeline.format.description import W8A8, W8A8_DYNAMIC                            # noqa: E402
from pipeline.model.ffn import MoE                                                    # noqa: E402
from tiny import tiny_config                                                          # noqa: E402

# ----- tolerances ----------------------------------------------------------------------------------------
# MLA decode, max |kernel - paged_decode_attention| / max |reference|, both float32 on the same cache:
# precision="ieee": only the summation order differs (split-K, tile order, exp2 with the log2(e) folded
# into the scale vs exp). Measured <= 1.1e-7 (3 seeds); the bound is torch's own paged-vs-contiguous one.
MLA_IEEE_RTOL = 1e-5
# precision="bf16": q_abs, q_pe and the probabilities rounded to bf16 (2^-9 relative each) before the
# dots, as on tensor cores. With scores of std ~1 (q std 0.3, unit latents), 5 cases x 3 seeds x splits 1
# and 3: measured <= 2.6e-3; bound ~4x that. A sharper softmax amplifies the score error (exp): the
# bound is for inputs like these only.
MLA_BF16_RTOL = 1e-2
# int8 GEMMs: the float32 output is qlinear's FAST epilogue bit for bit (0 ulps); against EXACT within
# qlinear's own bound, FAST_EPILOGUE_ULPS (4) float32 ulps (measured <= 1 ulp, 3 seeds, both kinds).
# MoE (routed + shared, output in bf16) against Int8MoE with the FAST epilogue: h uses the device's exp
# in SiLU, so a bf16 ulp of h can differ and move one int8 of h_q by 1: measured 0 (bit-equal) on these
# inputs (1, 7, 40 rows); bound: 2 bf16 ulps of the largest output (2 * 2^-7 relative).
MOE_RTOL = 2 * 2 ** -7
# ... and against Int8MoE with the EXACT epilogue (<= 4 float32 ulps per GEMM, then the bf16 casts):
# measured 0 here too.
MOE_EXACT_RTOL = 4 * 2 ** -7

SCALE = 0.1352338          # V3's softmax_scale

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="kernels compiled for CUDA in this "
                                                 "process (set TRITON_INTERPRET=1 to interpret them on the CPU)")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device (and compiled kernels)")]),
]


@pytest.fixture(autouse=True, scope="module")
def _module_env():
    """One torch thread (small matrices; 2 busy cores make spinning OpenMP threads slow), and the
    interpreter switch taken back at the end (the kernels stay defined as they are)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
    if _SET_INTERPRET:
        os.environ.pop("TRITON_INTERPRET", None)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in float32 ulps (same-sign finite values)."""
    ia, ib = a.float().view(torch.int32).long(), b.float().view(torch.int32).long()
    return int((ia - ib).abs().max()) if a.numel() else 0


# ----- MLA decode ----------------------------------------------------------------------------------------
# 5 heads (a partial head tile), C=48 (NZ pads the int8 columns), block size 12 (NZ pads the rows)
H, C, R, BS = 5, 48, 16, 12
LENGTHS = [1, 13, 40, 24]               # one token; a partial block; several blocks + a partial; exactly 2 blocks
TABLES = [[3], [5, 7], [1, 2, 9, 11], [0, 14]]


def _filled_cache(kind: str, nz: bool, device: str, seed: int = 0) -> PagedLatentCache:
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    cache = PagedLatentCache(16, BS, C, R, dtype=dtype, fa_k=0.04 if kind == "int8" else None, nz=nz, device=device)
    for table, n in zip(TABLES, LENGTHS):
        cache.write(table, torch.randn(n, C, generator=g).to(dtype), torch.randn(n, R, generator=g).to(dtype))
    return cache


def _queries(b: int, device: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(b, H, C, generator=g)).to(device), (0.3 * torch.randn(b, H, R, generator=g)).to(device)


CASES = [("int8", False), ("int8", True), ("bf16", False), ("bf16", True), ("fp32", False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,nz", CASES, ids=[f"{k}-{'NZ' if z else 'ND'}" for k, z in CASES])
@pytest.mark.parametrize("precision", ["ieee", "bf16"])
def test_mla_decode_matches_paged_decode_attention(device, kind, nz, precision):
    cache = _filled_cache(kind, nz, device)
    q, qp = _queries(len(LENGTHS), device)
    ref = paged_decode_attention(q, qp, cache, TABLES, LENGTHS, SCALE)
    table, lengths = block_table_tensor(TABLES, LENGTHS, BS, device)
    tol = MLA_IEEE_RTOL if precision == "ieee" else MLA_BF16_RTOL
    for splits in (1, 3):
        out = paged_mla_decode_cache(q, qp, cache, table, lengths, SCALE, num_splits=splits, precision=precision)
        assert out.dtype == torch.float32 and out.shape == (len(LENGTHS), H, C)
        assert _rel(out, ref) <= tol, (splits, _rel(out, ref))
    # batch 1, and a sequence that is not the first of the table
    one = paged_mla_decode_cache(q[2:3], qp[2:3], cache, table[2:3], lengths[2:3], SCALE, precision=precision)
    assert _rel(one, ref[2:3]) <= tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_mla_decode_nz_equals_nd_exactly(device, kind):
    """The same values in NZ and in ND blocks: the same arithmetic, the same bits (interpreted; compiled,
    the two loads may be laid out differently before the dots, so only the ieee tolerance is claimed)."""
    q, qp = _queries(len(LENGTHS), device)
    table, lengths = block_table_tensor(TABLES, LENGTHS, BS, device)
    outs = [paged_mla_decode_cache(q, qp, _filled_cache(kind, nz, device), table, lengths, SCALE, num_splits=2)
            for nz in (False, True)]
    if device == "cpu":
        assert torch.equal(outs[0], outs[1])
    else:
        assert _rel(outs[1], outs[0]) <= MLA_IEEE_RTOL


@pytest.mark.parametrize("device", DEVICES)
def test_mla_decode_raw_tensors_and_errors(device):
    cache = _filled_cache("int8", False, device)
    q, qp = _queries(len(LENGTHS), device)
    table, lengths = block_table_tensor(TABLES, LENGTHS, BS, device)
    a = paged_mla_decode(q, qp, cache.c, cache.pe, table, lengths, SCALE, fa_k=cache.scale, num_splits=2)
    b = paged_mla_decode_cache(q, qp, cache, table, lengths, SCALE, num_splits=2)
    assert torch.equal(a, b)
    call = dict(q_abs=q, q_pe=qp, c_cache=cache.c, pe_cache=cache.pe, block_table=table, lengths=lengths,
                softmax_scale=SCALE, fa_k=0.04)
    bad = [(dict(fa_k=None), "fa_k is required"),
           (dict(fa_k=-1.0), "fa_k must be a positive"),
           (dict(lengths=lengths * 0), "lengths must be in 1..48"),
           (dict(lengths=lengths + 100), "lengths must be in"),
           (dict(block_table=table + 15), "block_table refers to block ids"),
           (dict(block_table=table[:2]), "block_table must be int32"),
           (dict(q_pe=qp[:, :, :8].contiguous(), pe_cache=cache.pe), "pe_cache must be ND"),
           (dict(q_abs=q[:, :, :32].contiguous()), "c_cache must be ND"),
           (dict(nz=True), "c_cache must be NZ"),
           (dict(precision="fp8"), "precision must be one of")]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            paged_mla_decode(**dict(call, **change))
    with pytest.raises(ValueError, match=r"sequence 0 has 13 token\(s\), which need 2 block"):
        block_table_tensor([[1]], [13], BS)
    bf = _filled_cache("bf16", False, device)
    with pytest.raises(ValueError, match="fa_k given with a torch.bfloat16 c_cache"):
        paged_mla_decode(**dict(call, c_cache=bf.c, pe_cache=bf.pe))


# ----- int8 GEMMs ----------------------------------------------------------------------------------------
M_ROWS = (1, 5, 33)          # decode rows; a partial tile; more than two 16-row tiles
K_IN, N_OUT = 72, 40          # K not a multiple of the 32-wide K tile: the masked tail is checked


def _static_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(weight=torch.randint(-127, 128, (N_OUT, K_IN), dtype=torch.int8, generator=g),
                input_scale=torch.tensor([0.021]), input_offset=torch.tensor([-3.0]),
                quant_bias=torch.randint(-3000, 3000, (N_OUT,), dtype=torch.int32, generator=g),
                deq_scale=torch.rand(N_OUT, generator=g) * 1e-3)


def _dynamic_params(seed: int = 0, bias: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    p = dict(weight=torch.randint(-127, 128, (N_OUT, K_IN), dtype=torch.int8, generator=g),
             weight_scale=(torch.rand(N_OUT, 1, generator=g) * 1e-2).bfloat16())
    if bias:
        p["bias"] = torch.randn(N_OUT, generator=g).bfloat16()
    return p


def _on(params: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in params.items()}


def _x(m: int, device: str, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(m, K_IN, generator=g)).bfloat16()
    x[0, :5] = torch.tensor([0.5, 1.5, -2.5, 1000.0, -1000.0]) * 0.021   # ties to even, and clamped values
    return x.to(device)


def _torch_linear(kind: str, params: dict, epilogue: str):
    """An int8 linear on the torch path (on a CUDA device a module built alone would take the Triton GEMMs)."""
    mod = build_int8_linear("lin", kind, params, epilogue=epilogue)
    mod.triton = False
    return mod


def _int_product(x_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x_q.cpu().long() @ w.cpu().long().T).to(torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", M_ROWS)
def test_static_gemm(device, m):
    p = _on(_static_params(), device)
    x = _x(m, device)
    acc = int8_gemm_static(x, p["weight"], p["input_scale"], p["input_offset"], p["quant_bias"], p["deq_scale"],
                           return_acc=True)
    x_q = quantize_static(x, p["input_scale"].reshape(()), p["input_offset"].reshape(()))
    assert acc.dtype == torch.int32 and torch.equal(acc.cpu(), _int_product(x_q, p["weight"]))
    fast, exact = (_torch_linear(W8A8, p, e) for e in (FAST, EXACT))
    y = int8_linear(fast, x)
    assert y.dtype == torch.float32 and y.shape == (m, N_OUT)
    assert torch.equal(y, fast(x.float()))                       # the FAST epilogue, bit for bit
    assert torch.equal(y.to(x.dtype), fast(x))
    assert _ulps(y, exact(x.float())) <= FAST_EPILOGUE_ULPS
    # the int64 (fp16 models') deq_scale form decodes to the same output
    as_int64 = dict(p, deq_scale=p["deq_scale"].view(torch.int32).to(torch.int64))
    assert torch.equal(int8_linear(_torch_linear(W8A8, as_int64, FAST), x), y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", M_ROWS)
def test_dynamic_gemm(device, m):
    p = _on(_dynamic_params(), device)
    x = _x(m, device)
    if m > 1:
        x[1] = 0                                                   # an all-zero row: s_tok = eps
    x_q, s_tok = quantize_per_token(x)
    acc = int8_gemm_dynamic(x, p["weight"], p["weight_scale"], return_acc=True)
    assert torch.equal(acc.cpu(), _int_product(x_q, p["weight"]))
    assert torch.equal(int8_matmul_acc(x_q, p["weight"]).cpu(), _int_product(x_q, p["weight"]))
    fast, exact = (_torch_linear(W8A8_DYNAMIC, p, e) for e in (FAST, EXACT))
    y = int8_linear(fast, x)
    assert torch.equal(y, fast(x.float()))
    assert torch.equal(int8_gemm_quantized(x_q, s_tok, p["weight"], p["weight_scale"]),
                       fast.apply_quantized(x_q, s_tok))
    assert _ulps(y, exact(x.float())) <= FAST_EPILOGUE_ULPS
    pb = _on(_dynamic_params(bias=True), device)
    with_bias = _torch_linear(W8A8_DYNAMIC, pb, FAST)
    assert torch.equal(int8_linear(with_bias, x), with_bias(x.float()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [W8A8, W8A8_DYNAMIC])
@pytest.mark.parametrize("epilogue", [FAST, EXACT])
def test_int8_linear_runs_the_triton_gemm_on_the_triton_backend(device, kind, epilogue):
    """The GPU path of the int8 linear: with ``triton`` on (the engine's triton backend), a FAST linear's
    forward is the fused GEMM and an EXACT one's integer product the Triton int32 GEMM; either way the
    output is the torch path's bit for bit (bf16 and float32 input, and apply_quantized)."""
    p = _on(_static_params() if kind == W8A8 else _dynamic_params(bias=True), device)
    ref = _torch_linear(kind, p, epilogue)
    mod = build_int8_linear("lin", kind, p, epilogue=epilogue)
    mod.native, mod.triton = False, True          # as the engine sets them on its triton backend
    for m in (1, 5):
        x = _x(m, device)
        for xi in (x, x.float()):
            assert torch.equal(mod(xi), ref(xi)) and mod.last_kernel == "triton", (m, xi.dtype)
    if kind == W8A8_DYNAMIC:
        x_q, s_tok = quantize_per_token(_x(5, device))
        assert torch.equal(mod.apply_quantized(x_q, s_tok), ref.apply_quantized(x_q, s_tok))
        assert mod.last_kernel == "triton"


def test_int8_linear_takes_triton_where_the_backend_is_triton(monkeypatch):
    """A linear built alone takes the Triton GEMMs where the kernels backend is triton, not elsewhere; the
    engine's kernels (use_kernels) set it either way."""
    from pipeline.engine.layers.native_swap import use_kernels

    p = _dynamic_params()
    monkeypatch.setenv(engine_config.ENV, "torch")
    mod = build_int8_linear("lin", W8A8_DYNAMIC, p)
    assert not mod.triton
    use_kernels(mod, engine_config.Kernels("cpu", engine_config.TRITON, "test"))
    assert mod.triton
    if INTERPRETED:
        monkeypatch.setenv(engine_config.ENV, "triton")
        assert build_int8_linear("lin", W8A8_DYNAMIC, p).triton


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_errors_name_the_argument(device):
    p = _on(_static_params(), device)
    x = _x(2, device)
    with pytest.raises(ValueError, match="w must be int8"):
        int8_gemm_dynamic(x, p["weight"].float(), p["deq_scale"])
    with pytest.raises(ValueError, match=r"w must be int8 \[N, 16\]"):
        int8_gemm_dynamic(x[:, :16], p["weight"], p["deq_scale"])
    with pytest.raises(ValueError, match="weight_scale must be"):
        int8_gemm_dynamic(x, p["weight"], p["deq_scale"][:3])
    with pytest.raises(ValueError, match="deq_scale must be float32"):
        int8_gemm_static(x, p["weight"], p["input_scale"], p["input_offset"], p["quant_bias"],
                         p["deq_scale"].view(torch.int32).to(torch.int64))
    with pytest.raises(ValueError, match="quant_bias must be torch.int32"):
        int8_gemm_static(x, p["weight"], p["input_scale"], p["input_offset"], p["quant_bias"].long(), p["deq_scale"])
    with pytest.raises(ValueError, match="x must be an int8"):
        int8_matmul_acc(x, p["weight"])


# ----- MoE ------------------------------------------------------------------------------------------------
def _int8_moe(device: str, epilogue: str, seed: int = 0) -> Int8MoE:
    """The tiny config's MoE (8 experts, top 2, hidden 64, inter 32, a shared expert) with random int8
    W8A8_DYNAMIC experts built by build_int8_linear, fused by Int8MoE: the torch path under test."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    moe = MoE(DeepseekV3Config.from_dict(tiny_config()), dtype=torch.bfloat16)
    torch.nn.init.normal_(moe.gate.weight, std=0.2)

    def lin(old):
        n, k = old.weight.shape
        return build_int8_linear("e", W8A8_DYNAMIC, dict(
            weight=torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
            weight_scale=(torch.rand(n, 1, generator=g) * 0.03 / k ** 0.5).bfloat16()), epilogue=epilogue)

    for mlp in [*moe.experts, moe.shared_experts]:
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = lin(mlp.gate_proj), lin(mlp.up_proj), lin(mlp.down_proj)
    return Int8MoE(moe).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 7, 40])
@torch.no_grad()
def test_fused_moe_matches_int8_moe(device, rows):
    ref = _int8_moe(device, FAST)
    stacked = StackedExperts.of(ref)
    x = torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16().to(device)
    want = ref(x)
    load = ref.last_load.clone()
    got = int8_moe_forward(ref, stacked, x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert _rel(got, want) <= MOE_RTOL, _rel(got, want)
    assert torch.equal(ref.last_load, load)
    exact = _int8_moe(device, EXACT)
    assert _rel(int8_moe_forward(exact, StackedExperts.of(exact), x), exact(x)) <= MOE_EXACT_RTOL


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_fused_moe_accumulators_are_exact(device):
    ref = _int8_moe(device, FAST)
    st = StackedExperts.of(ref)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
    weights, idx = ref.gate(x)
    parts = fused_moe(x, idx, weights, st.w13, st.w13_scale, st.w2, st.w2_scale, return_parts=True)
    r = parts["routing"]
    x_q, _ = quantize_per_token(x)
    valid = (r.slots < r.num_slots).cpu()
    slots = r.slots.cpu().long()[valid]
    tok, exp = slots // idx.shape[1], idx.cpu().flatten()[slots]
    gu = torch.stack([_int_product(x_q[t:t + 1], st.w13[e])[0] for t, e in zip(tok.tolist(), exp.tolist())])
    assert torch.equal(parts["gate_up"].cpu()[valid], gu)
    assert not parts["gate_up"].cpu()[~valid].any()
    h_q, _ = quantize_per_token(parts["h"].cpu()[valid].bfloat16())   # qlinear's quantization of the kernel's h
    dn = torch.stack([_int_product(h_q[i:i + 1], st.w2[e])[0] for i, e in enumerate(exp.tolist())])
    assert torch.equal(parts["down"].cpu()[valid], dn)
    # the slots are in combine_experts' order: experts ascending, slots ascending within each
    assert torch.equal(slots, idx.cpu().flatten().argsort(stable=True))


def test_route_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])
    r = route(ids, num_experts=5, block_m=2)
    # slots by expert: 0 -> 1, 4 (one tile); 1 -> 3 (+ a pad row); 2 -> 0, 2, 5, 6 (two tiles); 3 -> 7; 4 -> none
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    got = r.slots[r.slots < r.num_slots]
    assert torch.equal(got.long(), order)
    assert torch.equal(r.load, torch.bincount(flat, minlength=5))
    assert r.tile_expert.tolist()[:5] == [0, 1, 2, 2, 3] and set(r.tile_expert.tolist()[5:]) <= {-1}
    for t, e in enumerate(r.tile_expert.tolist()):
        rows = r.slots[t * 2:(t + 1) * 2]
        rows = rows[rows < r.num_slots].long()
        assert e >= 0 or rows.numel() == 0
        assert bool((flat[rows] == e).all())
    with pytest.raises(ValueError, match="expert ids >= num_experts"):
        route(ids, num_experts=3, block_m=2)


# ----- dispatch --------------------------------------------------------------------------------------------
def test_dispatch(monkeypatch):
    monkeypatch.delenv(engine_config.ENV, raising=False)
    native = engine_config.native_available()       # a C compiler here: the CPU's C kernels by default
    assert engine_config.choose("cpu") == (("native", "CPU device, C compiler found") if native else
                                           ("torch", "no C compiler (or DSQUANT_NATIVE=0)"))
    k = engine_config.resolve("cpu")
    assert (k.device, k.backend) == ("cpu", "native" if native else "torch")
    assert k.describe().startswith("native (CPU device, C compiler found): C " if native else "torch (no C compiler")
    monkeypatch.setenv("DSQUANT_NATIVE", "0")
    assert engine_config.backend("cpu") == "torch"
    with pytest.raises(RuntimeError, match="need a CPU device and a C compiler"):
        monkeypatch.setenv(engine_config.ENV, "native")
        engine_config.backend("cpu")
    monkeypatch.delenv("DSQUANT_NATIVE")
    with pytest.raises(RuntimeError, match="need a CPU device and a C compiler"):
        engine_config.backend("cuda")
    monkeypatch.delenv(engine_config.ENV)
    if torch.cuda.is_available():
        assert engine_config.backend("cuda") == "triton"
    monkeypatch.setenv(engine_config.ENV, "torch")
    assert engine_config.backend("cuda:0") == "torch"
    monkeypatch.setenv(engine_config.ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert engine_config.backend("cpu") == "triton"
    k = engine_config.resolve("cpu")
    assert k.labels() == {"device": "cpu", "backend": "triton", "linears": "triton", "float_ops": "triton",
                          "attention": "triton"}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need CUDA, or TRITON_INTERPRET=1"):
        engine_config.backend("cpu")
    monkeypatch.setattr(engine_config, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        engine_config.backend("cuda")
    monkeypatch.setenv(engine_config.ENV, "cuda")
    with pytest.raises(ValueError, match="expected 'torch', 'triton', 'native' or 'auto'"):
        engine_config.backend("cpu")


def test_package_imports_no_triton():
    """The engine can import the package and the dispatcher without triton (nothing imported eagerly)."""
    import subprocess
    import sys
    code = ("import sys; import pipeline.engine.triton, pipeline.engine.config as c; "
            "c.resolve('cpu'); print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "DSQUANT_KERNELS"})
    assert out.stdout.strip() == "False", out.stderr
