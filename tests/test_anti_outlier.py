"""The pieces of iter_smooth / flex_smooth_quant: patterns, subgraphs, observers, formulas, the alpha/beta
rule, and both steps preserving a layer's function (the fixture parity is tests/test_anti_outlier_parity.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pipeline.config import DeepseekV3Config
from pipeline.model.causal_lm import build_model
from pipeline.quant.transforms import flex_smooth
from pipeline.quant.transforms.flex_smooth import choose, flex_smooth_layer, pick_alpha_beta, search_alpha_beta
from pipeline.quant.transforms.iter_smooth import iter_scales, iter_smooth_layer, shifts
from pipeline.quant.transforms.outlier_stats import ActivationRows, ChannelTrace, observing_subgraphs
from pipeline.quant.recipe.patterns import PatternError, expand_braces, matches, selected
from pipeline.quant.numerics.qparams import QuantError
from pipeline.quant.recipe.steps import FlexSmooth, IterSmooth
from pipeline.quant.transforms.subgraphs import (NORM_LINEAR, OV, UP_DOWN, layer_subgraphs, select_subgraphs, step_subgraphs,
                                      subgraph_weights, value_rows, with_value_rows)
from tiny import random_tensors, tiny_config

FUNCTION_REL = 1e-4   # a float32 layer, smoothed, against itself unsmoothed: max |diff| / max |out|


# ----- patterns ---------------------------------------------------------------------------------------
def test_patterns_expand_braces_and_match_whole_names():
    assert expand_braces("a.{q,kv}_{a,b}") == ["a.q_a", "a.q_b", "a.kv_a", "a.kv_b"]
    assert expand_braces("x{a,{b,c}}") == ["xa", "xb", "xc"]
    name = "model.layers.12.self_attn.kv_b_proj"
    assert matches(name, ["*self_attn*"]) and matches(name, ["model.layers.1?.*kv_b_proj"])
    assert not matches(name, ["*kv_b"]) and not matches(name, ["*SELF_ATTN*"])
    assert matches(name, ["model.layers.{3,12}.*"]) and not matches(name, ["model.layers.{1,2}.*"])
    assert selected(name, None, None) and selected(name, [], ["*q_a*"])
    assert not selected(name, ["*"], ["*kv_b_proj"]) and not selected(name, ["*mlp*"], None)
    for bad in ("a{b", "a}b"):
        with pytest.raises(PatternError, match="pattern"):
            matches(name, [bad])


# ----- subgraphs --------------------------------------------------------------------------------------
def tiny(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config.from_dict(tiny_config(**overrides))


def test_layer_subgraphs_follow_msmodelslim_adapter():
    cfg = tiny()
    sg0 = layer_subgraphs(cfg, 0)
    a = "model.layers.0.self_attn."
    assert [(s.kind, s.source, s.targets) for s in sg0] == [
        (OV, a + "kv_b_proj", (a + "o_proj",)),
        (NORM_LINEAR, "model.layers.0.input_layernorm", (a + "q_a_proj", a + "kv_a_proj_with_mqa")),
        (NORM_LINEAR, a + "q_a_layernorm", (a + "q_b_proj",)),
        (UP_DOWN, "model.layers.0.mlp.up_proj", ("model.layers.0.mlp.down_proj",))]
    sg1 = layer_subgraphs(cfg, 1)
    assert [s.source for s in sg1[3:]] == ["model.layers.1.mlp.shared_experts.up_proj"] + [
        f"model.layers.1.mlp.experts.{e}.up_proj" for e in range(cfg.n_routed_experts)]
    assert [s.routed_expert for s in sg1[3:5]] == [False, True]
    assert layer_subgraphs(cfg, cfg.num_hidden_layers) == []          # the MTP layer is never smoothed
    no_lora = layer_subgraphs(tiny(q_lora_rank=None), 0)
    assert no_lora[1].targets == ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa")
    assert [s.kind for s in no_lora] == [OV, NORM_LINEAR, UP_DOWN]


def test_select_subgraphs_filters_by_type_and_source_and_orders_by_priority():
    cfg = tiny()
    sgs = layer_subgraphs(cfg, 1)
    picked = select_subgraphs(list(reversed(sgs)), ["norm-linear", "ov"], ["*"], None)
    assert [s.kind for s in picked] == [OV, NORM_LINEAR, NORM_LINEAR]
    assert [s.source for s in picked][1:] == ["model.layers.1.self_attn.q_a_layernorm",
                                              "model.layers.1.input_layernorm"]      # stable within a priority
    kinds = [s.kind for s in select_subgraphs(sgs, ["norm-linear", "up-down", "ov"], None, None)]
    assert kinds == [UP_DOWN] * 9 + [OV, NORM_LINEAR, NORM_LINEAR]
    kept = select_subgraphs(sgs, ["norm-linear"], ["*"], ["*q_a_layernorm"])
    assert [s.source for s in kept] == ["model.layers.1.input_layernorm"]
    assert select_subgraphs(sgs, ["ov"], ["model.layers.{0,2}.*"], None) == []
    assert "model.layers.1.self_attn.kv_b_proj.weight" in subgraph_weights(picked)
    with pytest.raises(QuantError, match="unknown subgraph type 'attn'"):
        select_subgraphs(sgs, ["attn"], None, None)


def test_value_rows_round_trip():
    H, dn, dv, C = 3, 2, 4, 5
    w = torch.arange(H * (dn + dv) * C, dtype=torch.float32).view(H * (dn + dv), C)
    rows = value_rows(w, H, dn, dv)
    assert torch.equal(rows[dv], w[dn + dv + dn])                      # head 1's first value row
    back = with_value_rows(w, rows * 0 - 1, H, dn, dv)
    assert torch.equal(back.view(H, dn + dv, C)[:, :dn], w.view(H, dn + dv, C)[:, :dn])
    assert bool((back.view(H, dn + dv, C)[:, dn:] == -1).all())
    with pytest.raises(QuantError, match="kv_b_proj.weight"):
        value_rows(w[:-1], H, dn, dv)


# ----- observers --------------------------------------------------------------------------------------
def samples_with_outliers(seed: int, k: int = 24, dtype=torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (7, 3, 11, 5):
        x = torch.randn(1, n, k, generator=g) + torch.linspace(-2, 3, k)
        x[0, :, 3] *= 40                                                  # an outlier channel
        out.append(x.to(dtype))
    return out


def msmodelslim_shifted(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """msModelSlim's iter_smooth observer as it runs: every token, batch by batch, in the dtype."""
    lo = hi = cm = shift = None
    for x in xs:
        t = x.reshape(-1, x.shape[-1])
        lo = t.amin(0) if lo is None else torch.min(lo, t.amin(0))
        hi = t.amax(0) if hi is None else torch.max(hi, t.amax(0))
        shift = (hi + lo) / 2
        m = (t - shift).abs().amax(0)
        cm = m if cm is None else torch.max(cm, m)
    return cm, shift


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_channel_trace_replays_the_running_shift(dtype):
    xs = samples_with_outliers(0, dtype=dtype)
    trace = ChannelTrace()
    for x in xs:
        trace.observe(x)
    a, shift = trace.shifted_absmax()
    ref_a, ref_shift = msmodelslim_shifted(xs)
    assert a.dtype == dtype and torch.equal(a, ref_a) and torch.equal(shift, ref_shift)
    assert torch.equal(trace.absmax(), torch.cat(xs, 1).abs().amax((0, 1)))
    # the running shift makes the result depend on the order: merging keeps it (a's samples first)
    first, second = ChannelTrace(), ChannelTrace()
    for x in xs[:2]:
        first.observe(x)
    for x in xs[2:]:
        second.observe(x)
    merged = first.merge(second)
    assert all(torch.equal(u, v) for u, v in zip(merged.shifted_absmax(), (a, shift)))
    assert not torch.equal(msmodelslim_shifted(xs[::-1])[0], a)


