"""pipeline.engine.native.cpu_float_ffn: the float model's MoE (routed and shared experts in one C call) and dense
MLP against the torch modules (MoE.forward: combine_experts over MLP.forward; MLP.forward) on the embedded
model's weights and real activations, and on hand-made routings (every token on the same experts, tokens
sharing no expert, experts without tokens, no tokens); a token's output independent of the other tokens;
the fallbacks (switch off, bf16, autograd, new weights); refusals; the plain C build; the float engine's
greedy tokens with and without the C kernels.

Tolerance: the products are the float32 model's (bf16 weights widened exactly); the GEMMs sum in another
order (one FMA chain per output, or on an AMX CPU the tiles over three exact bf16 pieces of x) and the exp
(a Cephes polynomial with AVX-512) may differ from torch's vectorized exp by an ulp or two. Measured max
|diff| <= 1.2e-6 of the output's max |value| (MoE and MLP, 1 to 256 rows); FFN_RTOL allows 1e-5. The
routing is the router's own (the same module on both paths), so the tokens per expert are equal.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.cbuild import EXACT_FLAGS, NativeLibrary
from pipeline.engine.native import cpu_float, cpu_float_ffn
from pipeline.engine.native.cpu_float_ffn import FFN_C_ROWS, NativeFloatMLP, NativeFloatMoE
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine import config as engine_config
from pipeline.engine.worker.loader import load_model
from pipeline.engine.protocol import SamplingParams
from pipeline.model.ffn import MLP, MoE, combine_experts

FFN_RTOL = 1e-5                     # of max |ref|

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not engine_config.native_available() or cpu_float_ffn.library() is None,
                                 reason=f"no native kernels here: {cpu_float_ffn.status()}")]


def _close(got, ref):
    assert got.shape == ref.shape and got.dtype == torch.float32
    if ref.numel():
        d = (got - ref).abs().max().item()
        assert d <= FFN_RTOL * ref.abs().max().item(), d


@pytest.fixture(scope="module")
def real():
    """The embedded float model with torch modules, and what its MLP / MoE blocks see over ~200 held-out
    tokens (one forward, the MTP layer included): {name: (module, input [N, H])}."""
    from pipeline.text import corpus
    from pipeline.text.tokenizer import Tokenizer

    mp = pytest.MonkeyPatch()
    mp.setenv(engine_config.ENV, "torch")
    model = load_model(EMBEDDED_MODEL_DIR).model
    mp.undo()
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    ids: list[int] = []
    for d in corpus.load_heldout(EMBEDDED_MODEL_DIR)[1]:
        ids += tok.encode(d.text, add_bos=True)[:100]
        if len(ids) > 200:
            break
    ids_t = torch.tensor([ids[:201]])
    seen: dict[str, torch.Tensor] = {}
    blocks = {n: m for n, m in model.named_modules() if n.endswith(".mlp")}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.setdefault(n, a[0].detach().reshape(-1, 256)))
             for n, m in blocks.items()]
    with torch.no_grad():
        _, hidden = model(ids_t[:, :-1], return_hidden=True)
        model.mtp(hidden, ids_t[:, 1:])
    for h in hooks:
        h.remove()
    return {n: (blocks[n], seen[n]) for n in blocks}


def test_the_models_blocks_on_real_activations(real):
    kinds = sorted(type(m).__name__ for m, _ in real.values())
    assert kinds == ["MLP", "MoE", "MoE", "MoE"]                  # layer 0 dense; 1, 2 and the MTP layer
    with torch.no_grad():
        for name, (mod, x) in real.items():
            nat = NativeFloatMoE(mod) if type(mod) is MoE else NativeFloatMLP(mod)
            for rows in (1, 5, 16, x.shape[0]):                    # decode- and prefill-sized
                xs = x[:rows][None]
                _close(nat(xs), mod(xs))
                if type(mod) is MoE:
                    assert torch.equal(nat.last_load, mod.last_load), (name, rows)
            assert nat.packed() is not None and nat.state_dict().keys() == mod.state_dict().keys()


def _moe(real) -> MoE:
    return real["model.layers.1.mlp"][0]


def _torch_routed(moe: MoE, flat, weights, idx):
    out, load = combine_experts(flat, weights, idx, len(moe.experts), lambda e, t: moe.experts[e](flat[t]))
    return out + moe.shared_experts(flat), load


@pytest.mark.parametrize("case", ["same experts", "disjoint", "few experts", "no tokens"])
def test_hand_made_routings(real, case):
    moe = _moe(real)
    nat = NativeFloatMoE(moe)
    g = torch.Generator().manual_seed(3)
    N = {"same experts": 9, "disjoint": 4, "few experts": 12, "no tokens": 0}[case]
    flat = torch.randn(N, 256, generator=g)
    if case == "same experts":
        idx = torch.tensor([[5, 0, 15, 7]] * N)
    elif case == "disjoint":
        idx = torch.arange(16).view(4, 4)
    else:
        idx = torch.stack([torch.randperm(16, generator=g)[:4] % 3 + torch.tensor([0, 3, 6, 9]) for _ in range(N)]) \
            if N else torch.empty(0, 4, dtype=torch.int64)
    weights = torch.rand(N, 4, generator=g)
    with torch.no_grad():
        out, load = cpu_float_ffn._run(nat.packed(), flat, weights, idx)
        ref, ref_load = _torch_routed(moe, flat, weights, idx)
    _close(out, ref)
    assert torch.equal(load, ref_load) and load.sum().item() == 4 * N


def test_a_tokens_output_does_not_depend_on_the_other_tokens(real):
    """Bit for bit: each token alone, the tokens in another order (a prefix-cache hit's entries against
    recomputed ones, decode rows against prefill rows)."""
    moe, x = real["model.layers.2.mlp"]
    nat = NativeFloatMoE(moe)
    mlp = NativeFloatMLP(real["model.layers.0.mlp"][0])
    flat = x[:40]
    with torch.no_grad():
        weights, idx = moe.gate(flat)
        full, _ = cpu_float_ffn._run(nat.packed(), flat, weights, idx)
        dense = mlp(flat)
        for t in (0, 7, 39):
            assert torch.equal(cpu_float_ffn._run(nat.packed(), flat[t:t + 1], weights[t:t + 1], idx[t:t + 1])[0],
                               full[t:t + 1])
            assert torch.equal(mlp(flat[t:t + 1]), dense[t:t + 1])
        perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
        assert torch.equal(cpu_float_ffn._run(nat.packed(), flat[perm], weights[perm], idx[perm])[0], full[perm])


def test_fallbacks_run_the_torch_modules(real):
    """A dense MLP above FFN_C_ROWS rows, and autograd, run the torch modules' formula."""
    moe, x = real["model.layers.1.mlp"]
    mlp = real["model.layers.0.mlp"][0]
    nat, nmlp = NativeFloatMoE(moe), NativeFloatMLP(mlp)
    xs = x[:6][None]
    with torch.no_grad():
        big = x[:1].expand(FFN_C_ROWS + 1, 256)                            # a dense MLP above FFN_C_ROWS rows
        assert torch.equal(nmlp(big), mlp(big))
    xg = xs.clone().requires_grad_(True)                                  # autograd: the torch formula
    nat(xg).sum().backward()
    g_nat = xg.grad.clone()
    xg.grad = None
    moe(xg).sum().backward()
    assert torch.equal(g_nat, xg.grad)
    moe.zero_grad(set_to_none=True)


