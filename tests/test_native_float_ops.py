"""pipeline.engine.native.cpu_float: the C float linears (lm_head and the float model's others) from bf16 weights,
RMSNorm and the MoE router against their torch modules (random shapes, and the embedded model's real
weights and activations), a linear row's result independent of the other rows of the call, the plain C
build, the swaps the loader makes (a quantized model's float parts but the heads untouched), the
fallbacks, and the engine's greedy tokens with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.cbuild import EXACT_FLAGS, NativeLibrary, cpu_flags
from pipeline.engine.native import cpu_float
from pipeline.engine.native.cpu_float import LINEAR_C_ROWS, NativeHeadLinear, NativeLinear, NativeRMSNorm, NativeRouter
from pipeline.engine.native.cpu_float_ffn import NativeFloatMLP, NativeFloatMoE
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine import config as engine_config
from pipeline.engine.layers.native_swap import use_native_float_ops
from pipeline.engine.worker.loader import load_model, load_quantized
from pipeline.engine.protocol import SamplingParams
from pipeline.model.ffn import Router
from pipeline.model.norm import RMSNorm

# Linears: the same float32 products (bf16 widened exactly), summed in another order (one FMA chain per
# output): measured max |diff| <= 7e-7 of max |ref| (k <= 768; 1.2e-6 absolute at max |logit| ~3).
AMX_REL_ERR = 5e-7                  # of max |float64 ref|: the tiles measured 1.3-3.4e-7, the FMA chains 5-11e-7
HEAD_RTOL = 1e-5                    # of max |ref| (logits of size ~10: ~1e-4 absolute)
# RMSNorm, float32 out: the sum of squares in another order moves 1/sqrt by ~1 ulp: elementwise 1e-6 relative.
NORM_RTOL, NORM_ATOL = 1e-6, 1e-7
# RMSNorm, bf16 out: the same, then rounded to bf16: a value at a rounding boundary may go one bf16 ulp the
# other way (2^-8 relative at most); measured: none at these shapes, allowed in at most 1% of the values.
BF16_ULP, BF16_FLIPS = 2.0 ** -7, 0.01
# Router weights (up to routed_scaling_factor 2.5): the logits' sum order and expf against torch's
# vectorized exp, a few float32 ulps. Measured on the embedded model's activations: 1.1e-6.
ROUTER_ATOL = 4e-6

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_native = pytest.mark.skipif(not engine_config.native_available() or cpu_float.library() is None,
                                  reason=f"no native kernels here: {cpu_float.status()}")


def _head(n, k, seed=0) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data = (torch.randn(n, k, generator=g) * 0.1).bfloat16().float()
    return lin


def _head_close(got, ref):
    assert got.shape == ref.shape and got.dtype == torch.float32
    if ref.numel():
        assert (got - ref).abs().max().item() <= HEAD_RTOL * ref.abs().max().item() + 1e-7


@needs_native
@pytest.mark.parametrize("m,k,n", [(1, 256, 4096), (2, 37, 9), (5, 256, 13), (9, 300, 70), (4, 16, 4), (0, 8, 3),
                                   (3, 1, 17), (16, 768, 256), (7, 129, 130),
                                   (LINEAR_C_ROWS + 3, 64, 33)])   # > LINEAR_C_ROWS: F.linear itself
def test_linear_equals_torch(m, k, n):
    lin = _head(n, k)
    nat = NativeLinear(lin)
    assert NativeHeadLinear is NativeLinear and isinstance(nat, nn.Linear)
    assert nat.weight is lin.weight and list(nat.state_dict()) == ["weight"]         # the same parameter
    assert nat.packed().dtype == torch.int32 and nat.packed().numel() == -(-n // 16) * 16 * -(-k // 2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        _head_close(nat(x), lin(x))
        wide = torch.randn(1, m, k + 5) * 2                    # evenly spaced rows, no copy; 3-D input
        _head_close(nat(wide[..., 3:3 + k]), lin(wide[..., 3:3 + k]))
        if m > LINEAR_C_ROWS:
            assert torch.equal(nat(x), lin(x))


@needs_native
@pytest.mark.parametrize("k", [300, 256], ids=["fma", "amx-where-present"])   # k % 32 == 0: the AMX tiles
def test_a_rows_result_does_not_depend_on_the_other_rows(k):
    """Bit for bit: each row alone, the rows in another order, and inside a larger call (a prefix-cache hit's
    entries against recomputed ones, decode rows against prefill rows); on the FMA chains and (k a
    multiple of 32, an AMX CPU) on the tiles, whose short row blocks run short tiles."""
    lin = NativeLinear(_head(70, k, seed=7))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(LINEAR_C_ROWS, k, generator=g)
    with torch.no_grad():
        full = lin(x)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(0, LINEAR_C_ROWS, 37)])
        assert torch.equal(alone, full[::37])
        perm = torch.randperm(LINEAR_C_ROWS, generator=g)
        assert torch.equal(lin(x[perm]), full[perm])
        for m in (1, 2, 3, 5, 6, 7, 16, 17, 40):
            assert torch.equal(lin(x[3:3 + m]), full[3:3 + m]), m


@needs_native
def test_the_amx_tiles_agree_with_the_fma_chains(monkeypatch):
    """Where the CPU has AMX, calls with k % 32 == 0 run on the tiles (x split into three bf16 pieces that sum
    to it exactly, so the same exact products, summed in another order): within float32 rounding of the
    FMA build's results and of torch's, and no less accurate against a float64 reference."""
    if not cpu_float.library().bf16_linear_has_amx():
        pytest.skip(f"no AMX here ({cpu_float.status()}): the FMA chains are the ones tested")
    fma = NativeLibrary(cpu_float.CSRC / "float_ops_cpu.c", cpu_float._declare,
                        EXACT_FLAGS + ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"), what="FMA-only float ops")
    assert fma.library() is not None and fma.library().bf16_linear_has_amx() == 0
    for m, k, n in ((1, 256, 4096), (4, 128, 384), (16, 768, 256), (37, 256, 576), (300, 512, 70)):
        lin = _head(n, k, seed=m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 2
        x[0, :2] = torch.tensor([1e-30, 0.0])                      # a tiny value splits exactly too
        with torch.no_grad():
            ref = (x.double() @ lin.weight.double().T)
            amx = NativeLinear(lin)(x)
            monkeypatch.setattr(cpu_float, "_LIB", fma)
            chained = NativeLinear(lin)(x)
            monkeypatch.undo()
        _head_close(amx, chained)
        _head_close(amx, lin(x))
        err = lambda y: ((y.double() - ref).abs().max() / ref.abs().max()).item()     # noqa: E731
        assert err(amx) <= max(err(chained), AMX_REL_ERR), (m, k, n, err(amx), err(chained))


@needs_native
def test_the_avx2_chains_are_the_avx512_ones_bit_for_bit(monkeypatch):
    """Built for AVX2 + FMA without AVX-512 the linears run the same fused chain per column, 8 columns to a
    register: the same bits as the AVX-512 build (on a CPU without AVX-512 both builds are the AVX2 one),
    odd k, partial last blocks and row counts 1-5 included."""
    if not {"avx2", "fma"} <= set(cpu_flags().split()):
        pytest.skip("no AVX2 + FMA on this CPU")
    no_amx = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
    builds = [NativeLibrary(cpu_float.CSRC / "float_ops_cpu.c", cpu_float._declare, EXACT_FLAGS + no_amx + extra,
                            what=what) for extra, what in (((), "FMA-only float ops"),
                                                           (("-mno-avx512f",), "AVX2 float ops"))]
    for m, k, n in ((1, 256, 4096), (3, 301, 70), (4, 128, 384), (5, 77, 17), (16, 768, 256)):
        lin = _head(n, k, seed=m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 2
        outs = []
        with torch.no_grad():
            for b in builds:
                monkeypatch.setattr(cpu_float, "_LIB", b)
                outs.append(NativeLinear(lin)(x))
                monkeypatch.undo()
        assert torch.equal(outs[0], outs[1]), (m, k, n)
        _head_close(outs[1], lin(x))


@needs_native
def test_linear_state_dict_edits_fallbacks_and_refusals():
    lin = _head(40, 24)
    nat = NativeLinear(lin)
    sd = nat.state_dict()
    assert list(sd) == ["weight"] and torch.equal(sd["weight"], lin.weight)
    other = _head(40, 24, seed=5)
    nat.load_state_dict(other.state_dict())                              # in place: re-packed on next use
    x = torch.randn(3, 24)
    with torch.no_grad():
        _head_close(nat(x), other(x))
        nat.weight.mul_(2)                                               # an in-place edit: re-packed too
        _head_close(nat(x), other(x) * 2)
        with pytest.raises(RuntimeError, match="dtype"):                 # not float32: F.linear, as nn.Linear
            nat(x.double())
        nat.load_state_dict({"weight": torch.randn(40, 24)})             # not bf16 values: F.linear
        assert nat.packed() is None and torch.equal(nat(x), F.linear(x, nat.weight))
    with pytest.raises(ValueError, match="weight: float32 values that are not bf16"):
        NativeLinear(nn.Linear(24, 40, bias=False))                       # random float32: not bf16 values
    with pytest.raises(ValueError, match="bias"):
        NativeLinear(nn.Linear(24, 40))
    with pytest.raises(ValueError, match="float32"):
        NativeLinear(nn.Linear(24, 40, bias=False).bfloat16())
    xg = torch.randn(2, 24, requires_grad=True)                          # autograd: F.linear, gradients flow
    lin2 = NativeLinear(_head(8, 24))
    lin2(xg).sum().backward()
    assert torch.allclose(xg.grad, lin2.weight.sum(0).expand(2, 24))


@needs_native
def test_a_compact_linear_holds_only_its_bits_and_computes_the_same():
    """NativeLinear.compact (what the engine's loader does): no float32 parameter left, the bits its only
    copy; the same outputs bit for bit on the C path and on the torch path (> LINEAR_C_ROWS rows: F.linear
    over the weight read back), the same refusal of another dtype, the same state dict, and a state dict or
    ``.to()`` make it a plain module again."""
    lin = _head(70, 96, seed=3)
    plain, nat = NativeLinear(lin), NativeLinear(_head(70, 96, seed=3))
    assert nat.compact() and nat.is_compact() and list(dict(nat.named_parameters())) == []
    assert "weight" not in nat._parameters and nat.packed().numel() * 4 == 2 * 80 * 96     # 2 bytes a value
    assert torch.equal(nat.weight, lin.weight) and nat.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for x in (torch.randn(5, 96, generator=g), torch.randn(LINEAR_C_ROWS + 1, 96, generator=g)):
            assert torch.equal(nat(x), plain(x)), x.shape
        with pytest.raises(RuntimeError, match="dtype"):                 # F.linear, as nn.Linear
            nat(torch.randn(3, 96, generator=g).bfloat16())
    sd = nat.state_dict()
    assert list(sd) == ["weight"] and torch.equal(sd["weight"], lin.weight)
    other = _head(70, 96, seed=9)
    nat.load_state_dict(other.state_dict())                              # a plain module again, re-packed
    assert not nat.is_compact() and torch.equal(nat.weight, other.weight)
    x = torch.randn(2, 96, generator=g)
    with torch.no_grad():
        assert torch.equal(nat(x), NativeLinear(other)(x))
        assert nat.compact() and torch.equal(nat(x), NativeLinear(other)(x))
        nat.to(torch.float32)
        assert not nat.is_compact() and torch.equal(nat(x), NativeLinear(other)(x))
    odd = NativeLinear(_head(8, 24))
    odd.load_state_dict({"weight": torch.randn(8, 24)})                  # not bf16 values: no bits to keep
    assert not odd.compact() and "weight" in odd._parameters


@needs_native
@pytest.mark.parametrize("xdt,wdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("shape", [(4, 5, 72), (1, 512), (3, 7), (0, 16)])
def test_rms_norm_equals_torch(xdt, wdt, shape):
    g = torch.Generator().manual_seed(2)
    ref_mod = RMSNorm(shape[-1], 1e-6, dtype=wdt)
    ref_mod.weight.data = torch.randn(shape[-1], generator=g).to(wdt)
    x = (torch.randn(shape, generator=g) * 3).to(xdt)
    with torch.no_grad():
        _norm_close(NativeRMSNorm(ref_mod)(x), ref_mod(x))
        wide = (torch.randn(*shape[:-1], shape[-1] + 9, generator=g) * 3).to(xdt)[..., 4:4 + shape[-1]]
        _norm_close(NativeRMSNorm(ref_mod)(wide), ref_mod(wide))         # a column slice (kv_a's split)


def _norm_close(got, ref):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if not ref.numel():
        return
    d, r = (got.float() - ref.float()).abs(), ref.float().abs()
    if ref.dtype == torch.bfloat16:
        assert (d <= BF16_ULP * r).all() and (d > 0).float().mean().item() <= BF16_FLIPS
    else:
        assert (d <= NORM_RTOL * r + NORM_ATOL).all(), d.max().item()


class _Cfg:
    def __init__(self, E, H, n_group, topk_group, top_k, norm=True, scale=2.5):
        self.n_routed_experts, self.hidden_size, self.n_group, self.topk_group = E, H, n_group, topk_group
        self.num_experts_per_tok, self.norm_topk_prob, self.routed_scaling_factor = top_k, norm, scale


def _router(cfg, dtype=torch.float32, seed=3) -> Router:
    g = torch.Generator().manual_seed(seed)
    r = Router(cfg, dtype=dtype)
    r.weight.data = (torch.randn(r.weight.shape, generator=g) * 0.1).to(dtype)
    r.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.05)
    return r


def _router_close(got, ref):
    (w, i), (w0, i0) = got, ref
    assert i.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == w0.shape
    assert torch.equal(i, i0)
    assert (w - w0).abs().max().item() <= ROUTER_ATOL if w.numel() else True


@needs_native
@pytest.mark.parametrize("cfg", [_Cfg(16, 256, 4, 2, 4), _Cfg(32, 40, 1, 1, 8, norm=False, scale=1.0),
                                 _Cfg(64, 72, 8, 4, 6)])
@pytest.mark.parametrize("xdt,wdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("n", [1, 7, 0, 40])                   # 0 rows, a few, many (the logits always torch's)
def test_router_equals_torch(cfg, xdt, wdt, n):
    r = _router(cfg, wdt)
    x = (torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(4)) * 2).to(xdt)
    with torch.no_grad():
        _router_close(NativeRouter(r)(x), r(x))


@needs_native
def test_router_ties_go_to_the_lower_index_and_bad_configs_are_refused():
    """(torch.topk orders ties by its selection algorithm: [6, 5, 4] here, no rule to follow.)"""
    r = _router(_Cfg(8, 16, 2, 2, 3))
    r.weight.data.zero_()                          # every score sigmoid(0) = 0.5
    r.e_score_correction_bias.zero_()
    with torch.no_grad():
        w, i = NativeRouter(r)(torch.randn(2, 16))
    assert i.tolist() == [[0, 1, 2]] * 2 and torch.allclose(w, torch.full((2, 3), 2.5 / 3))
    with pytest.raises(ValueError, match="top_k"):
        NativeRouter(Router(_Cfg(8, 16, 4, 1, 3)))   # 3 experts from one group of 2
    with pytest.raises(ValueError, match="n_group"):
        NativeRouter(Router(_Cfg(8, 16, 8, 2, 2)))   # groups of one expert (torch's topk(2) fails too)


@needs_native
def test_argmax_rows_is_torchs_argmax():
    """The greedy rows' argmax in C: the first index of the maximum; a NaN counts as the maximum (the
    first NaN's index); ties, infinities, signed zeros, rows of any length, a strided view; other inputs
    (float64, 1-D) go to torch's argmax."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 4096, generator=g)
    x[1, [5, 9]] = float("nan")
    x[2] = 1.0
    x[3, [7, 100]] = float("inf")
    x[4] = -float("inf")
    x[5] = 0.0
    x[5, 3] = -0.0
    x[6, 4095] = 99.0
    x[7, 0] = float("nan")
    x[8, [17, 4000]] = 50.0
    for v in (x, x[:, :4001], x[:, 3:], torch.randn(3, 7, generator=g), torch.randn(1, 1, generator=g),
              x.double(), x[0]):
        assert cpu_float.argmax_rows(v) == v.argmax(-1).tolist()
    assert cpu_float.argmax_rows(torch.empty(0, 5)) == []


@needs_native
def test_plain_c_build_agrees(monkeypatch):
    """The loops without AVX-512 (no -march=native)."""
    plain = NativeLibrary(cpu_float.CSRC / "float_ops_cpu.c", cpu_float._declare, ("-O2", "-shared", "-fPIC"),
                          what="plain C float ops")
    assert plain.library() is not None, plain.status()
    lin, norm, r = _head(70, 301), RMSNorm(72, 1e-6), _router(_Cfg(16, 256, 4, 2, 4))
    logits = torch.randn(5, 300)
    logits[2, [4, 250]] = float("nan")
    logits[3, [8, 9]] = 1e6
    norm.weight.data = torch.randn(72)
    x, xn, xr = torch.randn(5, 301), torch.randn(3, 72), torch.randn(6, 256)
    with torch.no_grad():
        ref = lin(x), norm(xn), r(xr)
        monkeypatch.setattr(cpu_float, "_LIB", plain)
        _head_close(NativeLinear(lin)(x), ref[0])
        _norm_close(NativeRMSNorm(norm)(xn), ref[1])
        _router_close(NativeRouter(r)(xr), ref[2])
        assert cpu_float.argmax_rows(logits) == logits.argmax(-1).tolist()


KINDS = (("linear", NativeLinear), ("rms_norm", NativeRMSNorm), ("router", NativeRouter), ("moe", NativeFloatMoE),
         ("mlp", NativeFloatMLP))
NONE = {k: 0 for k, _ in KINDS}


def _kinds(model) -> dict[str, int]:
    return {k: sum(type(m) is t for m in model.modules()) for k, t in KINDS}


@pytest.fixture(scope="module")
def real(qdir):
    """The embedded quantized model loaded with torch modules, and the inputs its lm_head, MTP head,
    RMSNorms and routers see over 512 held-out tokens (one forward, MTP layer included)."""
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.text import corpus
    from pipeline.text.tokenizer import Tokenizer

    mp = pytest.MonkeyPatch()
    mp.setenv(engine_config.ENV, "torch")
    model = load_quantized(qdir).model
    mp.undo()
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    ids: list[int] = []
    for d in corpus.load_heldout(EMBEDDED_MODEL_DIR)[1]:
        ids += tok.encode(d.text, add_bos=True)[:128]
        if len(ids) >= 513:
            break
    ids_t = torch.tensor([ids[:513]])
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.setdefault(n, a[0].detach().clone()))
             for n, m in model.named_modules() if type(m) in (RMSNorm, Router) or n.endswith("head")]
    with torch.no_grad():
        logits, hidden = model(ids_t[:, :-1], return_hidden=True)
        model.mtp(hidden, ids_t[:, 1:])
    for h in hooks:
        h.remove()
    return model, seen