def test_observers_skip_padding_and_split_samples():
    xs = samples_with_outliers(1)
    lengths = [x.shape[1] for x in xs]
    padded = torch.zeros(len(xs), max(lengths), xs[0].shape[-1], dtype=xs[0].dtype)
    for b, x in enumerate(xs):
        padded[b, : lengths[b]] = x[0]
        padded[b, lengths[b]:] = 1000.0                                    # padding that must not count
    one, batched = ChannelTrace(), ChannelTrace()
    rows_one, rows_batched = ActivationRows(), ActivationRows()
    for x in xs:
        one.observe(x)
        rows_one.observe(x)
    batched.observe(padded, lengths)
    rows_batched.observe(padded, lengths)
    assert batched.samples == len(xs)
    assert all(torch.equal(u, v) for u, v in zip(batched.shifted_absmax(), one.shifted_absmax()))
    assert torch.equal(rows_batched.tensor(), rows_one.tensor())
    assert torch.equal(rows_one.tensor(), torch.cat([x[0] for x in xs]))
    with pytest.raises(QuantError, match="one sample per forward"):
        ChannelTrace().observe(padded.flatten(0, 1), lengths)
    with pytest.raises(QuantError, match="no activation observed"):
        ChannelTrace().absmax()


# ----- formulas ---------------------------------------------------------------------------------------
def test_iter_scales_formula_and_clamps():
    a = torch.tensor([4.0, 1e-8, 0.0, 9.0])
    w = torch.tensor([1.0, 0.0, 1.0, -3.0])                  # w clamps to 1e-5 (a signed max may be < 0)
    s = iter_scales(a, w, 0.5, 1e-5)
    expected = torch.tensor([2.0, (1e-8 ** 0.5) / (1e-5 ** 0.5), 1e-5, 3.0 / (1e-5 ** 0.5)])
    torch.testing.assert_close(s, expected, rtol=1e-6, atol=0)
    bf = iter_scales(a.bfloat16(), w.bfloat16(), 0.5, 1e-5)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf, (a.bfloat16().pow(0.5) / w.float().clamp(min=1e-5).bfloat16().pow(0.5))
                       .float().clamp(min=1e-5).bfloat16())
    with pytest.raises(QuantError, match="differ in shape"):
        iter_scales(a, w[:3], 0.5, 1e-5)


