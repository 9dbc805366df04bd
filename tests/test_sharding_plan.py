"""The sharded replica on paper (pipeline.serving.sharding.plan): per-rank weights add up to the model, the single-rank
layout is the whole quantized model (against a count from layout.checkpoint_shapes and docs/format.md's
table, against the planner on the 671B header-only replica, and against msModelSlim's own fixture output),
known numbers of the 671B model, the KV and communication arithmetic, and the refusals. No weights, no Ray.

Tolerances: every byte count is exact (integers, == ); the communication figures are float products of
integers, compared with pytest.approx at its default (relative 1e-6)."""

from __future__ import annotations

import math

import pytest

from pipeline import layout
from pipeline.assets import EMBEDDED_CONFIG
from pipeline.config import DeepseekV3Config
from pipeline.io.checkpoint import CheckpointReader
from pipeline.io.safetensors_io import read_header
from pipeline.parallel import ParallelConfig
from pipeline.serving.sharding import plan as S
from pipeline.quant.job.costs import unit_costs
from pipeline.serving.sharding.replica import DEEPSEEK_V3_CONFIG, make_header_replica
from pipeline.quant.recipe.recipe import Recipe
from tiny import FIXTURES, TINY_FIXTURE

V3 = DeepseekV3Config.from_dict(DEEPSEEK_V3_CONFIG)
TINY_EMBEDDED = DeepseekV3Config.from_dict(EMBEDDED_CONFIG)
QMTP = Recipe(quantize_mtp=True)
SEED = ParallelConfig(tp=8, dp=2, moe_ep=4, moe_tp=4)
H200_TP8 = ParallelConfig(tp=8, dp=1, moe_ep=8, moe_tp=1)
H200_DP8 = ParallelConfig(tp=1, dp=8, moe_ep=8, moe_tp=1)
H100_16 = ParallelConfig(tp=8, dp=2, moe_ep=16, moe_tp=1)


def hand_count(cfg: DeepseekV3Config, quantize_mtp: bool = False) -> int:
    """The seed dialect's bytes from checkpoint_shapes and docs/format.md's tables alone (bf16 model): W8A8
    static = int8 weight + input_scale, input_offset (md [1]) + quant_bias (int32 [n]) + deq_scale (float32
    [n]) + weight_scale, weight_offset (md [n, 1]); W8A8_DYNAMIC = int8 weight + weight_scale, weight_offset;
    FA3 = fa_q scale md [H, 1] + offset int8 [H, 1], fa_k / fa_v scale md [1, 1] + offset int8 [1, 1];
    everything else md, the router bias float32."""
    total = 0
    for name, shape in layout.checkpoint_shapes(cfg).items():
        lid = layout.layer_of(name)
        quant = lid is not None and (lid < cfg.num_hidden_layers or quantize_mtp)
        module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        n_out, numel = shape[0], math.prod(shape)
        if quant and ".self_attn." in name and module in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            total += numel + 2 + 2 + 4 * n_out + 4 * n_out + 2 * n_out + 2 * n_out
        elif quant and ".mlp." in name and module.endswith("_proj"):
            total += numel + 2 * n_out + 2 * n_out
        elif name.endswith("e_score_correction_bias"):
            total += 4 * numel
        else:
            total += 2 * numel
    fa_layers = cfg.num_hidden_layers + (len(cfg.mtp_layer_ids) if quantize_mtp else 0)
    return total + fa_layers * (cfg.num_attention_heads * (2 + 1) + 2 * (2 + 1))


def multiplicity(p: S.Placement, par: ParallelConfig) -> int:
    """How many copies of a bucket's bytes the replica holds, summed over ranks."""
    if p.rule == S.REP or (p.rule == S.TP and p.split_dim is None):
        return par.world
    if p.rule == S.TP:
        return par.dp
    return 1 if p.split_dim is not None else par.moe_tp


