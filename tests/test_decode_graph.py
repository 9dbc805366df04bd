"""Replayed decode steps (pipeline.engine.worker.decode_graph) against the eager path, the reference: the same
engine with ``decode_graph=False``. Everything must be bit for bit the same (no tolerance: the graph makes
the same calls on the same values), on the quantized model (W8A8 + FA3 int8 latent; and a bf16 latent)
and the float model (bf16 latent; and a float32 one), ND and NZ: every step's logits and final hidden
state, the generated tokens and the whole cache after the run. The prompts are ragged and their decode
crosses block boundaries, and rows join and leave (9 prompts of different lengths, one prompt alone).

Also: which steps are replayed (pure decode steps only), when the runner stays eager (compiled regions,
a module of an unknown type, DSQUANT_DECODE_GRAPH=0 when the engine is built), a model built with the
float C ops off (its graph calls the torch modules as the eager path does), a C error names the op, the
profiler's timer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.engine.worker import decode_graph
from pipeline.engine.attention.batched import DecodeBatch
from pipeline.engine.worker.decode_graph import DecodeGraph, GraphError
from pipeline.engine.config import GRAPH_ENV, EngineConfig
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine.worker.loader import load_model
from pipeline.engine.protocol import SamplingParams

NEW = SamplingParams(max_new_tokens=40)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def models(qdir):
    return {"w8a8": load_model(qdir), "float": load_model(str(EMBEDDED_MODEL_DIR))}


def _prompts(n: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, 4000, (20 + 7 * i,), generator=g).tolist() for i in range(n)]


def _run(loaded, prompts, **config):
    """(tokens per prompt, every step's (logits, hidden) copies, the engine)."""
    eng = LLMEngine(loaded, EngineConfig(num_blocks=256, max_num_seqs=16, max_batched_tokens=512, **config))
    steps = []
    forward = eng.runner.forward

    def recording(spans, rows):
        logits, hidden = forward(spans, rows)
        steps.append((logits.clone(), hidden.clone(), all(sp.n == 1 for sp in spans)))
        return logits, hidden
    eng.runner.forward = recording
    out = eng.generate(prompts, NEW)
    return out, steps, eng


def _same_run(a, b) -> None:
    (ta, sa, ea), (tb, sb, eb) = a, b
    assert ta == tb
    assert len(sa) == len(sb)
    for i, ((la, ha, _), (lb, hb, _)) in enumerate(zip(sa, sb)):
        assert torch.equal(la, lb) and torch.equal(ha, hb), f"step {i}: logits / hidden differ"
    for i, ca in ea.runner.caches.items():
        cb = eb.runner.caches[i]
        assert torch.equal(ca.c, cb.c) and torch.equal(ca.pe, cb.pe), f"layer {i}: caches differ"


CASES = [("w8a8", dict(nz=True)), ("w8a8", dict(nz=False, fa3=False)),
         ("float", dict(nz=True)), ("float", dict(nz=False, cache_dtype="float32"))]


@pytest.mark.parametrize("model, config", CASES, ids=["w8a8-fa3-nz", "w8a8-bf16-nd", "float-bf16-nz", "float-f32-nd"])
def test_replayed_steps_are_the_eager_steps_bit_for_bit(models, model, config):
    prompts = _prompts()
    eager = _run(models[model], prompts, decode_graph=False, **config)
    replayed = _run(models[model], prompts, **config)
    _same_run(eager, replayed)
    runner = replayed[2].runner
    assert runner._graph_why == "" and not eager[2].runner._graphs
    decode_steps = sum(d for *_, d in replayed[1])
    assert decode_steps >= 30 and len(runner._graphs) >= 3          # rows left as prompts finished
    assert all(not g.unbound for g in runner._graphs.values())      # every module bound to its C call


def test_one_sequence_and_mtp(models):
    one = _prompts(1)
    _same_run(_run(models["w8a8"], one, decode_graph=False), _run(models["w8a8"], one))
    # with MTP every decode step verifies a draft (two tokens a sequence): no step is replayed
    eager, replayed = (_run(models["w8a8"], _prompts(3), mtp=True, decode_graph=g) for g in (False, True))
    _same_run(eager, replayed)
    assert not replayed[2].runner._graphs


def test_when_the_runner_stays_eager(models, monkeypatch):
    eng = LLMEngine(models["float"], EngineConfig(num_blocks=64, compile=True))
    assert decode_graph.ineligible(eng.runner) == "compiled regions"

    class Wrapped(nn.Module):                   # e.g. a sharded replica's row-parallel linear
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)
    loaded = load_model(str(EMBEDDED_MODEL_DIR))
    attn = loaded.model.model.layers[1].self_attn
    cls = type(attn.q_a_proj)
    attn.q_a_proj.__class__ = type("SubLinear", (cls,), {})   # a subclass may call more than its base
    assert decode_graph.ineligible(LLMEngine(loaded, EngineConfig(num_blocks=64)).runner) \
        == "layer 1 self_attn.q_a_proj: SubLinear"
    attn.q_a_proj.__class__ = cls
    attn.o_proj = Wrapped(attn.o_proj)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=64))
    assert decode_graph.ineligible(eng.runner) == "layer 1 self_attn.o_proj: Wrapped"
    eng.generate(_prompts(2), SamplingParams(max_new_tokens=4))
    assert eng.runner._graph_why and not eng.runner._graphs

    monkeypatch.setenv(GRAPH_ENV, "0")                   # read when the engine is built, recorded in its config
    eng = LLMEngine(models["float"], EngineConfig(num_blocks=64))
    assert eng.config.decode_graph is False
    monkeypatch.delenv(GRAPH_ENV)
    eng.generate(_prompts(2), SamplingParams(max_new_tokens=4))
    assert not eng.runner._graphs
    eng = LLMEngine(models["float"], EngineConfig(num_blocks=64))
    eng.generate(_prompts(2), SamplingParams(max_new_tokens=4))
    assert sorted(eng.runner._graphs) == [2]