def test_pick_alpha_beta_breaks_ties_upwards_and_starts_beta_from_alpha():
    on_line = lambda a, b: abs(a + b - 1) < 1e-9                        # beta = 1 - alpha (phase 1)
    phase1 = {a: 0.5 if a in (0.3, 0.35) else 1.0 for a in flex_smooth.GRID}   # a tie: the later alpha wins

    def ties(a, b):   # phase 2: 0.1 and 1 - alpha tie with phase 1's best; the later beta wins
        return phase1[a] if on_line(a, b) else (0.5 if b == 0.1 else 0.6)
    assert pick_alpha_beta(ties) == (0.35, 0.65, 0.5)

    def better(a, b):  # phase 2 improves at 0.2, and 0.9 ties with that
        return phase1[a] if on_line(a, b) else (0.4 if b in (0.2, 0.9) else 0.6)
    assert pick_alpha_beta(better) == (0.35, 0.9, 0.4)
    assert pick_alpha_beta(lambda a, b: 1.0 if on_line(a, b) else 2.0) == (1.0, 0.0, 1.0)
    assert len(flex_smooth.GRID) == 21 and flex_smooth.GRID[7] == 0.35 and flex_smooth.GRID[-1] == 1.0


def test_search_prefers_smoothing_an_outlier_channel():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 32, generator=g)
    x[:, 5] *= 100
    w = torch.randn(48, 32, generator=g) / 6
    alpha, beta, err = search_alpha_beta(x, w)
    naive = flex_smooth._Search(x, w).error(0.0, 1.0)                    # no smoothing: scale 1 / w^1
    assert alpha > 0 and err <= naive
    assert err == flex_smooth._Search(x, w).error(alpha, beta)