def test_new_weights_are_packed_again(real):
    moe = _moe(real)
    g = torch.Generator().manual_seed(5)
    fresh = {n: (torch.randn(t.shape, generator=g) * 0.05).bfloat16().float() if t.dim() == 2 else t.clone()
             for n, t in moe.state_dict().items()}
    other = copy.deepcopy(moe)
    other.load_state_dict(fresh)
    nat = NativeFloatMoE(copy.deepcopy(moe))
    x = torch.randn(1, 7, 256, generator=g)
    with torch.no_grad():
        nat(x)                                                            # packed with the old weights
        nat.load_state_dict(fresh)                                        # the post hook drops the pack
        _close(nat(x), other(x))
        assert torch.equal(nat.last_load, other.last_load)
        half = copy.deepcopy(nat).to(torch.bfloat16)                      # no longer float32: the torch path
        assert half.packed() is None
        assert torch.equal(half(x.bfloat16()), MoE.forward(half, x.bfloat16()))


def test_refusals_and_bad_routes(real):
    moe = _moe(real)
    nat = NativeFloatMoE(moe)
    flat = torch.randn(3, 256)
    with pytest.raises(ValueError, match=r"router expert ids outside \[0, 16\) \(min 0, max 16\)"):
        cpu_float_ffn._run(nat.packed(), flat, torch.ones(3, 4), torch.tensor([[0, 1, 2, 16]] * 3))
    with pytest.raises(ValueError, match=r"MoE: routes idx \[2, 4\] / weights \[2, 4\] do not fit 3 tokens"):
        cpu_float_ffn._run(nat.packed(), flat, torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.int64))
    random_mlp = MLP(256, 128)                                            # random float32: not bf16 values
    with pytest.raises(ValueError, match="NativeFloatMLP: an MLP of bias-free float32 linears holding bf16"):
        NativeFloatMLP(random_mlp)
    bad = copy.deepcopy(moe)
    bad.experts[3] = random_mlp
    with pytest.raises(ValueError, match="NativeFloatMoE: every routed expert must be an MLP"):
        NativeFloatMoE(bad)