# ----- the whole model --------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe,quantize_mtp", [(Recipe(), False), (QMTP, True)])
def test_single_rank_is_the_whole_quantized_model(recipe, quantize_mtp):
    plan = S.plan_sharding(V3, ParallelConfig(), 10 ** 13, recipe=recipe)
    assert plan.fits and plan.rank_bytes == (plan.weight_bytes,)
    assert plan.weight_bytes == plan.model_bytes == hand_count(V3, quantize_mtp)
    assert plan.collectives == ()


def test_the_planner_on_the_header_replica_counts_the_same(tmp_path):
    """The 671B release's header-only replica, read by the quantization planner (pipeline.quant.job.costs), gives
    the same output bytes, for the default recipe and --quantize-mtp."""
    make_header_replica(str(tmp_path / "v3"))
    reader = CheckpointReader(str(tmp_path / "v3"))
    for recipe in (Recipe(), QMTP):
        costs, _ = unit_costs(reader, recipe, 64)
        assert sum(c.output_bytes for c in costs) == S.model_bytes(V3, recipe)


def test_msmodelslim_fixture_output_is_placed_whole():
    """Every tensor msModelSlim wrote for the tiny fixture (ascendV1, MTP quantized) has a placement, and
    the calculator's bytes are the file's, tensor class by tensor class."""
    ref = read_header(str(FIXTURES / "msmodelslim-v1-bf16" / "quant_model_weights-00001-of-00001.safetensors"))
    cfg = CheckpointReader(str(TINY_FIXTURE)).config
    recipe = Recipe(dialect="ascendV1", quantize_mtp=True)
    by_part: dict[str, int] = {}
    for name, t in ref.tensors.items():
        part = S.placement(cfg, name).part
        by_part[part] = by_part.get(part, 0) + t.end - t.start
    ours: dict[str, int] = {}
    for b in S.model_buckets(cfg, recipe):
        ours[b.placement.part] = ours.get(b.placement.part, 0) + b.nbytes
    assert ours == by_part
    assert S.plan_sharding(cfg, ParallelConfig(), 10 ** 12, recipe=recipe).weight_bytes == sum(by_part.values())


def test_placement_rules():
    p = "model.layers.5."
    cases = {
        "model.embed_tokens.weight": ("embedding", S.TP, 0), "lm_head.weight": ("lm_head", S.TP, 0),
        "model.norm.weight": ("norms", S.REP, None), p + "input_layernorm.weight": ("norms", S.REP, None),
        p + "self_attn.q_a_proj.weight": ("attention", S.REP, None),
        p + "self_attn.kv_a_proj_with_mqa.deq_scale": ("attention", S.REP, None),
        p + "self_attn.q_a_layernorm.weight": ("norms", S.REP, None),
        p + "self_attn.q_b_proj.weight": ("attention", S.TP, 0),
        p + "self_attn.q_b_proj.deq_scale": ("attention", S.TP, 0),
        p + "self_attn.q_b_proj.input_scale": ("attention", S.TP, None),
        p + "self_attn.kv_b_proj.weight": ("attention", S.TP, 0),
        p + "self_attn.o_proj.weight": ("attention", S.TP, 1),
        p + "self_attn.o_proj.quant_bias": ("attention", S.TP, None),
        p + "self_attn.fa_q.scale": ("attention", S.REP, None), p + "self_attn.fa_k.scale": ("attention", S.REP, None),
        p + "mlp.gate.weight": ("router", S.REP, None), p + "mlp.gate.e_score_correction_bias": ("router", S.REP, None),
        p + "mlp.shared_experts.up_proj.weight_scale": ("shared_expert", S.TP, 0),
        p + "mlp.shared_experts.down_proj.weight": ("shared_expert", S.TP, 1),
        p + "mlp.experts.17.gate_proj.weight": ("routed_experts", S.MOE, 0),
        p + "mlp.experts.17.down_proj.weight": ("routed_experts", S.MOE, 1),
        p + "mlp.experts.17.down_proj.weight_scale": ("routed_experts", S.MOE, None),
        "model.layers.1.mlp.down_proj.weight": ("dense_mlp", S.TP, 1),
        "model.layers.61.embed_tokens.weight": ("embedding", S.TP, 0),
        "model.layers.61.shared_head.head.weight": ("lm_head", S.TP, 0),
        "model.layers.61.shared_head.norm.weight": ("norms", S.REP, None),
        "model.layers.61.eh_proj.weight": ("mtp_eh_proj", S.REP, None),
    }
    for name, want in cases.items():
        got = S.placement(V3, name)
        assert (got.part, got.rule, got.split_dim) == want, name
    assert S.placement(V3, p + "mlp.experts.17.up_proj.weight").expert == 17
    assert S.placement(V3, "model.layers.61.enorm.weight").section == "mtp"
    with pytest.raises(ValueError, match="not part of the model"):
        S.placement(V3, "model.extra.weight")


