"""A sharded replica (tp / dp / moe_ep / moe_tp over Ray actors joined by gloo) against the single-rank engine, on
the quantized embedded model (MTP on) and on msModelSlim's own output for the tiny fixture.

Real parts: the session's simulated Ray cluster (three 2-CPU nodes, so a 4-rank replica spans nodes),
real ``torch.distributed`` gloo groups between the test process (rank 0) and the rank actors.

Exactness (pipeline.engine.sharding.sharded): with the ``exact`` MoE combine every logit equals the single-rank
engine's bit for bit, and every int8 linear's output on rank 0 equals the single-rank linear's (its slice
for a column-parallel one); with ``reduce`` the MoE's float sums run in another order, so logits agree
within REDUCE_LOGIT_ATOL and greedy outputs token for token.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine_ref import drain, request, submit
from environ import environment
from pipeline.engine.config import EngineConfig
from pipeline.engine.core.engine import LLMEngine
from pipeline.engine.worker.loader import load_quantized
from pipeline.engine.layers.moe import Int8MoE
from pipeline.engine.layers.qlinear import Int8Linear
from pipeline.engine.worker.runner import Span
from pipeline.engine.protocol import SamplingParams
from pipeline.engine.sharding.shard_loader import held_parts, resident_bytes
from pipeline.engine.sharding.shard_spec import COL, FULL, linear_role, part, tensor_slice
from pipeline.engine.sharding.sharded import RowParallel
from pipeline.engine.sharding.comm import Comm
from pipeline.format.reader import QuantizedSource
from pipeline.parallel import ParallelConfig
from pipeline.text.tokenizer import Tokenizer

MSMODELSLIM = Path(__file__).parent / "fixtures" / "msmodelslim-v1-bf16"
QUESTIONS = ["What's deep learning?", "How do I open a file?", "Explain list comprehensions"]
REDUCE_LOGIT_ATOL = 1e-3     # float32 MoE sums in another order, through 3 layers (measured ~1e-5)
DP_LOGIT_ATOL = 1e-3         # the router's float GEMM over a batch of another size (measured ~1e-6)
FLOAT_UPCAST = 2             # the engine holds the bf16 float parts in float32
CFG = EngineConfig(num_blocks=64, nz=True, mtp=True)


# ----- the layout, without Ray -----------------------------------------------------------------------
def test_parallel_config_fills_moe_tp_and_refuses_what_cannot_be_split():
    assert ParallelConfig(tp=2).moe_tp == 2 and ParallelConfig(tp=4, moe_ep=2).moe_tp == 2
    p = ParallelConfig(dp=2, tp=8, moe_ep=4)
    assert (p.world, p.moe_tp, p.tp_group(9), p.moe_tp_group(9), p.dp_peers(9)) == \
        (16, 4, list(range(8, 16)), [8, 9, 10, 11], [1, 9])
    with pytest.raises(ValueError, match="moe_ep 3 does not divide"):
        ParallelConfig(tp=4, moe_ep=3)
    with pytest.raises(ValueError, match="moe_ep x moe_tp = 2x1"):
        ParallelConfig(tp=4, moe_ep=2, moe_tp=1)
    with pytest.raises(ValueError, match="sp 2 is not supported"):
        ParallelConfig(tp=2, sp=2)
    with pytest.raises(ValueError, match="tp 8 does not divide the model's 4 attention heads"):
        ParallelConfig(tp=8).check_model(4, 16, 128, 768, 4096)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, moe_ep=2), dict(tp=4, moe_ep=4)])
def test_every_rank_reads_only_its_share(embedded_quantized, layout):
    """Every split weight is read once over the ranks (its parts tile it); an expert only by its owners;
    everything else whole by every rank; and the ranks' weight bytes are even."""
    src = QuantizedSource(embedded_quantized)
    p = ParallelConfig(**layout)
    parts = [held_parts(src, Comm(p, r), with_mtp=True) for r in range(p.world)]
    weight_bytes = [0] * p.world
    for n in src.where:
        held = [(r, ps[n]) for r, ps in enumerate(parts) if n in ps]
        owners = {r for r, _ in held}
        expert = ".experts." in n
        assert owners == (set(range(p.world)) if not expert else owners) and owners
        if expert:
            e = int(n.split(".experts.")[1].split(".")[0])
            assert all(p.ep_rank(r) == e // (src.config.n_routed_experts // p.moe_ep) for r in owners), n
        cuts = [s for _, s in held if s != FULL]
        if cuts:                                            # split: the parts tile the dimension once
            dim = cuts[0][0]
            assert sorted((a, b) for _, a, b in cuts) == [(k * (src.shape(n)[dim] // len(cuts)),
                                                           (k + 1) * (src.shape(n)[dim] // len(cuts)))
                                                          for k in range(len(cuts))], n
        if n.endswith(".weight"):
            size = src.where[n].info(n).end - src.where[n].info(n).start
            for r, s in held:
                weight_bytes[r] += size if s == FULL else size * (s[2] - s[1]) // src.shape(n)[s[0]]
    assert max(weight_bytes) - min(weight_bytes) <= 0.01 * max(weight_bytes)


# ----- sharded replicas on the simulated cluster ----------------------------------------------------
@pytest.fixture(scope="module")
def tok(embedded_quantized):
    return Tokenizer.from_dir(embedded_quantized)


@contextmanager
def _torch_linears(model):
    """The int8 linears and MoEs of ``model`` on their torch path inside the block (their C kernels, chosen
    when the model was built, off), as they were after it."""
    mods = [m for m in model.modules() if isinstance(m, (Int8Linear, Int8MoE))]
    saved = [m.native for m in mods]
    for m in mods:
        m.native = False
    try:
        yield
    finally:
        for m, s in zip(mods, saved):
            m.native = s


def _one_rank(path: str, cfg: EngineConfig, tok=None) -> LLMEngine:
    """The one-rank reference with the torch lm_head / RMSNorm / router modules the ranks' shard loader
    builds (the loader swaps C ones in on a CPU: within float32 rounding, not bit for bit)."""
    with environment(DSQUANT_NATIVE_FLOAT="0"):
        return LLMEngine(load_quantized(path), cfg, tok)


@pytest.fixture(scope="module")
def single(embedded_quantized, tok):
    return _one_rank(embedded_quantized, CFG, tok)


def _sharded(path, layout, tok, combine):
    from actors.serving.engine.rank_group import build_sharded_engine

    return build_sharded_engine(path, ParallelConfig(**layout), CFG, tok, combine=combine, log=lambda m: None)


def _capture(model) -> dict:
    """name -> the last output of every int8 linear (and RowParallel) in ``model``."""
    out = {}
    for m in model.modules():
        inner = m.inner if isinstance(m, RowParallel) else m
        if isinstance(inner, Int8Linear):                   # float RowParallels (the float MTP layer) aside
            name = inner.name
            m.register_forward_hook(lambda mod, args, y, name=name: out.__setitem__(name, y.detach().clone()))
    return out


def _prefill_then_decode(runner, ids):
    blocks = list(range(4))
    logits1, _ = runner.forward([Span(ids, 0, blocks)], [len(ids) - 1])
    nxt = int(logits1[0].argmax())
    logits2, _ = runner.forward([Span([nxt], len(ids), blocks)], [0])
    return logits1, logits2


def _slice_of(cfg, p, name, y):
    """The columns of the single-rank output ``y`` that rank 0's linear ``name`` computes."""
    base = name.split("+")[0]
    role, group, width = linear_role(cfg, base)
    if role != COL:
        return y
    a, b = part(width, p, 0, group)
    if "+" in name:                      # gate and up stacked: [gate rows | up rows] of each
        return torch.cat([y[..., a:b], y[..., width + a:width + b]], dim=-1)
    return y[..., a:b]


LAYOUTS = [pytest.param(dict(tp=2), id="tp2-moe_tp2"), pytest.param(dict(tp=2, moe_ep=2), id="tp2-moe_ep2"),
           pytest.param(dict(tp=4, moe_ep=4), id="tp4-moe_ep4-two-nodes")]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_combine_is_bit_identical_to_one_rank(ray_cluster, embedded_quantized, tok, single, layout):
    eng = _sharded(embedded_quantized, layout, tok, "exact")
    try:
        assert eng.warm_up(tokens=96) > 0        # as a served replica starts (actors.serving.engine.engine_replica): no trace
        p = ParallelConfig(**layout)
        ids = tok.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
        seen_single, seen_rank0 = _capture(single.loaded.model), _capture(eng.loaded.model)
        with _torch_linears(single.loaded.model):   # every expert linear of the reference runs (and is seen)
            want = _prefill_then_decode(single.runner, ids)      # on the torch path: the same bits
        got = _prefill_then_decode(eng.runner, ids)
        for w, g in zip(want, got):
            assert torch.equal(w, g)
        assert set(seen_rank0) <= set(seen_single) and len(seen_rank0) > 20
        for name, y in seen_rank0.items():
            assert torch.equal(_slice_of(single.loaded.config, p, name, seen_single[name]), y), name
        # the rest of the cluster: greedy generation with MTP, token for token; each rank's share of bytes
        prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        params = SamplingParams(max_new_tokens=24)
        assert eng.generate(prompts, params) == single.generate(prompts, params)
        whole, replicated = resident_bytes(single.loaded.model), _replicated_bytes(embedded_quantized)
        nodes = {i.get("node") for i in eng.runner.rank_info[1:]}
        assert len(nodes) >= (2 if p.world == 4 else 1)
        for info in eng.runner.rank_info:
            assert info["resident_bytes"] < whole / p.world + FLOAT_UPCAST * replicated
    finally:
        eng.runner.close()


DP_LAYOUTS = [pytest.param(dict(dp=2, moe_ep=2), id="dp2-moe_ep2"),
              pytest.param(dict(dp=2, tp=2, moe_ep=4), id="dp2-tp2-moe_ep4-two-nodes")]


@pytest.mark.slow
@pytest.mark.parametrize("layout", DP_LAYOUTS)
def test_dp_attention_groups_each_give_the_single_rank_logits(ray_cluster, embedded_quantized, tok, single, layout):
    """DP-attention: each dp group holds its own sequences and cache; a prompt run in either group (the other
    idle: a one-token step in its scratch block) gives the single-rank logits within DP_LOGIT_ATOL, the same
    argmax, and a batch spread over the groups the single-rank greedy tokens, MTP on. Not bit for bit: the
    idle group's token joins the MoE's batch, so the router's float GEMM sees another number of rows (on
    the CPU a 1-row GEMV and a 2-row GEMM round differently); the int8 linears stay exact."""
    eng = _sharded(embedded_quantized, layout, tok, "exact")
    try:
        assert eng.warm_up(tokens=96) > 0        # as a served replica starts (actors.serving.engine.engine_replica): no trace
        p = ParallelConfig(**layout)
        ids = tok.encode_chat([{"role": "user", "content": QUESTIONS[2]}])
        want = _prefill_then_decode(single.runner, ids)
        blocks = list(range(4))
        for g in range(p.dp):
            def one(spans, rows):
                per = [None] * p.dp
                per[g] = (spans, rows)
                return eng.runner.forward_dp(per)[g]
            first = one([Span(ids, 0, blocks)], [len(ids) - 1])
            second = one([Span([int(first[0].argmax())], len(ids), blocks)], [0])
            for w, g_ in ((want[0], first), (want[1], second)):
                assert float((w - g_).abs().max()) <= DP_LOGIT_ATOL and torch.equal(w.argmax(-1), g_.argmax(-1))
        prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        params = SamplingParams(max_new_tokens=24)
        assert eng.generate(prompts, params) == single.generate(prompts, params)
        assert [len(g.scheduler.running) + len(g.scheduler.waiting) for g in eng.groups] == [0] * p.dp
        # the KV handoff of disaggregated serving, both ways, into / out of group 1 (group 0 kept busy)
        want = single.generate(prompts[:1], params)[0]
        busy = submit(eng, prompts[1], params)                           # lands in group 0
        there = request(prompts[0], params)
        kv = eng.prefill(there)                                          # prefilled in group 1
        single.add_prefilled(there, kv)
        assert [kv.first_token] + drain(single)[there.request_id].tokens == want and eng._group_of[busy] == 0
        back = request(prompts[0], params)
        kv = single.prefill(back)
        eng.add_prefilled(back, kv)                                      # decoded in group 1
        assert eng._group_of[back.request_id] == 1
        got = drain(eng)
        assert [kv.first_token] + got[back.request_id].tokens == want and got[busy].finish_reason is not None
        assert len({i["node"] for i in eng.runner.rank_info[1:]}) >= (2 if p.world == 4 else 1)   # two nodes
        whole, replicated = resident_bytes(single.loaded.model), _replicated_bytes(embedded_quantized)
        for info in eng.runner.rank_info:   # experts split over all ranks; attention over tp only
            assert info["resident_bytes"] < whole / p.moe_ep + FLOAT_UPCAST * replicated + whole / p.tp
    finally:
        eng.runner.close()


def _replicated_bytes(path) -> int:
    src = QuantizedSource(path)
    p = ParallelConfig(tp=2)
    return sum(src.where[n].info(n).end - src.where[n].info(n).start for n in src.where
               if tensor_slice(src.config, p, 0, n) == FULL)


@pytest.mark.slow
def test_reduce_combine_agrees_within_float_rounding(ray_cluster, embedded_quantized, tok, single):
    eng = _sharded(embedded_quantized, dict(tp=2, moe_ep=2), tok, "reduce")
    try:
        ids = tok.encode_chat([{"role": "user", "content": QUESTIONS[1]}])
        for w, g in zip(_prefill_then_decode(single.runner, ids), _prefill_then_decode(eng.runner, ids)):
            assert float((w - g).abs().max()) <= REDUCE_LOGIT_ATOL
            assert torch.equal(w.argmax(-1), g.argmax(-1))
        prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        params = SamplingParams(max_new_tokens=24)
        assert eng.generate(prompts, params) == single.generate(prompts, params)
        assert eng.runner.comm.bytes_sent > 0
    finally:
        eng.runner.close()


@pytest.mark.slow
def test_msmodelslim_output_sharded(ray_cluster):
    """msModelSlim's own files for the tiny fixture (8 experts, 4 heads), tp 2 x moe_ep 2: the same logits."""
    path = str(MSMODELSLIM)
    cfg = EngineConfig(num_blocks=16, nz=True)
    one = _one_rank(path, cfg)
    from actors.serving.engine.rank_group import build_sharded_engine

    eng = build_sharded_engine(path, ParallelConfig(tp=2, moe_ep=2), cfg, combine="exact", log=lambda m: None)
    try:
        ids = [5, 17, 99, 3, 250, 7, 42]
        for w, g in zip(_prefill_then_decode(one.runner, ids), _prefill_then_decode(eng.runner, ids)):
            assert torch.equal(w, g)
    finally:
        eng.runner.close()


@pytest.mark.slow
def test_generate_job_sharded_gives_the_single_rank_answer(embedded_quantized):
    """The three jobs run side by side, each on one torch thread (its ranks too: they follow the driver) so
    that they share the cores without spin-waiting: each sharded one on a private Ray of its own (its GCS on
    a port the system gives, its session directory its own)."""
    import subprocess
    import sys

    def start(*flags) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "jobs.generate", "--model-path", embedded_quantized,
                                 "--max-new-tokens", "24", *flags, "What's deep learning?"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1"})

    def answer(p: subprocess.Popen) -> tuple[str, str]:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        return out, err

    procs = [start(), start("--tp", "2", "--moe-ep", "2"), start("--dp", "2", "--moe-ep", "2")]
    try:
        (one, _), (sharded, log), (dp, dp_log) = map(answer, procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sharded == one and "2 rank(s): dp 1 x tp 2" in log and "private local Ray" in log
    assert dp == one and "2 rank(s): dp 2 x tp 1" in dp_log


def test_serve_config_takes_sharded_layouts():
    from actors.serving.serve_config import ServeConfig

    cfg = ServeConfig("q", parallel={"tp": 2, "moe_ep": 2}, prefill_parallel={"tp": 2})
    assert (cfg.parallel_of("llm").moe_tp, cfg.parallel_of("prefill").moe_tp) == (1, 2)
    assert ServeConfig("q", parallel={"dp": 2, "moe_ep": 2}, mode="disaggregated").parallel_of("prefill").dp == 2
    with pytest.raises(ValueError, match="moe_ep 3 does not divide"):
        ServeConfig("q", parallel={"tp": 2, "moe_ep": 3})
    with pytest.raises(ValueError, match="parallel must be a mapping of tp, dp, moe_ep, moe_tp, sp"):
        ServeConfig("q", parallel={"pp": 2})
    with pytest.raises(ValueError, match="moe_combine must be"):
        ServeConfig("q", moe_combine="sum")