def test_plain_c_build_agrees(real, monkeypatch):
    """The loops without AVX-512 (no -march=native)."""
    plain = NativeLibrary(cpu_float_ffn.CSRC / "float_ffn_cpu.c", cpu_float_ffn._declare, ("-O2", "-shared", "-fPIC"),
                          what="plain C float FFN")
    assert plain.library() is not None, plain.status()
    moe, x = real["model.layers.1.mlp"]
    mlp = real["model.layers.0.mlp"][0]
    xs = x[:5][None]
    with torch.no_grad():
        ref, ref_mlp = moe(xs), mlp(xs)
        monkeypatch.setattr(cpu_float_ffn, "_LIB", plain)
        _close(NativeFloatMoE(moe)(xs), ref)
        _close(NativeFloatMLP(mlp)(xs), ref_mlp)


def test_the_amx_tiles_agree_with_the_fma_chains(real, monkeypatch):
    """Where the CPU has AMX every GEMM here (k = 256, 128, 768) runs on the tiles: the MoE and the MLP agree
    with the FMA-only build within FFN_RTOL (and both with torch), 1 to 300 tokens."""
    if not cpu_float.library().bf16_linear_has_amx():
        pytest.skip(f"no AMX here ({cpu_float.status()}): the FMA chains are the ones tested")
    fma = NativeLibrary(cpu_float_ffn.CSRC / "float_ffn_cpu.c", cpu_float_ffn._declare,
                        EXACT_FLAGS + ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"), what="FMA-only float FFN")
    assert fma.library() is not None, fma.status()
    moe, x = real["model.layers.2.mlp"]
    mlp = real["model.layers.0.mlp"][0]
    for n in (1, 16, 300):
        xs = x[:n][None]
        with torch.no_grad():
            ref, ref_mlp = moe(xs), mlp(xs)
            amx, amx_mlp = NativeFloatMoE(moe)(xs), NativeFloatMLP(mlp)(xs)
            monkeypatch.setattr(cpu_float_ffn, "_LIB", fma)
            chained, chained_mlp = NativeFloatMoE(moe)(xs), NativeFloatMLP(mlp)(xs)
            monkeypatch.undo()
        for got in (amx, chained):
            _close(got, ref)
        for got in (amx_mlp, chained_mlp):
            _close(got, ref_mlp)
        _close(amx, chained)
        _close(amx_mlp, chained_mlp)


QUESTIONS = ["What's deep learning?", "Explain list comprehensions.", "What is a decorator?"]


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_float_engine_gives_the_same_greedy_tokens(mtp, monkeypatch):
    from pipeline.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = []
    for on in (True, False):
        monkeypatch.setenv(cpu_float.SWITCH, "1" if on else "0")
        cpu_float.reset()
        cpu_float_ffn.reset()
        try:
            eng = LLMEngine.from_dir(EMBEDDED_MODEL_DIR, tokenizer=tok, num_blocks=64, block_size=16, nz=True, mtp=mtp)
            n_moe = sum(type(m) is NativeFloatMoE for m in eng.loaded.model.modules())
            assert n_moe == (3 if on else 0)
            outs.append(eng.generate(prompts, SamplingParams(max_new_tokens=16)))
        finally:
            monkeypatch.delenv(cpu_float.SWITCH)
            cpu_float.reset()
            cpu_float_ffn.reset()
    assert outs[0] == outs[1]