def test_a_model_built_with_the_float_ops_off(models, monkeypatch):
    """DSQUANT_NATIVE_FLOAT=0 when the model is loaded keeps its float norms / linears / FFNs torch's (the
    kernels, chosen then, say so): its graph calls those modules as eager does (``unbound``), still bit
    for bit. The switch flipped later changes nothing in a model already built."""
    prompts = _prompts(4)
    _, _, eng = _run(models["float"], prompts)
    assert eng.runner._graphs and all(not g.unbound for g in eng.runner._graphs.values())
    monkeypatch.setenv("DSQUANT_NATIVE_FLOAT", "0")
    torch_float = load_model(str(EMBEDDED_MODEL_DIR))
    assert not torch_float.kernels.float_ops and models["float"].kernels.float_ops
    eager = _run(torch_float, prompts, decode_graph=False)
    replayed = _run(torch_float, prompts)
    _same_run(eager, replayed)
    graphs = replayed[2].runner._graphs
    assert graphs and all({"RMSNorm", "MoE"} <= set(g.unbound) for g in graphs.values())
    again = _run(models["float"], prompts)
    assert all(not g.unbound for g in again[2].runner._graphs.values())


def test_a_kernel_error_names_the_op_and_the_profiler_sees_each_region(models):
    eng = LLMEngine(models["w8a8"], EngineConfig(num_blocks=64))
    g = DecodeGraph(eng.runner, 1)
    cos = sin = torch.zeros(1, 1, g.cos.shape[-1])
    slots = torch.zeros(1, dtype=torch.long)
    seen: dict[str, float] = {}

    def timer(region, seconds):
        seen[region] = seen.get(region, 0.0) + seconds
    ok = DecodeBatch.build([[0]], [1], 16, 64)
    logits, hidden = g.run([7], cos, sin, slots, ok, timer)
    assert logits.shape == (1, eng.runner.cfg.vocab_size) and hidden.shape == (1, eng.runner.cfg.hidden_size)
    assert set(seen) == {"model other", "linears", "cache write", "attention", "moe"}
    bad = DecodeBatch(torch.zeros(1, 1, dtype=torch.long), torch.tensor([40]), 40, 40)   # 40 tokens in 1 block
    with pytest.raises(GraphError, match=r"decode graph \(1 rows\): op \d+ .*attention\) returned 2"):
        g.run([7], cos, sin, slots, bad)


def test_a_thread_count_change_makes_the_graphs_again(models):
    """The int8 linears' ``auto`` choice reads torch's thread count: a graph made under one count is not
    replayed under another."""
    _, _, eng = _run(models["w8a8"], _prompts(2))
    before = list(eng.runner._graphs.values())
    torch.set_num_threads(2)
    try:
        eng.generate(_prompts(2), SamplingParams(max_new_tokens=4))
    finally:
        torch.set_num_threads(1)
    assert eng.runner._graphs and not any(g in before for g in eng.runner._graphs.values())