@needs_native
def test_kernels_on_the_embedded_models_weights_and_activations(real):
    model, seen = real
    torch_mods = {n: model.get_submodule(n) for n in seen}
    assert sum(type(m) is Router for m in torch_mods.values()) == 3            # layers 1, 2 and MTP
    assert {"lm_head", "model.layers.3.shared_head.head"} <= set(seen)
    with torch.no_grad():
        for name, mod in torch_mods.items():
            x = seen[name]
            if type(mod) is Router:
                x = x.reshape(-1, x.shape[-1])
                w0, i0 = mod(x)
                w, i = NativeRouter(mod)(x)
                assert torch.equal(i, i0), (name, (i != i0).any(1).sum().item())    # never another expert
                assert (w - w0).abs().max().item() <= ROUTER_ATOL, name
            elif type(mod) is RMSNorm:
                _norm_close(NativeRMSNorm(mod)(x), mod(x))
            else:
                _head_close(NativeHeadLinear(mod)(x), mod(x))


@needs_native
def test_the_loader_swaps_them_where_native(qdir, monkeypatch):
    """A quantized model: the two heads, the norms and routers, and its float linears (kv_b_proj, the float
    MTP layer's; its MoE stays torch); the float model: also its MoEs and dense MLP."""
    from pipeline.model.ffn import MoE

    monkeypatch.setenv(engine_config.ENV, "native")
    model = load_quantized(qdir).model
    kinds = _kinds(model)
    # 2 heads, 3 kv_b_proj, the MTP layer's 5 attention linears, eh_proj, 16 x 3 expert and 3 shared linears
    assert kinds == {**NONE, "linear": QUANTIZED_FLOAT_LINEARS, "rms_norm": kinds["rms_norm"], "router": 3}
    assert kinds["rms_norm"] >= 13
    assert type(model.lm_head) is NativeLinear and type(model.model.layers[3].shared_head.head) is NativeLinear
    assert type(model.model.layers[3].mlp) is MoE and type(model.model.layers[0].self_attn.kv_b_proj) is NativeLinear
    assert not any(type(m) in (RMSNorm, Router) for m in model.modules())
    assert model.lm_head.weight.dtype == torch.float32                 # what reference.py builds its cache from
    assert all(m.is_compact() for m in model.modules() if isinstance(m, NativeLinear))   # bf16 bits only
    from pipeline.assets import EMBEDDED_MODEL_DIR

    f32 = load_model(EMBEDDED_MODEL_DIR).model                         # load_float: the float model
    # 5 attention linears x 4 layers, eh_proj, 2 heads, and (read as bf16 bits: float_bits) the linears the
    # C MoEs and MLP compute, 3 x (16 experts + 1 shared) x 3 and layer 0's 3; layers 1, 2, 3 MoE; layer 0's MLP
    assert _kinds(f32) == {**kinds, "linear": 23 + 3 * 17 * 3 + 3, "moe": 3, "mlp": 1}
    monkeypatch.setenv(engine_config.ENV, "torch")
    ref = load_model(EMBEDDED_MODEL_DIR).model.state_dict()            # the torch modules' state dict
    got = f32.state_dict()
    assert list(got) == list(ref) and all(torch.equal(got[n], ref[n]) and got[n].dtype == ref[n].dtype for n in ref)
    assert all(isinstance(f32.get_submodule(n[:-len(".weight")]), nn.Linear)
               for n, w in got.items() if w.dim() == 2 and "embed_tokens" not in n and ".gate." not in n)
    monkeypatch.setenv(engine_config.ENV, "native")
    bf = load_model(EMBEDDED_MODEL_DIR, dtype="bfloat16").model        # bf16: linears, MoE, MLP stay torch
    assert type(bf.lm_head) is nn.Linear and _kinds(bf) == {**NONE, "rms_norm": kinds["rms_norm"], "router": 3}


