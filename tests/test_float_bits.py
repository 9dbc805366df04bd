"""A bf16 float checkpoint read as the C float kernels' bits (pipeline.engine.worker.float_bits): the same
modules, values and outputs as the float32 model with the C modules swapped in, its linears held as bits
only, a MoE's experts as slots of the stacks the float FFN's C call reads."""

import pytest
import torch
from torch import nn

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.engine.native import cpu_float, cpu_float_ffn
from pipeline.engine.native.cpu_float import NativeLinear
from pipeline.engine.worker import float_bits
from pipeline.engine.worker.loader import load_float
from pipeline.model.ffn import MLP
from pipeline.text.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(cpu_float.library() is None or cpu_float_ffn.library() is None,
                                reason="the C float kernels are not built here")


@pytest.fixture(scope="module")
def both():
    """(read as bits, read as float32 then swapped: the loader's other path) of the embedded checkpoint."""
    bits = load_float(EMBEDDED_MODEL_DIR)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(float_bits, "takes", lambda *a: False)
        wide = load_float(EMBEDDED_MODEL_DIR)
    return bits, wide


def test_the_same_values_and_the_same_logits_bit_for_bit(both):
    bits, wide = both
    sb, sw = bits.model.state_dict(), wide.model.state_dict()
    assert sb.keys() == sw.keys()
    assert [k for k in sb if sb[k].dtype != sw[k].dtype or not torch.equal(sb[k], sw[k])] == []
    assert bits.types == wide.types
    ids = torch.tensor([Tokenizer.from_dir(EMBEDDED_MODEL_DIR).encode("The os module provides functions for")])
    with torch.no_grad():
        assert torch.equal(bits.model(ids), wide.model(ids))


def test_every_linear_is_held_as_its_bits_only(both):
    bits, wide = both
    kinds = {n: type(m) for n, m in bits.model.named_modules()}
    assert kinds.keys() == {n for n, _ in wide.model.named_modules()}
    # the float32 model keeps the linears its C MoE / MLP compute as nn.Linear; here they are bits too
    changed = {n: (kinds[n], type(m)) for n, m in wide.model.named_modules() if kinds[n] is not type(m)}
    assert changed and set(changed.values()) == {(NativeLinear, nn.Linear)}
    linears = [m for m in bits.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, NativeLinear) and m.is_compact() and "weight" not in m._parameters
                           for m in linears)
    float32 = sum(p.numel() for p in bits.model.parameters() if p.dim() == 2)
    assert float32 == sum(p.numel() for n, p in bits.model.named_parameters()     # embeddings and routers
                          if n.endswith(("embed_tokens.weight", "mlp.gate.weight")))


def test_a_moes_experts_are_slots_of_its_stacks(both):
    moes = [m for m in both[0].model.modules() if isinstance(m, cpu_float_ffn.NativeFloatMoE)]
    mlps = [m for m in both[0].model.modules() if isinstance(m, cpu_float_ffn.NativeFloatMLP)]
    assert moes and mlps
    for moe in moes:
        gu, dn, s_gu, s_dn = moe.__dict__["_packed_ffn"].keep      # made at load, not on first use
        for e, ex in enumerate(moe.experts):
            half = ex.gate_proj.out_features // 16
            assert ex.gate_proj.packed().data_ptr() == gu[e].data_ptr()
            assert ex.up_proj.packed().data_ptr() == gu[e, half:].data_ptr()
            assert ex.down_proj.packed().data_ptr() == dn[e].data_ptr()
        assert moe.shared_experts.gate_proj.packed().data_ptr() == s_gu[0].data_ptr()
        assert moe.shared_experts.down_proj.packed().data_ptr() == s_dn[0].data_ptr()
    for mlp in mlps:
        assert mlp.down_proj.packed().data_ptr() == mlp.__dict__["_packed_ffn"].keep[3][0].data_ptr()


def test_bits_mlps_stacks_what_packing_the_float32_mlps_gives():
    """Packed from bf16 into a stack's slots (gate and up the halves of their pack): the PackedFFN of
    the float32 MLPs, bit for bit, and the same outputs; the weights read back exactly."""
    g = torch.Generator().manual_seed(0)
    E, I, H = 3, 32, 24
    weights = [tuple(torch.randn(s, generator=g).bfloat16() for s in ((I, H), (I, H), (H, I))) for _ in range(E)]
    wide = []
    for gate, up, down in weights:
        mlp = MLP(H, I)
        for lin, w in zip((mlp.gate_proj, mlp.up_proj, mlp.down_proj), (gate, up, down)):
            lin.weight = nn.Parameter(w.float(), requires_grad=False)
        wide.append(mlp)
    with torch.device("meta"):
        meta = [MLP(H, I) for _ in range(E)]
    stacks = cpu_float_ffn.bits_mlps(meta, list(weights), [f"experts.{e}." for e in range(E)])
    ref = cpu_float_ffn.PackedFFN(wide, None)
    assert torch.equal(stacks[0], ref.keep[0]) and torch.equal(stacks[1], ref.keep[1])
    for a, b in zip(meta, wide):
        assert cpu_float_ffn.plain_mlp(a)
        for la, lb in zip((a.gate_proj, a.up_proj, a.down_proj), (b.gate_proj, b.up_proj, b.down_proj)):
            assert la.is_compact() and torch.equal(la.weight, lb.weight)
    x, w, idx = torch.randn(5, H, generator=g), torch.rand(5, 2, generator=g), torch.randint(0, E, (5, 2), generator=g)
    got = cpu_float_ffn._run(cpu_float_ffn.PackedFFN(meta, None, stacks=(stacks, None)), x, w, idx)
    want = cpu_float_ffn._run(ref, x, w, idx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0].abs().sum() > 0


def test_an_mlp_of_other_widths_is_not_stacked():
    assert cpu_float_ffn.stackable(2048) and not cpu_float_ffn.stackable(40)
    with torch.device("meta"):
        meta = [MLP(8, 40)]
    w = [(torch.zeros(40, 8).bfloat16(), torch.zeros(40, 8).bfloat16(), torch.zeros(8, 40).bfloat16())]
    with pytest.raises(ValueError, match="experts.0.: an MLP of 40 intermediate columns"):
        cpu_float_ffn.bits_mlps(meta, w, ["experts.0."])


def test_takes_only_a_float32_cpu_model_without_fp8_weights():
    from pipeline.io.checkpoint import CheckpointReader

    reader = CheckpointReader(EMBEDDED_MODEL_DIR)
    assert float_bits.takes(reader, torch.float32, "cpu")
    assert not float_bits.takes(reader, torch.bfloat16, "cpu")
