"""The fallback ladder (pipeline.quant.evaluation.fallback): pieces and their patterns, the moves' order by
error reduction per byte above int8, the recipe a pick writes and what the writer makes of it, the
W8A8_DYNAMIC rung's parameters, the search's pick on a model made hard on purpose, and the share of linear
weights above int8 read from a written output."""

from __future__ import annotations

import pytest
import torch

from pipeline.format.description import FLOAT, W8A8, W8A8_DYNAMIC
from pipeline.format.reader import read_quantized
from pipeline.quant.evaluation.fallback.rungs import Piece, dynamic_params, ladder_pieces, rung_bytes, with_ladder
from pipeline.quant.evaluation.fallback.search import (ladder_moves, ladder_search, params_at, rung_costs,
                                                     split_samples, state_of, within_budget)
from pipeline.quant.evaluation.fallback.share import linear_share, output_share
from pipeline.quant.evaluation.outlier_variant import VariantSpec
from pipeline.quant.evaluation.sensitivity import FakeQuantParams, FloatReference, Target
from pipeline.quant.evaluation.variant_writer import write_variant
from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
from pipeline.quant.recipe.patterns import selected
from pipeline.quant.recipe.recipe import FLOAT_PASS, Recipe
from tiny import FIXTURES, TINY_FIXTURE

CALIB = str(FIXTURES / "calib.json")
HARD_INPUT = 1          # its input_layernorm carries outliers: its static q_a / kv_a input suffers most
DYNAMIC_GAIN_DB = 5.0   # per-token activations recover at least this much SQNR on that pair
EXPERT_COST_RTOL = 1e-3  # the routed-expert proxy against the block rerun (float32 sums in another order)


def fake(names_kinds: dict[str, tuple[str, tuple[int, int]]]) -> dict:
    return {n: (k, {"weight": torch.zeros(shape, dtype=torch.int8)}) for n, (k, shape) in names_kinds.items()}


def test_pieces_pair_what_runtimes_fuse_and_split_the_experts():
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    linears = fake({a + "q_a_proj": (W8A8, (8, 4)), a + "kv_a_proj_with_mqa": (W8A8, (6, 4)),
                    a + "o_proj": (W8A8, (4, 4)), m + "shared_experts.gate_proj": (W8A8_DYNAMIC, (3, 4)),
                    m + "shared_experts.up_proj": (W8A8_DYNAMIC, (3, 4)),
                    m + "shared_experts.down_proj": (W8A8_DYNAMIC, (4, 3)),
                    **{f"{m}experts.{e}.{p}": (W8A8_DYNAMIC, (2, 4)) for e in range(12) for p in ("gate_proj", "up_proj")},
                    **{f"{m}experts.{e}.down_proj": (W8A8_DYNAMIC, (4, 2)) for e in range(12)}})
    pieces = {p.key: p for p in ladder_pieces(linears)}
    assert len(pieces) == 2 + 2 + 2 * 12
    qkv = pieces[a + "{q_a_proj,kv_a_proj_with_mqa}"]
    assert qkv.members == (a + "q_a_proj", a + "kv_a_proj_with_mqa") and qkv.weights == 8 * 4 + 6 * 4
    assert qkv.kind == W8A8 and qkv.rungs == (W8A8, W8A8_DYNAMIC, FLOAT) and qkv.attention and qkv.layer == 1
    e1 = pieces[m + "experts.1.{gate_proj,up_proj}"]
    assert e1.rungs == (W8A8_DYNAMIC, FLOAT) and e1.weights == 16 and not e1.attention
    assert e1.extra_bytes(FLOAT) == 16 and e1.extra_bytes(W8A8_DYNAMIC) == 0
    for key, p in pieces.items():     # each key is a rule pattern matching exactly its members
        assert [n for n in sorted(linears) if selected(n, (key,), ())] == sorted(p.members), key
    # a pair of two types stays two pieces
    mixed = fake({a + "q_a_proj": (W8A8, (2, 2)), a + "kv_a_proj_with_mqa": (W8A8_DYNAMIC, (2, 2))})
    assert [p.key for p in ladder_pieces(mixed)] == [a + "kv_a_proj_with_mqa", a + "q_a_proj"]