@pytest.mark.parametrize("par", [ParallelConfig(tp=2, moe_ep=2), ParallelConfig(tp=2, dp=2, moe_ep=4),
                                 ParallelConfig(tp=4, moe_ep=2), ParallelConfig(tp=2, dp=2, moe_ep=2, moe_tp=2)],
                         ids=lambda p: p.describe())
def test_the_engines_slices_hold_the_same_bytes(par):
    """Tensor by tensor, rank by rank, on msModelSlim's fixture output (every tensor it wrote): the bytes
    this calculator puts on a rank are those of the slice the sharded engine's loader reads
    (pipeline.engine.sharding.shard_spec.tensor_slice)."""
    shard_spec = pytest.importorskip("pipeline.engine.sharding.shard_spec")
    ref = read_header(str(FIXTURES / "msmodelslim-v1-bf16" / "quant_model_weights-00001-of-00001.safetensors"))
    cfg = CheckpointReader(str(TINY_FIXTURE)).config
    for name, t in ref.tensors.items():
        nbytes = t.end - t.start
        for r in range(par.world):
            s = shard_spec.tensor_slice(cfg, par, r, name)
            want = 0 if s is None else nbytes if s == shard_spec.FULL else nbytes // t.shape[s[0]] * (s[2] - s[1])
            assert S.tensor_share(cfg, par, r, name, t.shape, nbytes) == want, (name, r)


# ----- totals over ranks ----------------------------------------------------------------------------
CASES = [(V3, SEED), (V3, H200_TP8), (V3, H200_DP8), (V3, H100_16), (TINY_EMBEDDED, ParallelConfig(tp=2, moe_ep=2)),
         (TINY_EMBEDDED, ParallelConfig(tp=2, dp=2, moe_ep=4)), (TINY_EMBEDDED, ParallelConfig(tp=4, moe_ep=2))]