def test_torch_fallbacks(qdir, monkeypatch):
    """DSQUANT_KERNELS=torch: nothing swapped; DSQUANT_NATIVE_FLOAT=0: no library, nothing swapped, the
    other native kernels stay; an input the C code does not take runs the torch formula."""
    monkeypatch.setenv(engine_config.ENV, "torch")
    assert _kinds(load_quantized(qdir).model) == NONE
    monkeypatch.delenv(engine_config.ENV)
    monkeypatch.setenv(cpu_float.SWITCH, "0")
    cpu_float.reset()
    try:
        assert cpu_float.library() is None and "DSQUANT_NATIVE_FLOAT=0" in cpu_float.status()
        model = load_quantized(qdir).model
        assert _kinds(model) == NONE
        assert set(use_native_float_ops(model).values()) == {0}
        assert engine_config.backend("cpu") == engine_config.NATIVE                # the other C kernels stay on
    finally:
        monkeypatch.delenv(cpu_float.SWITCH)
        cpu_float.reset()
    norm = RMSNorm(24, 1e-6, dtype=torch.float16)
    x = torch.randn(3, 24).half()
    with torch.no_grad():
        assert torch.equal(NativeRMSNorm(norm)(x), norm(x))              # fp16: the torch formula itself


QUESTIONS = ["What's deep learning?", "Explain list comprehensions.", "What is a decorator?"]


