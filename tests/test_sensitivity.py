"""Sensitivity: the recipe's fake-quant parameters from calibration equal the written ones, the pieces are
installed and removed exactly, the costs find the layer and the linears made hard on purpose, and the
fallback pick is the shortest ranked prefix meeting its target."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.model.loading import load_model
from pipeline.quant.evaluation.linear_refs import sqnr_db
from pipeline.quant.evaluation.fakequant import QuantLinear, load_fakequant_model
from pipeline.quant.evaluation.outlier_variant import VariantSpec
from pipeline.quant.recipe.recipe import FLOAT_PASS, Recipe
from pipeline.quant.job.run import QuantizeOptions, calibrate, quantize_checkpoint
from pipeline.quant.evaluation.sensitivity import (
    FakeQuantParams, FloatReference, Target, expert_groups, fa3_costs, linear_costs, quantized,
    attention_layer, rank_correlation, smallest_fallback,
)
from pipeline.quant.evaluation.variant_writer import write_variant
from tiny import FIXTURES, TINY_FIXTURE

CALIB = str(FIXTURES / "calib.json")
HARD_LAYER = 1      # its kv_a_layernorm gets outliers: its int8 latent must cost the most
HARD_INPUT = 2      # its input_layernorm gets outliers: its q_a / kv_a (static W8A8) must top the linears
SQNR_TOL_DB = 0.01  # one sample per forward against the evaluation's batch of them, float32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("sens")
    src, dst = str(d / "variant"), str(d / "q")
    # only HARD_LAYER's latent and HARD_INPUT's attention input carry outliers
    write_variant(str(TINY_FIXTURE), src, VariantSpec(seed=1, channels={"kv_a": 3}, log2_range=(6, 6),
                                                      layers=(HARD_LAYER,)), log=lambda m: None, check=False)
    write_variant(src, src + "2", VariantSpec(seed=2, channels={"input": 3}, log2_range=(6, 6), layers=(HARD_INPUT,)),
                  log=lambda m: None, check=False)
    src = src + "2"
    recipe = Recipe(calibration=FLOAT_PASS)      # FakeQuantParams.from_stats takes the one-pass float statistics
    opts = QuantizeOptions(calib_path=CALIB, progress=False, estimate=False, device="cpu")
    quantize_checkpoint(src, dst, recipe, opts, log=lambda m: None)
    model = load_model(src, dtype=torch.float32, device="cpu")
    samples = [list(range(k, k + 40)) for k in range(0, 400, 100)]
    return src, dst, recipe, opts, model, FloatReference(model, samples)


def test_params_from_calibration_equal_the_written_ones(setup):
    src, dst, recipe, opts, model, _ = setup
    stats, _ = calibrate(src, recipe, QuantizeOptions(calib_path=CALIB, progress=False, device="cpu"))
    md_model = load_model(src, dtype=torch.bfloat16, device="cpu")
    mem, disk = FakeQuantParams.from_stats(md_model, stats, recipe), FakeQuantParams.from_dir(dst)
    assert sorted(mem.linears) == sorted(disk.linears) and len(mem.linears) == 4 * 3 + 3 + 2 * 27   # MTP stays float
    assert sorted(mem.fa_k) == sorted(disk.fa_k) == [0, 1, 2]
    for name, (kind, p) in disk.linears.items():
        assert mem.linears[name][0] == kind
        for k, v in p.items():
            assert torch.equal(mem.linears[name][1][k], v), (name, k)
    for i in disk.fa_k:
        assert torch.equal(mem.fa_k[i], disk.fa_k[i])


@torch.no_grad()
def test_quantized_installs_exactly_and_restores(setup):
    src, dst, _, _, model, _ = setup
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(3))
    before = model(ids)
    with quantized(model, FakeQuantParams.from_dir(dst)) as m:
        inside = m(ids)
        assert sum(isinstance(x, QuantLinear) for x in m.modules()) == 4 * 3 + 3 + 2 * 27
    assert torch.equal(inside, load_fakequant_model(dst)(ids))          # the written output, bit for bit
    assert torch.equal(model(ids), before) and not any(isinstance(x, QuantLinear) for x in model.modules())


def test_fa3_costs_find_the_hard_layer(setup):
    _, dst, _, _, _, ref = setup
    params = FakeQuantParams.from_dir(dst)
    kl = fa3_costs(ref, params, "kl")
    proxy = fa3_costs(ref, params, "sqnr")
    assert kl[0].key == proxy[0].key == HARD_LAYER
    assert [c.score for c in kl] == sorted((c.score for c in kl), reverse=True)
    assert kl[0].figures == ref.measure(params.only(fa=[HARD_LAYER])).to_dict()
    assert proxy[0].figures["latent_sqnr_db"] < min(c.figures["latent_sqnr_db"] for c in proxy[1:])
    assert rank_correlation(kl, kl) == 1.0 and rank_correlation(kl, kl[::-1]) == -1.0


def test_linear_costs_find_the_hard_linears(setup):
    _, dst, _, _, model, ref = setup
    params = FakeQuantParams.from_dir(dst)
    groups = expert_groups(list(params.linears))
    assert len(groups) == 4 * 3 + 3 + 2 * 3 + 2 * 3 and groups["model.layers.1.mlp.experts.*.down_proj"][0] == \
        "model.layers.1.mlp.experts.0.down_proj"
    hard = {f"model.layers.{HARD_INPUT}.self_attn.{m}" for m in ("q_a_proj", "kv_a_proj_with_mqa")}
    proxy = linear_costs(ref, params, "sqnr", groups)
    kl = linear_costs(ref, params, "kl", groups)
    block = linear_costs(ref, params, "residual", groups)
    assert {c.key for c in proxy[:2]} == {c.key for c in block[:2]} == hard and kl[0].key in hard
    assert rank_correlation(kl, block) > 0
    # the proxy's SQNR of one linear, computed here on the float model's input to it
    name = f"model.layers.{HARD_INPUT}.self_attn.q_a_proj"
    seen = []
    h = model.get_submodule(name).register_forward_hook(lambda m, a, o: seen.append((a[0], o)))
    with torch.no_grad():
        for x in ref.ids:
            model(x[:, :-1])
    h.remove()
    q = QuantLinear(*params.linears[name])
    want = sqnr_db(torch.cat([o.flatten(0, 1) for _, o in seen]), torch.cat([q(a).flatten(0, 1) for a, _ in seen]))
    assert next(c for c in proxy if c.key == name).figures["sqnr_db"] == pytest.approx(want, abs=0.01)


def test_smallest_fallback(setup):
    _, dst, _, _, _, ref = setup
    params = FakeQuantParams.from_dir(dst)
    ranked = linear_costs(ref, params, "sqnr")
    full = ref.measure(params)
    none = smallest_fallback(ref, params, ranked, Target(min_agreement=0.0), "linear")
    assert none.keys == [] and none.met and none.metrics == full
    never = smallest_fallback(ref, params, ranked, Target(max_kl=-1.0), "linear")
    assert not never.met and never.keys == [c.key for c in ranked]
    floor = ref.measure(params.without(linears=[c.key for c in ranked]))    # the latents' share
    goal = Target(max_kl=(full.kl_mean + floor.kl_mean) / 2)
    pick = smallest_fallback(ref, params, ranked, goal, "linear")
    tried = dict(pick.tried)
    n = len(pick.keys)
    assert pick.met and goal.met(pick.metrics) and 0 < n < len(ranked)
    assert n - 1 in tried and not goal.met(tried[n - 1])              # one fewer misses it
    assert pick.metrics == ref.measure(params.without(linears=pick.keys))
    fa = smallest_fallback(ref, params, fa3_costs(ref, params, "sqnr"), Target(max_kl=1e9), "fa")
    assert fa.keys == [] and json.dumps(fa.to_dict())


def test_bad_arguments(setup):
    _, dst, _, _, _, ref = setup
    params = FakeQuantParams.from_dir(dst)
    with pytest.raises(ValueError, match="target: give at least one of .*min_attn_sqnr_db"):
        Target()
    with pytest.raises(ValueError, match=r"min_agreement must be in \[0, 1\]"):
        Target(min_agreement=95)
    with pytest.raises(ValueError, match="method: 'x'"):
        fa3_costs(ref, params, "x")
    with pytest.raises(ValueError, match="are not quantized linears"):
        linear_costs(ref, params, "sqnr", {"g": ["model.layers.0.mlp.gate"]})
    with pytest.raises(ValueError, match="kind: 'both'"):
        smallest_fallback(ref, params, [], Target(max_kl=1), "both")


def test_attention_sqnr_is_the_evaluations(setup):
    """With the attention captured, each measurement's lowest per-layer attention SQNR is what
    pipeline.quant.evaluation.evaluate reports as min_attn_sqnr_db for the written output on the same tokens."""
    from pipeline.quant.evaluation.evaluate import Candidate, compare

    _, dst, _, _, model, ref = setup
    params = FakeQuantParams.from_dir(dst)
    samples = [x[0].tolist() for x in ref.ids]
    att = FloatReference(model, samples, attention=True)
    got = att.measure(params)
    assert ref.measure(params).min_attn_sqnr_db is None          # not captured: not reported
    windows = torch.stack([x[0] for x in ref.ids])
    res = compare(model, [Candidate("q", "W8A8 + FA3", load_fakequant_model(dst, dtype=torch.float32))], windows,
                  per_linear=False)
    want = res.summary[1]
    assert got.min_attn_layer == want["min_attn_layer"] == HARD_LAYER       # its latent outliers
    assert got.min_attn_sqnr_db == pytest.approx(want["min_attn_sqnr_db"], abs=SQNR_TOL_DB)
    assert got.agreement == pytest.approx(want["agreement"], rel=1e-6)      # the rows keep 7 digits
    # a fallback judged on the attention SQNR: the shortest ranked prefix lifting every layer to the bound
    ranked = linear_costs(att, params, "residual", expert_groups(list(params.linears)))
    floor = att.measure(params.without(linears=list(params.linears))).min_attn_sqnr_db
    goal = Target(min_attn_sqnr_db=(got.min_attn_sqnr_db + floor) / 2)
    groups = expert_groups(list(params.linears))
    assert min(att.attention_sqnr(params).values()) == pytest.approx(got.min_attn_sqnr_db, abs=1e-9)
    pick = smallest_fallback(att, params, ranked, goal, "linear", groups)
    n = len(pick.keys)
    assert pick.met and pick.metrics.min_attn_sqnr_db >= goal.min_attn_sqnr_db and 0 < n < len(ranked)
    # the attention bound alone is met from the blocks: the pick is what it forced, attention pieces only,
    # per layer the shortest ranked prefix of that layer's own pieces that lifts it to the bound
    assert pick.keys == pick.forced and all(attention_layer(k, "linear", groups) is not None for k in pick.keys)
    for i in {attention_layer(k, "linear", groups) for k in pick.keys}:
        mine = [c.key for c in ranked if attention_layer(c.key, "linear", groups) == i]
        kept = [k for k in pick.keys if k in mine]
        assert kept == mine[:len(kept)]
        fewer = [m for k in pick.keys if k != kept[-1] for m in groups[k]]
        assert att.attention_sqnr(params.without(linears=fewer), [i])[i] < goal.min_attn_sqnr_db
    assert [k for k in ranked if attention_layer(k.key, "linear", groups) is None] and \
        not any(attention_layer(k, "linear", groups) is None for k in pick.keys)     # no MLP piece was needed
    assert pick.to_dict()["metrics"]["min_attn_sqnr_db"] == pytest.approx(pick.metrics.min_attn_sqnr_db)
    with pytest.raises(ValueError, match="min_attn_sqnr_db asks for the attention SQNR"):
        goal.met(ref.measure(params))