def piece(key: str, kind: str, weights: int) -> Piece:
    return Piece(key, (key,), kind, weights, 0, False)


def test_moves_free_first_by_gain_then_by_gain_per_byte():
    ps = [piece("a", W8A8, 100), piece("b", W8A8, 1000), piece("c", W8A8_DYNAMIC, 10), piece("d", W8A8, 50)]
    costs = {"a": {W8A8: 0.30, W8A8_DYNAMIC: 0.10, FLOAT: 0.0},    # dynamic gains 0.20, then 0.10 for 100 B
             "b": {W8A8: 0.50, W8A8_DYNAMIC: 0.05, FLOAT: 0.0},    # dynamic gains 0.45, then 0.05 for 1000 B
             "c": {W8A8_DYNAMIC: 0.02, FLOAT: 0.0},                # 0.02 for 10 B
             "d": {W8A8: 0.04, W8A8_DYNAMIC: 0.06, FLOAT: 0.0}}    # dynamic is worse: straight to FLOAT
    moves = ladder_moves(ps, costs)
    assert [(m.piece.key, m.rung) for m in moves] == [
        ("b", W8A8_DYNAMIC), ("a", W8A8_DYNAMIC),                  # free: 0.45, 0.20
        ("c", FLOAT), ("a", FLOAT), ("d", FLOAT), ("b", FLOAT)]    # per byte: 2e-3, 1e-3, 8e-4, 5e-5
    assert [m.bytes for m in moves] == [0, 0, 10, 100, 50, 1000]
    assert moves[3].gain == pytest.approx(0.10) and moves[4].gain == pytest.approx(0.04)
    assert state_of(moves[:4]) == {"b": W8A8_DYNAMIC, "a": FLOAT, "c": FLOAT}
    b = rung_bytes(ps, state_of(moves[:4]))
    assert b["above_int8"] == 110 and b["rungs"][FLOAT] == {"pieces": 2, "linears": 2, "weights": 110, "bytes": 220}
    assert b["rungs"][W8A8_DYNAMIC]["weights"] == 1000 and b["rungs"][W8A8]["weights"] == 50
    # a budget of bytes above int8: every free move, then the paid ones that still fit, in order
    assert [(m.piece.key, m.rung) for m in within_budget(moves, 60)] == [
        ("b", W8A8_DYNAMIC), ("a", W8A8_DYNAMIC), ("c", FLOAT), ("d", FLOAT)]
    assert [m.bytes for m in within_budget(moves, 0)] == [0, 0]


def test_the_budget_is_a_target_field():
    from pipeline.quant.evaluation.fallback import parse_target, target_text
    from pipeline.quant.numerics.qparams import QuantError

    t = parse_target("agreement=0.98,share=0.05")
    assert t == Target(min_agreement=0.98, max_share_above_int8=0.05) and parse_target(target_text(t)) == t
    with pytest.raises(QuantError, match="max_share_above_int8 must be in"):
        parse_target("share=2")


def test_the_held_out_slice_is_every_fourth_sample():
    fit, held = split_samples(list(range(10)))
    assert held == [3, 7] and fit == [0, 1, 2, 4, 5, 6, 8, 9]
    assert split_samples([1, 2, 3]) == ([1, 2, 3], [])