QUANTIZED_FLOAT_LINEARS = 2 + 3 + 5 + 1 + 16 * 3 + 3      # the embedded quantized model's (see above)


def _greedy(qdir, tok, monkeypatch, native_float: bool):
    monkeypatch.setenv(cpu_float.SWITCH, "1" if native_float else "0")
    cpu_float.reset()
    try:
        eng = LLMEngine.from_dir(qdir, tokenizer=tok, num_blocks=64, block_size=16, nz=True, mtp=True)
        assert _kinds(eng.loaded.model)["linear"] == (QUANTIZED_FLOAT_LINEARS if native_float else 0)
        prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        return eng.generate(prompts, SamplingParams(max_new_tokens=16))
    finally:
        monkeypatch.delenv(cpu_float.SWITCH)
        cpu_float.reset()


@needs_native
def test_engine_gives_the_same_greedy_tokens(qdir, tok, monkeypatch):
    assert _greedy(qdir, tok, monkeypatch, True) == _greedy(qdir, tok, monkeypatch, False)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_is_apply_ropes_bits(dtype, monkeypatch):
    """cpu_float.rope gives apply_rope's bits: q_pe as a strided view of q (heads), k_pe as a column slice
    (no heads), leading dims that only a copy makes evenly spaced; other inputs take apply_rope itself."""
    from pipeline.model.rope import apply_rope

    g = torch.Generator().manual_seed(7)
    ang = torch.randn(1, 9, 32, generator=g) * 50
    cos, sin = ang.cos() * 1.3, ang.sin() * 1.3
    q = (torch.randn(1, 9, 4 * 96, generator=g) * 3).to(dtype)
    q_pe = q.unflatten(-1, (4, 96))[..., 32:]
    k_pe = torch.randn(1, 9, 576, generator=g).to(dtype)[..., 512:]
    odd = torch.randn(2, 5, 3, 8, generator=g).to(dtype).transpose(0, 1)
    c2, s2 = torch.randn(5, 2, 4, generator=g), torch.randn(5, 2, 4, generator=g)
    fallbacks = []
    monkeypatch.setattr(cpu_float, "apply_rope", lambda *a: fallbacks.append(1) or apply_rope(*a))
    for x, c, s in ((q_pe, cos, sin), (k_pe, cos, sin), (odd, c2, s2)):
        got = cpu_float.rope(x, c, s)
        assert got.dtype == dtype and torch.equal(got, apply_rope(x, c, s))
    assert fallbacks == []                                  # all three through the C call
    assert torch.equal(cpu_float.rope(q_pe, cos.double(), sin.double()), apply_rope(q_pe, cos.double(), sin.double()))
    assert fallbacks == [1]                                 # float64 angles: apply_rope itself
