"""A compact int8 linear (pipeline.engine.native.cpu_linear.compact): the C kernels' packed copy is the
module's only copy of its weight, as the engine's loader leaves every linear and every int8 MoE's experts
(peak and steady memory: the weights once). The packed layout is a permutation of the integers, so the
weight read back from it (``unpack``, the torch path, ``state_dict()``) is the stored one, and every output
is the non-compact module's.

Tolerance: none; every comparison is ``torch.equal``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline.engine.layers.moe import Int8MoE
from pipeline.engine.layers.qlinear import FP32_CHUNKED, Int8Linear, W8A8DynamicLinear
from pipeline.engine.native import cpu_linear, cpu_moe
from pipeline.engine.worker.loader import load_quantized
from tests.test_native_linear import inputs, make, torch_path

pytestmark = [pytest.mark.skipif(cpu_linear.library() is None, reason="no C compiler: nothing is packed"),
              pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("n,k", [(128, 256), (100, 130), (7, 5), (16, 4)])
def test_unpack_gives_back_the_packed_integers(n, k):
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n * k))
    pack, _ = cpu_linear.pack_weight(w)
    assert torch.equal(cpu_linear.unpack(pack, n, k), w)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_a_compact_linear_gives_the_same_outputs_weight_and_state(kind):
    g = torch.Generator().manual_seed(5)
    mod = make(kind, 100, 130, "exact", kind == "dynamic", g)
    w = mod.weight.clone()
    x = inputs(5, 130, torch.float32, g)
    before, state = mod(x), {k: v.clone() for k, v in mod.state_dict().items()}
    cpu_linear.compact(mod)
    assert mod.weight is None and torch.equal(mod.int8_weight(), w)
    assert torch.equal(mod(x), before) and torch.equal(torch_path(mod, x), before)   # C and torch paths
    got = mod.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    other = make(kind, 100, 130, "exact", kind == "dynamic", g)
    mod.load_state_dict(other.state_dict())                 # loads like any module, then packs again
    assert torch.equal(mod.weight, other.weight) and torch.equal(mod(x), torch_path(other, x))
    cpu_linear.compact(mod)
    mod.to(torch.device("cpu"))                             # _apply: the weight comes back first
    assert torch.equal(mod.weight, other.weight) and torch.equal(mod(x), torch_path(mod, x))


def test_the_engine_loads_every_int8_weight_once_and_answers_the_same(qdir):
    """The loader packs every layer as it reads it: no int8 weight buffer is left, each linear's weight
    is held once (its pack), and the logits equal a model whose linears run the torch path on buffers."""
    loaded = load_quantized(qdir)
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    moes = [m for m in model.modules() if isinstance(m, Int8MoE)]
    assert linears and moes and all(cpu_linear.is_compact(m) for m in linears)
    assert not any(b.dtype == torch.int8 for b in model.buffers())
    for moe in moes:                        # each expert linear's pack is a slice of the MoE's stacked pack
        stacked = moe.__dict__["_native_experts"].keep[0]
        e = moe.experts[1].gate_up.__dict__["_native_packed"].pack
        assert e.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    ids = torch.tensor([[1, 17, 200, 5, 9, 33]])
    want = load_quantized(qdir, kernels=replace(loaded.kernels, linears=False)).model   # torch linears: no packs
    assert not any(cpu_linear.is_compact(m) for m in want.modules() if isinstance(m, Int8Linear))
    with torch.no_grad():
        assert torch.equal(model(ids), want(ids))


def test_a_compact_moe_repacks_from_its_packs_after_a_drop(qdir):
    model = load_quantized(qdir).model
    moe = next(m for m in model.modules() if isinstance(m, Int8MoE))
    x = torch.randn(3, moe.experts[0].gate_up.in_features, generator=torch.Generator().manual_seed(6))
    before = moe(x)
    cpu_moe.drop_pack(moe)                   # packed again on the next call, from the experts' packs
    assert torch.equal(moe(x), before)
    lin = moe.experts[0].down_proj
    assert isinstance(lin, W8A8DynamicLinear) and lin.weight is None
    lin.kernel = FP32_CHUNKED
    h = torch.randn(2, lin.in_features, generator=torch.Generator().manual_seed(7))
    got = lin(h)
    lin.kernel = "auto"
    assert torch.equal(got, lin(h))
