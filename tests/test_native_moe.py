"""pipeline.engine.native.cpu_moe: the routed experts of an Int8MoE in two C calls (all tokens at once) equal the
torch path (a Python loop over experts: combine_experts over Int8Expert.forward_quantized) bit for bit,
``last_load`` included, on the embedded model's MoE layers (both epilogues, float32 and bf16 tokens) and on
hand-made routings (tokens sharing no expert, experts without tokens, every token on the same experts);
the engine's greedy tokens on the embedded model are the same with and without the C kernels.

Tolerance: none (``torch.equal``). SiLU is torch's on both paths, on rows of the same strides, so it
cannot differ; the C code runs the quantization, the epilogues, the casts and the index_add_ additions
with the same float operations in the same order (cpu_moe's module docstring).
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.native import cpu_linear, cpu_moe
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine.worker.loader import load_quantized
from pipeline.engine.layers.moe import Int8MoE
from pipeline.engine.layers.qlinear import EXACT, FAST, Int8Linear, quantize_per_token
from pipeline.engine.protocol import SamplingParams
from pipeline.model.ffn import combine_experts

pytestmark = [pytest.mark.skipif(cpu_linear.library() is None, reason="no C compiler: the torch path only"),
              pytest.mark.usefixtures("one_torch_thread")]        # conftest: fast on 2 shared cores

QUESTIONS = ["What's deep learning?", "What does the os module do?", "Explain list comprehensions."]


@pytest.fixture(scope="module")
def models(qdir):
    return {epi: load_quantized(qdir, epilogue=epi).model for epi in (EXACT, FAST)}


def moe_layers(model) -> list[Int8MoE]:
    return [m for m in model.modules() if isinstance(m, Int8MoE)]


def torch_routed(moe: Int8MoE, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor):
    """The torch path's routed part (Int8MoE.forward without the shared expert)."""
    x_q, s_tok = quantize_per_token(flat)
    return combine_experts(flat, weights, idx, len(moe.experts),
                           lambda e, t: moe.experts[e].forward_quantized(x_q[t], s_tok[t], flat.dtype))


def run(moe, x, native: bool):
    """``moe(x)`` and its load with its C kernels on or off (the MoE's and its linears': what the engine's
    kernels set when the model is built)."""
    mods = [moe] + [m for m in moe.modules() if isinstance(m, Int8Linear)]
    saved = [m.native for m in mods]
    for m in mods:
        m.native = native
    try:
        with torch.no_grad():
            return moe(x), moe.last_load
    finally:
        for m, s in zip(mods, saved):
            m.native = s


@pytest.mark.parametrize("epilogue", [EXACT, FAST])
def test_the_models_moe_layers(models, epilogue, monkeypatch):
    model = models[epilogue]
    layers = moe_layers(model)
    assert len(layers) == 2
    g = torch.Generator().manual_seed(0)
    for moe in layers:
        assert cpu_moe.can_run(moe, torch.zeros(1, model.config.hidden_size))
        for rows in (1, 5, 64, 130, 520):      # 520: ~130 slots an expert (the AMX tiles)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(1, rows, model.config.hidden_size, generator=g).to(dtype)
                (a, la), (b, lb) = run(moe, x, False), run(moe, x, True)
                assert "_native_experts" in moe.__dict__
                assert a.dtype == b.dtype == dtype and a.shape == b.shape and torch.equal(a, b), (rows, dtype)
                assert torch.equal(la, lb) and int(lb.sum()) == rows * moe.gate.top_k


def test_hand_made_routings(models):
    """Routings the router rarely gives: each token on its own experts, most experts idle, all tokens on
    the same experts (in a different order per token), a token count of zero."""
    moe = moe_layers(models[EXACT])[0]
    E, H, k = len(moe.experts), moe.gate.weight.shape[1], moe.gate.top_k
    g = torch.Generator().manual_seed(1)
    N = E // k
    cases = {
        "disjoint": torch.arange(N * k).reshape(N, k),
        "idle experts": torch.tensor([[0, 3, 5, 9], [9, 5, 3, 0], [3, 0, 9, 5]])[:, :k],
        "same experts": torch.tensor([[1, 2, 3, 4]] * 7)[:, :k].roll(1, dims=1),
    }
    for name, idx in cases.items():
        flat = torch.randn(idx.shape[0], H, generator=g)
        w = torch.rand(idx.shape, generator=g)
        got, load = cpu_moe.routed(moe, flat, w, idx)
        want, want_load = torch_routed(moe, flat, w, idx)
        assert torch.equal(got, want) and torch.equal(load, want_load), name
        assert (load == 0).sum() >= (E - idx.unique().numel()), name
    empty, load = cpu_moe.routed(moe, torch.zeros(0, H), torch.zeros(0, k), torch.zeros(0, k, dtype=torch.int64))
    assert empty.shape == (0, H) and int(load.sum()) == 0
    with pytest.raises(ValueError, match=rf"MoE: router expert ids outside \[0, {E}\)"):
        cpu_moe.routed(moe, torch.zeros(1, H), torch.ones(1, k), torch.full((1, k), E))
    with pytest.raises(ValueError, match="MoE: tokens"):
        cpu_moe.routed(moe, torch.zeros(2, H + 1), torch.ones(2, k), torch.zeros(2, k, dtype=torch.int64))


def test_load_state_dict_repacks(qdir, monkeypatch):
    model = load_quantized(qdir).model
    a, b = moe_layers(model)
    x = torch.randn(1, 4, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    run(a, x, True)
    assert "_native_experts" in a.__dict__
    a.load_state_dict(b.state_dict())                    # layer 1 now holds layer 2's weights (and router)
    assert "_native_experts" not in a.__dict__
    assert torch.equal(run(a, x, True)[0], run(b, x, False)[0])


def test_engine_greedy_tokens_are_the_same(qdir, tok, monkeypatch):
    """The embedded model end to end, batched decode and prefill: the C linears and MoE on (the default) and
    off (DSQUANT_NATIVE_LINEAR=0: every int8 linear and MoE on the torch path; attention unchanged)."""
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = SamplingParams(max_new_tokens=16)

    def generate():
        return LLMEngine.from_dir(qdir, tokenizer=tok, num_blocks=64, block_size=16).generate(prompts, greedy)

    native = generate()
    with monkeypatch.context() as mp:
        mp.setenv("DSQUANT_NATIVE_LINEAR", "0")            # read when the engine is built
        reference = generate()
    assert native == reference and all(len(t) > 0 for t in native)