def test_recipe_steps_select_and_set_the_smoothing():
    """The recipe's step objects (pipeline.quant.recipe.steps) drive the layer functions: which subgraphs, shifted
    or not, searched or not (msModelSlim searches unless both alpha and beta are set)."""
    cfg = tiny()
    m4 = IterSmooth(alpha=0.5, scale_min=1e-5, symmetric=False, enable_subgraph_type=("norm-linear", "ov"))
    sgs = step_subgraphs(m4, cfg, 0)
    assert [(s.kind, shifts(m4, s)) for s in sgs] == [(OV, False), (NORM_LINEAR, True), (NORM_LINEAR, True)]
    assert not any(shifts(IterSmooth(), s) for s in sgs)
    assert len(step_subgraphs(IterSmooth(), cfg, 1)) == 3 + 1 + cfg.n_routed_experts   # msModelSlim's defaults
    assert step_subgraphs(IterSmooth(exclude=("*layers.1.*",)), cfg, 1) == []
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(64, 16, generator=g), torch.randn(8, 16, generator=g)
    assert choose(x, w, FlexSmooth(alpha=0.5, beta=0.25)) == flex_smooth.FlexChoice(0.5, 0.25, None)
    assert choose(x, w, FlexSmooth(alpha=0.5)) == flex_smooth.FlexChoice(*search_alpha_beta(x, w))


# ----- whole layers on a float32 model ----------------------------------------------------------------
def float_model(seed: int = 0, **overrides):
    cfg = tiny(**overrides)
    tensors = random_tensors(cfg, seed, dtype=torch.float32)
    return cfg, tensors, build_model(cfg, tensors, dtype=torch.float32)


def token_samples(cfg, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (1, n), generator=g) for n in (9, 14, 6)]