def test_share_counts_main_layer_linears_without_kv_b_and_router():
    types = {"model.layers.0.self_attn.q_a_proj": W8A8, "model.layers.0.self_attn.kv_b_proj": FLOAT,
             "model.layers.0.mlp.gate": FLOAT, "model.layers.0.mlp.down_proj": FLOAT,
             "model.layers.1.mlp.experts.0.up_proj": W8A8_DYNAMIC, "model.layers.3.self_attn.o_proj": FLOAT}
    numel = dict.fromkeys(types, 100)
    s = linear_share(types, numel, n_layers=3)
    assert s["weights"] == {W8A8: 100, W8A8_DYNAMIC: 100, FLOAT: 100} and s["share"] == pytest.approx(1 / 3)


@pytest.fixture(scope="module")
def hard(tmp_path_factory):
    """The tiny fixture with outliers on one layer's attention input, quantized with static attention."""
    d = tmp_path_factory.mktemp("ladder")
    src, dst = str(d / "variant"), str(d / "q")
    write_variant(str(TINY_FIXTURE), src, VariantSpec(seed=3, channels={"input": 3}, log2_range=(6, 6),
                                                      layers=(HARD_INPUT,)), log=lambda m: None, check=False)
    recipe = Recipe(fa_quant=False, calibration=FLOAT_PASS)
    opts = QuantizeOptions(calib_path=CALIB, progress=False, estimate=False, device="cpu")
    quantize_checkpoint(src, dst, recipe, opts, log=lambda m: None)
    from pipeline.model.loading import load_model

    model = load_model(src, dtype=torch.float32, device="cpu")
    samples = [list(range(k, k + 40)) for k in range(0, 480, 60)]
    fit, held = split_samples(samples)
    return d, src, dst, recipe, opts, FloatReference(model, fit, attention=True), \
        FloatReference(model, held, attention=True)


QKV = f"model.layers.{HARD_INPUT}.self_attn.{{q_a_proj,kv_a_proj_with_mqa}}"
DOWN = "model.layers.1.mlp.experts.2.down_proj"


@pytest.fixture(scope="module")
def picked(hard):
    """``hard``'s source written with its hard pair made W8A8_DYNAMIC and one routed expert's down_proj FLOAT."""
    d, src, dst, recipe, opts, _, _ = hard
    out = str(d / "picked")
    quantize_checkpoint(src, out, with_ladder(recipe, (), [QKV], [DOWN]), opts, log=lambda m: None)
    return out


def test_dynamic_rung_is_what_the_writer_writes(hard, picked):
    """The W8A8_DYNAMIC parameters of a static linear, from the stored integers, equal those of the output
    written with that linear made W8A8_DYNAMIC (same int8 weight, the same scale), and the recipe a pick
    writes types every piece as the pick has it."""
    dst, out, qkv, down = hard[2], picked, QKV, DOWN
    params = FakeQuantParams.from_dir(dst)
    pieces = {p.key: p for p in ladder_pieces(params.linears)}
    assert pieces[qkv].kind == W8A8 and pieces[down].kind == W8A8_DYNAMIC
    _, types, tensors = read_quantized(out)
    _, before, _ = read_quantized(dst)
    for name in before:
        if name.endswith(".weight") and before[name] in (W8A8, W8A8_DYNAMIC):
            m = name[: -len(".weight")]
            want = W8A8_DYNAMIC if m in pieces[qkv].members else FLOAT if m == down else before[name]
            assert types[name] == want, name
    for m in pieces[qkv].members:
        kind, p = params.linears[m]
        dyn = dynamic_params(kind, p)
        assert torch.equal(dyn["weight"], tensors[m + ".weight"])
        torch.testing.assert_close(dyn["weight_scale"].float(), tensors[m + ".weight_scale"].float(), rtol=0, atol=0)
    share = output_share(out)
    w = params.linears[down][1]["weight"].numel()
    assert share["above_int8"] == w and 0 < share["share"] < 0.05