@pytest.mark.parametrize("cfg,par", CASES, ids=lambda x: x.describe() if isinstance(x, ParallelConfig) else "")
def test_per_rank_shares_add_up_to_the_model(cfg, par):
    """Sum over ranks of each bucket's share == its bytes x its copies in the replica (split parts once per
    dp group for tp, once in the replica for experts; replicated parts once per rank); the ranks' totals
    and kinds are the same sums."""
    buckets = S.model_buckets(cfg)
    E = cfg.n_routed_experts
    for b in buckets:
        got = sum(S.bucket_share(b, par, r, E) for r in range(par.world))
        assert got == b.nbytes * multiplicity(b.placement, par), b.example
    per_rank = [S.rank_weights(cfg, par, r) for r in range(par.world)]
    kind_total = {k: sum(b.nbytes for b in buckets if S.kind_of(b.placement) == k) for k in ("replicated", S.TP)}
    expert_cut = sum(b.nbytes for b in buckets if b.placement.rule == S.MOE and b.placement.split_dim is not None)
    expert_whole = sum(b.nbytes for b in buckets if b.placement.rule == S.MOE and b.placement.split_dim is None)

    def over_ranks(kind):
        return sum(v for d in per_rank for (_, _, k), v in d.items() if k == kind)

    assert over_ranks("replicated") == par.world * kind_total["replicated"]
    assert over_ranks(S.TP) == par.dp * kind_total[S.TP]
    assert over_ranks(S.MOE) == expert_cut + par.moe_tp * expert_whole
    plan = S.plan_sharding(cfg, par, 10 ** 13)
    assert sum(plan.rank_bytes) == over_ranks("replicated") + over_ranks(S.TP) + over_ranks(S.MOE)
    assert len(set(plan.rank_bytes)) == 1  # even splits: every rank holds the same bytes
    assert plan.weight_bytes == plan.replicated_bytes + plan.tp_share_bytes + plan.expert_bytes
    assert sum(plan.sections.values()) == sum(plan.parts.values()) == plan.weight_bytes
    # a rank's experts: E / moe_ep of them, each cut over moe_tp (down's per-channel scales whole)
    owned = {b.placement.expert for b in buckets if b.placement.rule == S.MOE and S.bucket_share(b, par, 0, E)}
    assert owned == set(range(E // par.moe_ep))


def test_the_671b_expert_share_by_hand():
    """The seed layout's rank 0: 64 experts of each MoE layer (moe_ep 4), each cut in 4 (moe_tp 4); a main
    layer's expert is W8A8_DYNAMIC (int8 3 x 7168 x 2048, gate/up scales bf16 2 x 2 x [2048, 1], down's
    2 x [7168, 1]), the FLOAT MTP layer's is bf16."""
    h, m = 7168, 2048
    cut, whole = 3 * h * m + 2 * (2 * 2 * m), 2 * 2 * h
    main = 58 * 64 * (cut // 4 + whole)
    mtp = 64 * 3 * h * m * 2 // 4
    plan = S.plan_sharding(V3, SEED, 64 * S.GB)
    assert plan.expert_bytes == main + mtp
    assert plan.sections["mtp"] > mtp


# ----- known numbers ----------------------------------------------------------------------------------
def test_known_numbers_of_the_671b_model():
    """The whole W8A8 + FA3 model: 701.63 GB with the default recipe (MTP layer FLOAT: 26.9 GB of it) and
    690.16 GB with --quantize-mtp (the bf16 release is 1,342 GB; the FP8 release 688.6 GB)."""
    total, q = S.model_bytes(V3), S.model_bytes(V3, QMTP)
    assert total == 701_634_462_654 and q == 690_157_791_316
    assert 671 * S.GB < q < total < 705 * S.GB
    assert S.model_bytes(V3) - S.model_bytes(V3, mtp=False) == 26_926_853_120
    assert S.kv_per_token(V3) == (61 * 640 + 1152, 62 * 1152)
    assert S.kv_per_token(V3, QMTP) == (62 * 640, 62 * 1152)
    assert S.kv_per_token(V3, mtp=False) == (61 * 640, 61 * 1152)


def test_kv_capacity_arithmetic():
    plan = S.plan_sharding(V3, SEED, 64 * S.GB)
    room = int(64 * S.GB * 0.9) - plan.weight_bytes - 4 * S.GB
    assert plan.kv_room_bytes == room
    assert plan.kv_tokens_per_group == room // 40192 and plan.kv_tokens == 2 * plan.kv_tokens_per_group
    assert plan.kv_tokens_bf16 == 2 * (room // 71424)
    assert plan.max_len_seqs_per_group == plan.kv_tokens_per_group // 163840
    # DP-attention: 8 groups, each holding its own sequences' whole latent cache
    dp8 = S.plan_sharding(V3, H200_DP8, 141 * S.GB)
    assert dp8.kv_tokens == 8 * dp8.kv_tokens_per_group


def test_decode_collectives_by_hand():
    h, V = 7168, 129280
    c = {(x.where, x.combine): x for x in S.decode_collectives(V3, H200_TP8)}
    o = c[("attention o_proj", None)]
    assert (o.group_size, o.calls_per_step) == (8, 62)
    assert o.payload_bytes == pytest.approx(62 * 4 * h) and o.moved_bytes == pytest.approx(62 * 4 * h * 2 * 7 / 8)
    lm = c[("lm_head logits (vocab-parallel)", None)]
    assert lm.payload_bytes == pytest.approx(2 * 4 * V) and lm.moved_bytes == pytest.approx(2 * 4 * V * 7 / 8)
    assert c[("MoE combine", "exact")].payload_bytes == pytest.approx(59 * 4 * 8 * h)
    assert ("MoE dispatch (DP-attention gather)", None) not in c  # dp 1: nothing to gather
    assert not any(x.inter_node for x in c.values())
    # the seed layout: per token of the step (2 tokens: one per dp group)
    s = {(x.where, x.combine): x for x in S.decode_collectives(V3, SEED, ranks_per_node=8)}
    assert s[("attention o_proj", None)].payload_bytes == pytest.approx(62 * 4 * h / 2)
    g = s[("MoE dispatch (DP-attention gather)", None)]
    assert (g.group, g.group_size, g.inter_node) == ("dp peers", 2, True)
    assert g.payload_bytes == pytest.approx(59 * 2 * h) and g.moved_bytes == pytest.approx(59 * 2 * h / 2)
    e = s[("expert down_proj (per expert)", None)]  # 2 tokens x top-8 / 4 expert groups = 4 slots per group
    assert (e.calls_per_step, e.group_size, e.inter_node) == (59 * 4, 4, False)  # 4 slots: <= 4 experts hit
    assert e.payload_bytes == pytest.approx(59 * 4 * 4 * h / 2)
    assert s[("MoE combine", "reduce")].moved_bytes == pytest.approx(59 * 4 * h * 2 * 15 / 16)
    totals = S.comm_totals(list(s.values()))
    assert totals["exact"]["payload"] - totals["reduce"]["payload"] == pytest.approx(59 * 4 * 7 * h)
    # moe_ep 1 over 8 ranks: each expert cut 8 ways, the world combine still issued (moe_tp rank 0 adds)
    m = {(x.where, x.combine): x for x in S.decode_collectives(V3, ParallelConfig(tp=8, moe_ep=1))}
    assert m[("MoE combine", "reduce")].group_size == 8 and m[("expert down_proj (per expert)", None)].group_size == 8
    dyn = {x.where for x in S.decode_collectives(V3, SEED, Recipe(dynamic=True))}
    assert "attention o_proj absmax" in dyn and "attention o_proj absmax" not in s


def test_the_tiny_embedded_model_tp2_moe_ep4():
    """dp 2 x tp 2 with moe_ep 4 on the embedded model (4 heads, 16 experts): 4 experts per rank, heads
    2 per rank, the KV figure of its 3 FA3 layers + the FLOAT MTP layer."""
    par = ParallelConfig(tp=2, dp=2, moe_ep=4)
    plan = S.plan_sharding(TINY_EMBEDDED, par, 10 ** 9, min_kv_tokens=1, reserve_bytes=0)
    assert plan.world == 4 and plan.fits
    assert S.plan_sharding(TINY_EMBEDDED, ParallelConfig(), 10 ** 9).weight_bytes == hand_count(TINY_EMBEDDED)
    per_expert = {}
    for b in S.model_buckets(TINY_EMBEDDED):
        if b.placement.rule == S.MOE:
            per_expert[b.placement.expert] = per_expert.get(b.placement.expert, 0) + b.nbytes
    assert len(per_expert) == 16 and len(set(per_expert.values())) == 1
    assert plan.expert_bytes == 4 * per_expert[0]  # moe_tp 1: whole experts
    assert plan.kv_bytes_per_token == 3 * 640 + 1152
    o = {x.where: x for x in plan.collectives}["attention o_proj"]
    assert o.payload_bytes == pytest.approx(4 * 4 * 256 / 2) and o.group_size == 2


# ----- refusals ---------------------------------------------------------------------------------------
def test_a_single_h200_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"701\.6 GB per rank exceed the usable 126\.9 GB") as e:
        S.check_fits(V3, ParallelConfig(), 141 * S.GB)
    assert "use more ranks" in str(e.value) and "at least 8 of these devices" in str(e.value)
    plan = S.plan_sharding(V3, ParallelConfig(), 141 * S.GB)
    assert not plan.fits and plan.refusal == str(e.value)
    with pytest.raises(ValueError, match="at least 8"):
        S.check_fits(plan)


def test_eight_h100_are_refused_and_sixteen_fit():
    with pytest.raises(ValueError, match="at least 16 of these devices") as e:
        S.check_fits(V3, H200_TP8, 80 * S.GB)
    assert "larger moe_ep" in str(e.value) and "routed experts" in str(e.value)
    assert S.check_fits(V3, H100_16, 80 * S.GB).kv_tokens_per_group > 163840


def test_a_layout_of_the_same_size_is_suggested_when_one_fits():
    """dp 8 x tp 1 replicates attention, embeddings and heads on every rank; on 110 GB devices a larger tp
    fits: the suggestion is the 8-rank layout with the most replica KV tokens (dp 2 x tp 4), and it fits."""
    with pytest.raises(ValueError, match="keep 8 ranks and change the layout to dp 2 x tp 4, moe_ep 8"):
        S.check_fits(V3, H200_DP8, 110 * S.GB)
    par, tokens = S.suggest(V3, H200_DP8, 110 * S.GB)
    assert S.check_fits(V3, par, 110 * S.GB).kv_tokens_per_group == tokens
    assert tokens * par.dp >= S.plan_sharding(V3, H200_TP8, 110 * S.GB).kv_tokens


def test_too_little_kv_room_is_refused():
    w = S.plan_sharding(V3, H200_TP8, 141 * S.GB).weight_bytes
    device = math.ceil((w + 4 * S.GB + 1000 * 40192) / 0.9)  # room for ~1000 tokens only
    plan = S.plan_sharding(V3, H200_TP8, device)
    assert not plan.fits and 900 < plan.kv_tokens_per_group < 1100
    assert "less than the minimum 4096" in plan.refusal and "use more ranks" in plan.refusal
    assert S.plan_sharding(V3, H200_TP8, device, min_kv_tokens=512).fits


def test_layouts_the_shapes_cannot_split_are_refused():
    with pytest.raises(ValueError, match="tp 3 does not divide"):
        S.plan_sharding(V3, ParallelConfig(tp=3, moe_ep=3), 141 * S.GB)
    with pytest.raises(ValueError, match="moe_tp 3 does not divide"):
        S.plan_sharding(V3, ParallelConfig(dp=3, moe_ep=1), 141 * S.GB)
    with pytest.raises(ValueError, match="moe_ep 3 does not divide the model's 256 routed experts"):
        S.plan_sharding(V3, ParallelConfig(dp=3, moe_ep=3), 141 * S.GB)
    with pytest.raises(ValueError, match="device_bytes"):
        S.plan_sharding(V3, SEED, 0)


def test_the_tabulated_layouts_and_markdown():
    rows = [S.plan_layout(V3, lay) for lay in S.LAYOUTS]
    assert [r.fits for r in rows] == [True, True, True, True, False, False]
    md = S.to_markdown(rows)
    assert md.count("**refused**") == 2 and "Refused:" in md
    assert "| MindIE seed: 2 nodes x 8 Ascend 910B (Ascend 910B 64 GB) | 16: 2 x 8 / 4 x 4 |" in md
    assert rows[0].to_dict()["parallel"] == SEED.to_dict()