@contextlib.contextmanager
def with_biases(model, biases: dict[str, torch.Tensor]):
    """Run ``model`` with ``biases`` (``<module>.bias`` names, norms included) added to module outputs."""
    handles = [model.get_submodule(n[: -len(".bias")]).register_forward_hook(
        lambda m, i, o, b=b: o + b.to(o.dtype)) for n, b in biases.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def sublayers(model, layer_id: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention(input_layernorm(h)), mlp(post_attention_layernorm(h))): each half of the layer on the same
    input, so that a MoE router (untouched by smoothing) sees the same tokens on both sides."""
    layer = model.model.layers[layer_id]
    B, S = h.shape[:2]
    cos, sin = model.rotary.cos_sin(torch.arange(S).expand(B, S))
    with torch.no_grad():
        return layer.self_attn(layer.input_layernorm(h), cos, sin), layer.mlp(layer.post_attention_layernorm(h))


@pytest.mark.parametrize("step", ["iter_smooth", "flex_smooth_quant"])
def test_steps_preserve_each_layers_function(step):
    """Every subgraph type smoothed (the shifted norm-linear form for iter_smooth), layer by layer: the
    smoothed attention and MLP (with the new biases) compute what they computed before, up to float32
    rounding (the two halves on the same input: a MoE router flips near-ties on rounding-level changes)."""
    cfg, tensors, model = float_model()
    if step == "iter_smooth":
        settings, kind, fn = IterSmooth(alpha=0.5, symmetric=False), ChannelTrace, iter_smooth_layer
    else:
        settings, kind, fn = FlexSmooth(), ActivationRows, flex_smooth_layer
    samples = token_samples(cfg)
    for i in range(cfg.num_hidden_layers):
        hs = [model.embed(t) for t in samples]
        with torch.no_grad():
            hs = [model.run_layers(h, range(i)) if i else h for h in hs]
        subgraphs = step_subgraphs(settings, cfg, i)
        with torch.no_grad(), observing_subgraphs(model, subgraphs, kind) as stats:
            before = [sublayers(model, i, h) for h in hs]
        p = f"model.layers.{i}."
        mine = {k: v for k, v in tensors.items() if k.startswith(p)}
        new = fn(mine, i, cfg, stats, settings)
        changed = {k for k in new if k not in mine or new[k] is not mine[k]}
        assert changed <= subgraph_weights(subgraphs) | {k for k in new if k.endswith(".bias")}
        assert any("kv_b_proj" in k for k in changed) and any("experts" in k or "mlp.up" in k for k in changed)
        biases = {k: v for k, v in new.items() if k.endswith(".bias")}
        assert bool(biases) == (step == "iter_smooth")
        assert all(v.dtype == torch.float32 for v in biases.values())
        smoothed = build_model(cfg, {**tensors, **{k: v for k, v in new.items() if not k.endswith(".bias")}},
                               dtype=torch.float32)
        with with_biases(smoothed, biases):
            after = [sublayers(smoothed, i, h) for h in hs]
        for b, a in zip((t for pair in before for t in pair), (t for pair in after for t in pair)):
            rel = float((a - b).abs().max()) / float(b.abs().max())
            assert rel <= FUNCTION_REL, (i, rel)


def test_iter_smooth_symmetric_writes_no_bias_and_skips_idle_experts():
    cfg, tensors, model = float_model(1)
    settings = IterSmooth(alpha=0.5, symmetric=True, enable_subgraph_type=("norm-linear", "up-down"))
    subgraphs = step_subgraphs(settings, cfg, 1)
    with torch.no_grad(), observing_subgraphs(model, subgraphs, ChannelTrace) as stats:
        for t in token_samples(cfg):
            model.run_layers(model.embed(t), range(2))
    idle = "model.layers.1.mlp.experts.3.down_proj"
    stats = {**stats, idle: ChannelTrace()}                              # as if no token reached expert 3
    p = "model.layers.1."
    mine = {k: v for k, v in tensors.items() if k.startswith(p)}
    new = iter_smooth_layer(mine, 1, cfg, stats, settings)
    assert not any(k.endswith(".bias") for k in new)
    assert new[idle + ".weight"] is mine[idle + ".weight"]
    assert new[p + "mlp.experts.4.down_proj.weight"] is not mine[p + "mlp.experts.4.down_proj.weight"]
    del stats[p + "self_attn.q_b_proj"]
    with pytest.raises(QuantError, match="no statistics for model.layers.1.self_attn.q_b_proj"):
        iter_smooth_layer(mine, 1, cfg, stats, settings)
    with pytest.raises(QuantError, match="tensor model.layers.1.input_layernorm.weight is missing"):
        iter_smooth_layer({k: v for k, v in mine.items() if "input_layernorm" not in k}, 1, cfg,
                          {**stats, p + "self_attn.q_b_proj": ChannelTrace([torch.zeros(32)], [torch.ones(32)])},
                          settings)


def test_observing_subgraphs_sees_each_target_input():
    cfg, tensors, model = float_model(2)
    sgs = step_subgraphs(IterSmooth(enable_subgraph_type=("norm-linear", "ov")), cfg, 0)
    samples = token_samples(cfg)
    with torch.no_grad(), observing_subgraphs(model, sgs, ActivationRows) as rows:
        for t in samples:
            model.run_layers(model.embed(t), [0])
    assert sorted(rows) == sorted(s.observed for s in sgs)
    layer = model.model.layers[0]
    with torch.no_grad():
        normed = torch.cat([layer.input_layernorm(model.embed(t))[0] for t in samples])
    assert torch.equal(rows["model.layers.0.self_attn.q_a_proj"].tensor(), normed)
    o_in = rows["model.layers.0.self_attn.o_proj"].tensor()
    assert o_in.shape == (normed.shape[0], cfg.num_attention_heads * cfg.v_head_dim)
    with torch.no_grad():
        model.run_layers(model.embed(samples[0]), [0])                  # hooks are gone after the block
    assert rows["model.layers.0.self_attn.q_a_proj"].samples == len(samples)