def test_a_mixed_output_is_clean_and_the_engine_runs_it_as_fake_quant_does(picked):
    """The output of a pick (a static pair made W8A8_DYNAMIC, one routed expert's projection FLOAT beside
    its int8 siblings) passes jobs.check's rules (vllm-ascend's aside: its fused MoE has one method per
    layer), and the engine, reading each linear's type from the
    description, gives the fake-quant model's greedy tokens."""
    from pipeline.engine.core.engine import LLMEngine
    from pipeline.engine.core.reference import generate_ids
    from pipeline.engine.protocol import SamplingParams
    from pipeline.format.checker import check_dir
    from pipeline.quant.evaluation.fakequant import load_fakequant_model

    from pipeline.format.runtimes import DSQUANT, VLLM_ASCEND, check_runtime

    out = picked
    report = check_dir(out)
    assert report.ok, report.to_text()
    assert check_runtime(out, DSQUANT).ok
    # vllm-ascend's fused MoE takes one method for all of a layer's routed experts: said, with the layer
    found = [(f.rule, f.where) for f in check_runtime(out, VLLM_ASCEND).violations]
    assert found == [("method-lookup", "model.layers.1.mlp.experts")], found
    prompt, params = [1, 17, 42, 99, 7, 256, 3], SamplingParams(max_new_tokens=12)
    want = generate_ids(load_fakequant_model(out), prompt, params)
    assert LLMEngine.from_dir(out, num_blocks=16, cache_dtype="float32").generate([prompt], params) == [want]


def test_the_search_takes_the_free_rung_first_and_the_fewest_bytes(hard):
    d, src, dst, recipe, opts, ref, held = hard
    params = FakeQuantParams.from_dir(dst)
    pieces = ladder_pieces(params.linears)
    dynamic = {m: dynamic_params(k, p) for m, (k, p) in params.linears.items() if k == W8A8}
    costs = rung_costs(ref, pieces, params, dynamic)
    qkv = QKV
    gain_db = 10 * torch.log10(torch.tensor(costs[qkv][W8A8] / costs[qkv][W8A8_DYNAMIC])).item()
    assert gain_db >= DYNAMIC_GAIN_DB, costs[qkv]
    moves = ladder_moves(pieces, costs)
    assert (moves[0].piece.key, moves[0].rung) == (qkv, W8A8_DYNAMIC)

    def at(ms):
        return params_at(params, pieces, state_of(ms), dynamic)
    quantized = ref.measure(params)
    # a target between the int8 model and float: met by a prefix, missed by the one before it
    target = Target(min_agreement=min(1.0, quantized.agreement + 0.5 * (1 - quantized.agreement)))
    pick = ladder_search(ref, held, moves, target, at)
    assert pick.met and pick.n > 0 and target.met(ref.measure(at(pick.taken)))
    assert target.met(held.measure(at(pick.taken))) and pick.heldout is not None
    fit_only = ladder_search(ref, None, moves, target, at)
    assert not target.met(ref.measure(at(fit_only.taken[:-1])))      # the shortest prefix on the fitting set
    assert fit_only.n <= pick.n                                         # held-out only adds moves
    assert pick.bytes == sum(m.bytes for m in moves[: pick.n])
    assert pick.metrics.agreement >= target.min_agreement


def test_routed_experts_cost_what_rerunning_their_block_costs(hard):
    """The routed experts' proxy from their own tokens equals sensitivity's block rerun (one MoE forward per
    piece and sample), up to float32 summation order."""
    from pipeline.quant.evaluation.fallback.search import expert_costs
    from pipeline.quant.evaluation.sensitivity import linear_costs

    ref, params = hard[5], FakeQuantParams.from_dir(hard[2])
    routed = [p for p in ladder_pieces(params.linears) if ".experts." in p.key][::7]
    assert len(routed) >= 4 and any("down_proj" in p.key for p in routed) and any("{" in p.key for p in routed)
    fast = expert_costs(ref, routed, params)
    slow = {c.key: c.score for c in linear_costs(ref, params, "residual", {p.key: list(p.members) for p in routed})}
    for p in routed:
        assert fast[p] == pytest.approx(slow[p.key], rel=EXPERT_COST_RTOL), p.key
